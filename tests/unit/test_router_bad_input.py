"""Bad requests at the cluster router's intake (`cluster/intake.py`), each row a test (issue 8, section 3):
what the HTTP layer lets through to a Ray cluster (token ids, lengths against the pools' limits, sampling
values, duplicate ids) must end in a typed error naming the field before the request is admitted --
nothing reserved or submitted on any worker, the ledger unchanged -- while a request already in flight
runs to its end. Fake workers (tests/unit/test_router.py's), no model, no Ray."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from cluster.serving_api import GenerateRequest
from decode_worker.worker import DecodeDelta
from engine.errors import InvalidRequestError, UnknownModelError
from prefill_worker.worker import PrefillEvent
from tests.unit.test_router import PARAMS, make_router, settled, start, until, wid_of

NAN, INF = float("nan"), float("inf")
LIMITS = dict(decodes=(64,), vocab_size=50, max_model_len=64, prefill_capacity_tokens=40, max_queued_requests=8)


def p(**changes):
    return dataclasses.replace(PARAMS, **changes)


ROWS = {  # name: (prompt, params, field the typed error names)
    "token id = vocab": ([1, 50], PARAMS, "prompt"),
    "negative token id": ([1, -1], PARAMS, "prompt"),
    "boolean token id": ([1, True], PARAMS, "prompt"),
    "float token id": ([1, 2.0], PARAMS, "prompt"),
    "nested ids": ([[1, 2]], PARAMS, "prompt"),
    "no prompt": (None, PARAMS, "prompt"),
    "empty ids": ([], PARAMS, "prompt"),
    "empty text": ("", PARAMS, "prompt"),
    "prompt at max_model_len": (list(range(1, 49)) + [1] * 16, PARAMS, "max_tokens"),
    "prompt + max_tokens past max_model_len": ([1] * 39, p(max_tokens=30), "max_tokens"),
    "prompt past the prefill pool": ([1] * 41, p(max_tokens=1), "prompt"),
    "max_tokens 0": ([1, 2], p(max_tokens=0), "max_tokens"),
    "max_tokens negative": ([1, 2], p(max_tokens=-5), "max_tokens"),
    "max_tokens boolean": ([1, 2], p(max_tokens=True), "max_tokens"),
    "max_tokens float": ([1, 2], p(max_tokens=2.5), "max_tokens"),
    "temperature NaN": ([1, 2], p(temperature=NAN), "temperature"),
    "temperature inf": ([1, 2], p(temperature=INF), "temperature"),
    "temperature negative": ([1, 2], p(temperature=-1.0), "temperature"),
    "top_p zero": ([1, 2], p(top_p=0.0), "top_p"),
    "top_p NaN": ([1, 2], p(top_p=NAN), "top_p"),
    "repetition_penalty negative": ([1, 2], p(repetition_penalty=-1.0), "repetition_penalty"),
    "frequency_penalty inf": ([1, 2], p(frequency_penalty=INF), "frequency_penalty"),
    "stop token past vocab": ([1, 2], p(stop_token_ids=[50]), "stop_token_ids"),
    "seed negative": ([1, 2], p(seed=-1), "seed"),
    "logprobs past 20": ([1, 2], p(logprobs=21), "logprobs"),
    "empty stop string": ([1, 2], p(stop=[""]), "stop"),
}


def _run(body):
    async def main():
        router, fakes = make_router(**LIMITS)
        try:
            await body(router, fakes)
        finally:
            await router.shutdown()
    asyncio.run(main())


async def _refused(router, req, error=InvalidRequestError):
    gen = router.generate(req)
    with pytest.raises(error) as err:
        await gen.__anext__()
    return err.value


@pytest.mark.parametrize("name", list(ROWS))
def test_bad_request_row_is_refused_before_admission(name):
    prompt, params, field = ROWS[name]

    async def body(router, fakes):
        err = await _refused(router, GenerateRequest("bad", prompt, params, model="m"))
        assert err.field == field, err
        assert router.ledger.admitted == 0 and not router.flights.by_wid
        assert all(not f.log and not f.held for fs in fakes.values() for f in fs)
    _run(body)


def test_unknown_model_and_duplicate_id_and_every_row_while_a_request_runs():
    async def body(router, fakes):
        gen, first = start(router, "live")
        dec, pre = fakes["decode"][0], fakes["prefill"][0]
        await until(lambda: ("submit", wid_of(dec)) in pre.log)
        wid = wid_of(dec)
        await _refused(router, GenerateRequest("x", [1, 2], PARAMS, model="other"), UnknownModelError)
        dup = await _refused(router, GenerateRequest("live", [1, 2], PARAMS, model="m"))
        assert dup.field == "request_id"
        for prompt, params, field in ROWS.values():
            assert (await _refused(router, GenerateRequest("bad", prompt, params, model="m"))).field == field
        assert router.ledger.admitted == 1 and [k for k, _ in dec.log] == ["reserve"]
        await router.workers["prefill"][0].handle.call("emit", [PrefillEvent(wid, "first_token", [7], "a")])
        await router.workers["prefill"][0].handle.call("emit", [PrefillEvent(wid, "transfer_done")])
        await router.workers["decode"][0].handle.call("emit", [DecodeDelta(wid, [7, 8], "ab", 2, 2, True,
                                                                           "length")])
        dec.held.clear()
        pre.held.clear()
        out = [await first] + [d async for d in gen]
        assert [t for d in out for t in d.new_token_ids] == [7, 8] and out[-1].finish_reason == "length"
        await settled(router, fakes)
        assert router.ledger.balanced(0) and router.ledger.completed == 1
    _run(body)
