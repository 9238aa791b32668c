"""Speculative decoding in `engine.LLM` on tiny random models: exactness, rollback, stops, leaks.

Every proposer (real and fake) must give the tokens plain decoding gives, greedy and sampled (the keyed
sampler draws each row with the noise of its output index), alone and 16 at a time, with preemption;
after every rollback the request's slots, pages and cached K/V equal a plain engine's; a stop inside an
accepted run ends the request exactly where plain decoding ends it. Every test ends with leak checks,
including the draft model's own page pool.
"""
from __future__ import annotations

import random

import pytest
import torch

from engine import SamplingParams
from engine.llm import LLM
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal, plain_reference
from tests.tiny_models import write_tiny_llama

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
SAMPLED = dict(max_tokens=20, temperature=0.9, top_p=0.95, repetition_penalty=1.1, ignore_eos=True, logprobs=2)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        motif = [rng.randrange(3, 256) for _ in range(rng.randrange(2, 6))]
        body = [rng.randrange(3, 256) for _ in range(rng.randrange(3, 30))]
        out.append(body + motif * rng.randrange(1, 4) + body[:3])  # repeats: n-gram lookup finds matches
    return out


PROMPTS = _prompts(16)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory, "draft", seed=7, num_hidden_layers=1)


def make(tiny_dir, spec=None, **kw):
    return LLM(model=str(tiny_dir), dtype="float32", num_pages=kw.pop("num_pages", 256),
               page_size=kw.pop("page_size", 4), speculative=spec, **kw)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """Plain greedy outputs and their logits, alone (the oracles' futures come from these)."""
    return plain_reference(make(tiny_dir, keep_logits=True), PROMPTS, GREEDY)


def spec_config(name: str, reference, draft_dir, tiny_dir, **kw) -> dict:
    opts = {}
    if name in ("oracle", "always_wrong"):
        opts = {"futures": {tuple(p): o for p, o in zip(PROMPTS, reference[0])}}
    elif name == "draft_model":
        opts = {"model": str(draft_dir), "page_size": 4, "num_pages": 256}
    elif name == "draft_model_target":
        name, opts = "draft_model", {"model": str(tiny_dir)}
    elif name == "self_sparse":  # a few pages of these 10-60 token prompts: the draft reads a sparse view
        opts = {"budget": 8, "recent": 4}
    return dict(dict(proposer=name, max_draft=4, gate=False, proposer_options=opts), **kw)


def finish(llm) -> None:
    assert_engine_empty(llm)
    for p in llm.spec.proposers.values():
        if hasattr(p, "kv_usage"):
            assert p.kv_usage()["pages_in_use"] == 0, f"draft model leaked pages: {p.kv_usage()}"
    assert not llm.spec.trackers, "per-request speculation state left"


PROPOSER_NAMES = ["ngram", "recycling", "oracle", "always_wrong", "draft_model", "draft_model_target", "self_sparse"]


@pytest.mark.parametrize("name", PROPOSER_NAMES)
def test_greedy_equals_plain_alone_and_16_concurrent(name, tiny_dir, draft_dir, reference):
    llm = make(tiny_dir, spec_config(name, reference, draft_dir, tiny_dir))
    alone = [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS[:4]]
    assert_greedy_equal(reference[0][:4], alone, reference[1][:4])
    together = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert_greedy_equal(reference[0], together, reference[1])
    st = llm.spec.stats
    assert st.num_verifies > 0 and st.num_drafted > 0, f"{name} never drafted: {st}"
    if name in ("oracle", "draft_model_target"):
        assert st.acceptance_rate == 1.0, st
        assert st.tokens_per_verify > 2.0, st
    if name == "always_wrong":
        assert st.num_accepted == 0 and st.tokens_per_verify == 1.0, st
    finish(llm)


@pytest.mark.parametrize("name", ["ngram", "oracle", "always_wrong", "recycling", "draft_model", "draft_model_target",
                                  "self_sparse"])
