"""Speculation wired end to end: YAML pool section -> engine kwargs -> DecodeWorker; the per-request
`pdserve.speculative` option -> SamplingParams; worker stats carry `spec_*` counters."""
from __future__ import annotations

import pytest

from cluster.http.openai_schema import parse_request, sampling_params
from cluster.spec import SpecError, parse_spec
from decode_worker.worker import DecodeWorker
from engine import InvalidRequestError, SamplingParams
from engine.sampling_params import SpecRequestOptions
from tests.conftest import assert_engine_empty


def _spec(decode: dict, prefill: dict | None = None) -> dict:
    return {"model": "smollm2-135m", "pools": {"prefill": prefill or {}, "decode": decode}}


def test_pool_section_becomes_engine_kwargs():
    s = parse_spec(_spec({"speculative": {"proposer": "recycling", "max_draft": 3, "gate": False}}))
    kw = s.engine_kwargs("decode")["speculative"]
    assert kw == {"proposer": "recycling", "max_draft": 3, "adaptive": True, "gate": False, "proposer_options": {}}
    assert "speculative" not in s.engine_kwargs("prefill")
    assert "speculative ngram <= 4" in parse_spec(_spec({"speculative": None})).pools.decode.describe()
    dm = parse_spec(_spec({"speculative": {"proposer": "draft_model", "draft_model": "smollm2-135m"}}))
    assert dm.engine_kwargs("decode")["speculative"]["proposer_options"] == {"model": "smollm2-135m"}


@pytest.mark.parametrize("decode,prefill,key", [
    ({"speculative": {"max_drafts": 3}}, None, "pools.decode.speculative.max_drafts"),
    ({"speculative": {"max_draft": 0}}, None, "pools.decode.speculative.max_draft"),
    ({"speculative": {"proposer": "medusa"}}, None, "pools.decode.speculative.proposer"),
    ({"speculative": {"proposer": "draft_model"}}, None, "pools.decode.speculative.draft_model"),
    ({"speculative": {"draft_model": "x"}}, None, "pools.decode.speculative.draft_model"),
    ({}, {"speculative": {}}, "pools.prefill.speculative"),
])
def test_bad_sections_name_the_key(decode, prefill, key):
    with pytest.raises(SpecError) as info:
        parse_spec(_spec(decode, prefill))
    assert key in str(info.value)


def test_request_option_reaches_sampling_params():
    body = {"model": "m", "prompt": "hi", "pdserve": {"speculative": {"max_draft": 2, "proposer": "ngram"}}}
    params = sampling_params(parse_request(body, "completion"), 0, 16)
    assert params.speculative == SpecRequestOptions(enabled=True, max_draft=2, proposer="ngram")
    assert sampling_params(parse_request({"model": "m", "prompt": "hi"}, "completion"), 0, 16).speculative is None
    for bad in ({"max_draft": 17}, {"proposer": "medusa"}, {"k": 1}):
        with pytest.raises(InvalidRequestError, match="pdserve.speculative"):
            parse_request({"model": "m", "prompt": "hi", "pdserve": {"speculative": bad}}, "completion")


def test_colocated_decode_worker_speculates_and_reports(tiny_dir):
    kw = {"model": str(tiny_dir), "dtype": "float32", "num_pages": 64}
    prompt = [5, 6, 7, 8] * 6
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    plain = DecodeWorker(kw, serve_kv=False)
    spec = DecodeWorker(dict(kw, speculative={"proposer": "ngram", "gate": False,
                                              "proposer_options": {"min_ngram": 1}}), serve_kv=False)
    outs = {}
    for name, w in (("plain", plain), ("spec", spec)):
        w.add_request("r", prompt, params)
        toks = []
        while w.has_work():
            toks += [t for delta in w.step() for t in delta.new_token_ids]
        outs[name] = toks
    assert outs["spec"] == outs["plain"] and len(outs["plain"]) == 16
    st = spec.stats()
    assert st.spec_steps > 0 and st.spec_drafted > 0 and st.spec_tokens_per_verify >= 1.0
    assert plain.stats().spec_steps == 0
    for w in (plain, spec):
        w.close()
        assert_engine_empty(w.llm)


def test_local_backend_reports_spec_counters(tiny_dir):
    import asyncio

    from cluster.local_backend import LocalEngineBackend
    from cluster.serving_api import GenerateRequest
    from engine.llm import LLM

    llm = LLM(model=str(tiny_dir), dtype="float32", num_pages=64,
              speculative={"proposer": "ngram", "gate": False, "proposer_options": {"min_ngram": 1}})
    backend = LocalEngineBackend(llm)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    async def run():
        async for _ in backend.generate(GenerateRequest("r", [5, 6, 7, 8] * 6, params, model="llama")):
            pass
        await asyncio.sleep(0.05)  # the engine thread snapshots counters after its step
        return await backend.stats()

    try:
        stats = asyncio.run(run())
    finally:
        backend.close()
    assert stats.extra["spec_num_verifies"] > 0 and "spec_acceptance_rate" in stats.extra
    assert_engine_empty(llm)
