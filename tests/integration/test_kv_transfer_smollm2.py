"""Acceptance: SmolLM2 (float32) prefilled by one engine in another process, its KV shipped over gRPC on
loopback into a second engine's reserved pages -- same and different page sizes -- and decoded there, is
greedy-equal to one `engine.LLM` alone. Both engines end with zero pages and reservations."""
from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import time

import pytest
import torch

from engine import LLM, SamplingParams
from kv_transfer.contract import TransferState, make_transport
from kv_transfer.receiver import KVReceiver
from tests.exactness import assert_greedy_equal
from tests.kv_helpers import close_all, prefill_child_main
from tests.prompts import token_prompts

pytestmark = pytest.mark.slow
LENGTHS = [7, 300, 1100]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PREFILL_PAGE = 16


@pytest.fixture(scope="module")
def prompts_and_reference(smollm2_dir):
    alone = LLM(model="smollm2-135m", dtype="float32", page_size=16, num_pages=512, keep_logits=True)
    prompts = token_prompts(alone.tokenizer, LENGTHS)
    outs = alone.generate(prompts, PARAMS)
    close_all(llms=[alone])
    return prompts, [o.token_ids for o in outs], [torch.stack(o.logits) for o in outs]


@pytest.fixture(scope="module")
def prefill_process(smollm2_dir):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_child_main, args=(child, "smollm2-135m", "float32", PREFILL_PAGE, 512 << 10))
    proc.start()
    assert parent.poll(300), "prefill process did not start"
    assert json.loads(parent.recv())["ready"]
    yield parent
    parent.send(json.dumps({"op": "close"}))
    report = json.loads(parent.recv())
    proc.join(60)
    assert proc.exitcode == 0
    assert report["usage"]["pages_in_use"] == 0 and report["usage"]["reservations"] == 0, report
    assert not report["unfinished"], report


@pytest.mark.parametrize("decode_page", [PREFILL_PAGE, 32])
def test_prefill_in_another_process_then_decode_matches_one_engine(prompts_and_reference, prefill_process,
                                                                     decode_page):
    prompts, ref_tokens, ref_logits = prompts_and_reference
    dec = LLM(model="smollm2-135m", dtype="float32", page_size=decode_page, num_pages=-(-8192 // decode_page))
    transport = make_transport("grpc")
    rx = KVReceiver(dec)
    address = rx.serve(transport)
    descs = [rx.reserve(len(p), PARAMS) for p in prompts]
    jobs = [{"prompt": p, "max_tokens": PARAMS.max_tokens, "desc": dataclasses.asdict(d), "address": address}
            for p, d in zip(prompts, descs)]
    prefill_process.send(json.dumps({"op": "prefill", "jobs": jobs}))
    outs, sender_report, end = [], None, time.monotonic() + 600
    while sender_report is None or rx.num_live or dec.has_unfinished():
        outs += rx.step()
        idle = not (rx.num_live or dec.has_unfinished())
        if sender_report is None and prefill_process.poll(0.01 if idle else 0):
            sender_report = json.loads(prefill_process.recv())
        assert time.monotonic() < end, "transfers did not finish"
    assert [s[0] for s in sender_report["statuses"]] == ["done"] * len(prompts), sender_report
    assert all(rx.status(d.reservation_id).state == TransferState.DONE for d in descs)
    final = {o.request_id: o for o in outs if o.finished}
    got = [final[d.request_id] for d in descs]
    assert [o.prompt_token_ids for o in got] == prompts  # the prompt ids travelled with the KV
    assert_greedy_equal(ref_tokens, [o.token_ids for o in got], ref_logits)
    close_all(rx=rx, transport=transport, llms=[dec])