def test_sampled_tokens_and_logprobs_equal_plain(name, tiny_dir, draft_dir, reference):
    plain = make(tiny_dir)
    params = [SamplingParams(seed=100 + i, **SAMPLED) for i in range(len(PROMPTS))]
    ref = plain.generate(PROMPTS, params)
    futures = {tuple(p): o.token_ids for p, o in zip(PROMPTS, ref)}  # the sampled continuation
    cfg = spec_config(name, reference, draft_dir, tiny_dir)
    if "futures" in cfg["proposer_options"]:
        cfg["proposer_options"] = {"futures": futures}
    if name == "ngram":
        cfg["proposer_options"] = {"min_ngram": 1}  # sampled text repeats less: match single tokens too
    llm = make(tiny_dir, cfg)
    got = llm.generate(PROMPTS, [SamplingParams(seed=100 + i, **SAMPLED) for i in range(len(PROMPTS))])
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for a, b in zip(got, ref):
        assert [t.token_id for t in a.logprobs] == [t.token_id for t in b.logprobs]
        torch.testing.assert_close([t.logprob for t in a.logprobs], [t.logprob for t in b.logprobs],
                                   atol=1e-4, rtol=0)
    assert llm.spec.stats.num_verifies > 0
    if name == "oracle":
        assert llm.spec.stats.acceptance_rate == 1.0
    if name == "draft_model_target":
        # drafts sampled with the request's own keyed noise from the same distribution are the target's
        # samples (argmax drafts: 3% accepted on this tiny model at temperature 0.9, measured)
        assert llm.spec.stats.acceptance_rate > 0.95, llm.spec.stats
    assert_engine_empty(plain)
    finish(llm)


def test_preemption_under_speculation_keeps_outputs(tiny_dir, draft_dir, reference):
    llm = make(tiny_dir, spec_config("oracle", reference, draft_dir, tiny_dir), num_pages=40)
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert llm.scheduler.stats.num_preemptions > 0, "the pool was meant to be too small"
    assert_greedy_equal(reference[0], got, reference[1])
    finish(llm)


