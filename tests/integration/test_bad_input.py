"""Bad input gets a typed error naming the field, and requests in flight are not harmed."""
from __future__ import annotations

import math

import pytest

from engine import LLM, InvalidRequestError, SamplingParams, UnknownModelError
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    # float32: in-flight requests are checked token-exact against running alone (bf16 is not batch-invariant)
    return LLM(dtype="float32", page_size=16, num_pages=256, max_model_len=2048)


def bad_inputs(llm):
    ctx = llm.max_model_len
    vocab = llm.config.vocab_size
    return [
        ("prompt", "", GREEDY),
        ("prompt", [], GREEDY),
        ("prompt", [1] * (ctx + 5), GREEDY),
        ("max_tokens", [1] * (ctx - 10), SamplingParams(max_tokens=20)),
        ("max_tokens", "hello", SamplingParams(max_tokens=0)),
        ("temperature", "hello", SamplingParams(temperature=math.nan)),
        ("temperature", "hello", SamplingParams(temperature=-0.5)),
        ("top_p", "hello", SamplingParams(top_p=0.0)),
        ("top_p", "hello", SamplingParams(top_p=1.5)),
        ("prompt", [5, vocab, 7], GREEDY),
        ("prompt", [5, -1, 7], GREEDY),
        ("prompt", 12345, GREEDY),
        ("stop_token_ids", "hello", SamplingParams(stop_token_ids=[vocab + 3])),
    ]


def test_bad_inputs_raise_typed_errors_while_others_complete(llm):
    alone = [llm.generate(p, GREEDY)[0].token_ids for p in ("The sea is", "Counting: one, two,")]
    ids = [llm.add_request(p, GREEDY) for p in ("The sea is", "Counting: one, two,")]
    for _ in range(3):
        llm.step()  # both requests are mid-generation when the bad ones arrive
    for field, prompt, params in bad_inputs(llm):
        with pytest.raises(InvalidRequestError) as err:
            llm.add_request(prompt, params)
        assert isinstance(err.value, ValueError)
        assert err.value.field == field, f"{prompt!r:.40} {params}: field {err.value.field}, expected {field}"
        llm.step()
    with pytest.raises(InvalidRequestError) as err:  # a duplicate request id
        llm.add_request("hi", GREEDY, request_id=ids[0])
    assert err.value.field == "request_id"
    done = {}
    while llm.has_unfinished():
        for o in llm.step():
            if o.finished:
                done[o.request_id] = o.token_ids
    assert_greedy_equal(alone, [done[i] for i in ids])
    assert_engine_empty(llm)


def test_abort_mid_flight_frees_pages(llm):
    keep = llm.add_request("Tell me a story", GREEDY)
    drop = llm.add_request("And another one", GREEDY)
    llm.step()
    llm.abort(drop)
    llm.abort(drop)  # idempotent
    outs = {}
    while llm.has_unfinished():
        for o in llm.step():
            outs[o.request_id] = o
    assert outs[keep].finished and len(outs[keep].token_ids) == GREEDY.max_tokens
    assert drop not in outs or not outs[drop].finished or outs[drop].finish_reason == "abort"
    assert_engine_empty(llm)


def test_unknown_model_is_a_typed_error():
    with pytest.raises(UnknownModelError) as err:
        LLM(model="no-such-model-7b")
    assert isinstance(err.value, ValueError) and "no-such-model-7b" in str(err.value)


def test_bad_dtype_is_a_typed_error():
    with pytest.raises(InvalidRequestError) as err:
        LLM(dtype="int3")
    assert err.value.field == "dtype"