def _kv(llm, rid, n):
    t, ps = llm.tables.get(rid), llm.kv_spec.page_size
    slots = torch.tensor([t.pages[i // ps] * ps + i % ps for i in range(n)])
    return [llm.backend.read(layer, slots) for layer in range(llm.config.num_layers)]


@pytest.mark.parametrize("name", ["always_wrong", "ngram", "oracle", "self_sparse"])
def test_kv_after_rollback_equals_plain(name, tiny_dir, draft_dir, reference):
    """Step a drafted request and a plain one side by side; whenever they hold the same tokens, slot
    counts, page counts and cached K/V of the committed slots are equal (page size 2: drafts of 4 span
    pages, so rollbacks free whole pages)."""
    cfg = spec_config(name, reference, draft_dir, tiny_dir, max_draft=4, adaptive=False)
    if name == "self_sparse":  # its drafts wrote sparse-view KV into these slots: verification rewrote it
        cfg["proposer_options"] = {"budget": 2, "recent": 2}
    if name == "ngram":
        cfg["proposer_options"] = {"min_ngram": 1}
    spec = make(tiny_dir, cfg, page_size=2)
    plain = make(tiny_dir, page_size=2)
    prompt = PROMPTS[3]
    a, b = spec.add_request(prompt, GREEDY), plain.add_request(prompt, GREEDY)
    compared = 0
    while spec.has_unfinished():
        spec.step()
        req = spec.requests.get(a)
        if req is None:
            break
        n = len(req.token_ids) - 1
        t = spec.tables.get(a)
        assert req.num_computed == n and t.num_slots == n, (req.num_computed, t.num_slots, n)
        assert len(t.pages) == spec.tables.pages_for(n) == spec.allocator.num_in_use
        while plain.requests[b].num_output < req.num_output:
            plain.step()
        assert plain.requests[b].token_ids == req.token_ids
        assert plain.allocator.num_in_use == spec.allocator.num_in_use
        for (k1, v1), (k2, v2) in zip(_kv(spec, a, n), _kv(plain, b, n)):
            torch.testing.assert_close(k1, k2, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v1, v2, atol=1e-5, rtol=1e-5)
        compared += 1
    plain.abort(b)
    assert compared >= 3 and spec.spec.stats.num_verifies >= 3
    if name == "always_wrong":  # drafts of 4 slots took pages that the rollback had to free again
        assert spec.spec.stats.num_drafted > spec.spec.stats.num_verifies and spec.spec.stats.num_accepted == 0
    assert_engine_empty(plain)
    finish(spec)


def _run_streamed(llm, prompt, params):
    rid = llm.add_request(prompt, params)
    outs = [o for o in llm.generate_until_idle() if o.request_id == rid]
    assert "".join(o.new_text for o in outs) == outs[-1].text
    assert sum(len(o.new_token_ids) for o in outs) == len(outs[-1].token_ids)
    return outs


@pytest.mark.parametrize("kind", ["stop_token", "eos", "max_tokens", "stop_string"])
def test_stop_inside_an_accepted_run_ends_where_plain_ends(kind, tiny_dir, draft_dir, reference):
    prompt, ref = PROMPTS[0], reference[0][0]
    j = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])  # first stop at output index j
    kw = dict(max_tokens=20, temperature=0.0, ignore_eos=True)
    if kind == "stop_token":
        kw["stop_token_ids"] = [ref[j]]
    elif kind == "eos":
        kw["ignore_eos"] = False
    elif kind == "max_tokens":
        kw["max_tokens"] = j + 1
    else:
        words = " ".join(f"t{t}" for t in ref).split()
        kw["stop"] = [f"{words[j - 1]} {words[j]}"]
    plain = make(tiny_dir)
    spec = make(tiny_dir, spec_config("oracle", reference, draft_dir, tiny_dir, max_draft=8, adaptive=False))
    if kind == "eos":
        plain.scheduler.eos = spec.scheduler.eos = {ref[j]}
    a, b = _run_streamed(plain, prompt, SamplingParams(**kw)), _run_streamed(spec, prompt, SamplingParams(**kw))
    assert b[-1].token_ids == a[-1].token_ids == ref[:j + 1]
    assert (b[-1].text, b[-1].finish_reason) == (a[-1].text, a[-1].finish_reason)
    assert b[-1].finish_reason == ("length" if kind == "max_tokens" else "stop")
    assert len(b) < len(a), "the stop was meant to fall inside a multi-token accepted run"
    if kind == "stop_string":
        stop = kw["stop"][0]
        assert all(not o.text.endswith(stop.split()[0]) for o in b if not o.finished)
    assert_engine_empty(plain)
    finish(spec)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("kind", ["eos", "stop_token"])
def test_min_tokens_masks_stops_at_every_verify_position(kind, temperature, tiny_dir, draft_dir, reference):
    """EOS / a stop id that plain greedy decoding emits inside a drafted run, with min_tokens past it: each
    verify row is masked by its own output index, as plain decoding masks it, so both give the same tokens
    (with min-p and top-k on, sampled too) and none stops before min_tokens."""
    prompt, ref = PROMPTS[0], reference[0][0]
    j = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])
    kw = dict(max_tokens=20, temperature=temperature, seed=3, min_tokens=j + 4, min_p=0.05, top_k=40,
              ignore_eos=kind != "eos", stop_token_ids=[ref[j]] if kind == "stop_token" else [])
    plain = make(tiny_dir)
    spec = make(tiny_dir, spec_config("oracle", reference, draft_dir, tiny_dir, max_draft=8, adaptive=False))
    if kind == "eos":
        plain.scheduler.eos = spec.scheduler.eos = {ref[j]}
    a, b = _run_streamed(plain, prompt, SamplingParams(**kw)), _run_streamed(spec, prompt, SamplingParams(**kw))
    out = a[-1].token_ids
    assert b[-1].token_ids == out and (b[-1].text, b[-1].finish_reason) == (a[-1].text, a[-1].finish_reason)
    assert len(out) >= j + 4 and ref[j] not in out[:j + 4]
    if temperature == 0.0:
        assert out[:j] == ref[:j] and len(b) < len(a), "the masked stop was meant to fall inside a drafted run"
    assert_engine_empty(plain)
    finish(spec)


def test_abort_mid_run_releases_draft_model_state(tiny_dir, draft_dir, reference):
    llm = make(tiny_dir, spec_config("draft_model", reference, draft_dir, tiny_dir))
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS[:4]]
    for _ in range(4):
        llm.step()
    draft = llm.spec.proposers["draft_model"]
    assert draft.kv_usage()["pages_in_use"] > 0
    for rid in ids:
        llm.abort(rid)
    finish(llm)


def test_per_request_override(tiny_dir, draft_dir, reference):
    from engine import InvalidRequestError
    from engine.sampling_params import SpecRequestOptions

    llm = make(tiny_dir, spec_config("oracle", reference, draft_dir, tiny_dir))
    off = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, speculative={"enabled": False})
    assert llm.generate(PROMPTS[0], off)[0].token_ids == reference[0][0]
    assert llm.spec.stats.num_verifies == 0
    one = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, speculative=SpecRequestOptions(max_draft=1))
    assert llm.generate(PROMPTS[0], one)[0].token_ids == reference[0][0]
    assert llm.spec.stats.num_drafted == llm.spec.stats.num_verifies > 0
    other = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, speculative={"proposer": "recycling"})
    assert llm.generate(PROMPTS[0], other)[0].token_ids == reference[0][0]
    assert "recycling" in llm.spec.proposers
    with pytest.raises(InvalidRequestError, match="speculative.proposer"):
        llm.add_request(PROMPTS[0], SamplingParams(speculative={"proposer": "draft_model"}))
    with pytest.raises(InvalidRequestError, match="speculative.max_draft"):
        llm.add_request(PROMPTS[0], SamplingParams(speculative={"max_draft": 99}))
    finish(llm)


def test_gate_shares_fixed_cost_only_along_the_critical_path(tiny_dir):
    llm = LLM(model=str(tiny_dir), dtype="float32", num_pages=64, max_num_seqs=2, speculative={"proposer": "ngram"})
    short, long = SamplingParams(max_tokens=4, temperature=0.0), SamplingParams(max_tokens=40, temperature=0.0)
    llm.add_request([5, 6, 7], short, request_id="s")
    llm.add_request([5, 6, 8], long, request_id="l")
    sched = llm.scheduler.schedule()
    assert spec_shares(llm, sched, ["s", "l"]) == [0.0, 1.0]  # only the longest budget shortens the run
    assert spec_shares(llm, sched, ["s"]) == [0.0]  # s ends long before l, drafting or not: rows only
    assert spec_shares(llm, sched, ["l"]) == [1.0]
    llm.add_request([9, 9, 9], long, request_id="w")  # no free slot (max_num_seqs=2): it waits
    assert llm.scheduler.waiting
    assert spec_shares(llm, sched, ["s", "l"]) is None  # a freed slot is refilled: 1/n for every row
    llm.abort("w")
    assert spec_shares(llm, sched, ["s", "l"]) == [0.0, 1.0]
    res = llm.allocator.reserve(2, lease_s=60.0)  # a decode worker: KV of another request on its way
    assert spec_shares(llm, sched, ["s", "l"]) is None
    llm.allocator.cancel(res.reservation_id)
    for rid in ("s", "l"):
        llm.abort(rid)
    assert_engine_empty(llm)


def spec_shares(llm, sched, rids):
    return llm.spec._shares(sched, rids)
