"""`engine.LLM` on tiny random models: disaggregation entry points, two engines per process, hooks, leases.

The prefill-only -> reserve -> copy KV -> add_prefilled path is what the KV-transfer layer automates; here
the copy is done by hand between two engines with different page sizes, and decoding must be greedy-equal
to one engine alone.
"""
from __future__ import annotations

import pytest
import torch

from engine import InvalidRequestError, ReservationError, SamplingParams
from engine.attention_context import ObserveSpec
from engine.batch import SeqStep, StepBatch
from engine.llm import LLM
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.prompts import TINY_PROMPTS
from tests.tiny_models import write_tiny

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = TINY_PROMPTS


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def make(tiny_dir, **kw):
    return LLM(model=str(tiny_dir), dtype="float32", num_pages=kw.pop("num_pages", 64), **kw)


def copy_kv(src: LLM, src_pages, n_tokens, dst: LLM, dst_pages):
    """What the transfer layer does: read each layer's K/V by token range, write into the other pool."""
    def slots(pages, ps):
        return torch.tensor([pages[i // ps] * ps + i % ps for i in range(n_tokens)])
    s_slots, d_slots = slots(src_pages, src.kv_spec.page_size), slots(dst_pages, dst.kv_spec.page_size)
    for layer in range(src.config.num_layers):
        k, v = src.backend.read(layer, s_slots)
        dst.backend.write(layer, d_slots, k, v)


def test_prefill_elsewhere_then_decode_matches_one_engine(tiny_dir):
    alone = make(tiny_dir, page_size=4)
    reference = [o.token_ids for o in alone.generate(PROMPTS, GREEDY)]
    prefill, decode = make(tiny_dir, page_size=4), make(tiny_dir, page_size=8)
    got = []
    for p in PROMPTS:
        rid = prefill.add_request(p, GREEDY, prefill_only=True)
        first = [o for o in prefill.generate_until_idle() if o.request_id == rid][0]
        assert not first.finished and len(first.token_ids) == 1
        pages, n = prefill.held_pages(rid)
        assert n == len(p)
        res = decode.reserve(len(p))
        copy_kv(prefill, pages, n, decode, res.pages)
        prefill.release_held(rid)
        did = decode.add_prefilled_request(p, first.token_ids[0], res.reservation_id, GREEDY)
        got.append([o for o in decode.generate_until_idle() if o.request_id == did][-1].token_ids)
    assert_greedy_equal(reference, got)
    for llm in (alone, prefill, decode):
        assert_engine_empty(llm)


def test_two_engines_in_one_process_interleave(tiny_dir, tmp_path):
    other_dir = write_tiny("qwen2", tmp_path / "qwen", initializer_range=0.1)
    a, b = make(tiny_dir), make(other_dir)
    ref_a = [o.token_ids for o in a.generate(PROMPTS, GREEDY)]
    ref_b = [o.token_ids for o in b.generate(PROMPTS, GREEDY)]
    ids_a = [a.add_request(p, GREEDY) for p in PROMPTS]
    ids_b = [b.add_request(p, GREEDY) for p in PROMPTS]
    done = {}
    while a.has_unfinished() or b.has_unfinished():
        for o in a.step() + b.step():
            done[o.request_id] = o.token_ids
    assert_greedy_equal(ref_a + ref_b, [done[i] for i in ids_a + ids_b])
    assert_engine_empty(a)
    assert_engine_empty(b)


def test_expired_reservation_frees_pages_and_refuses_commit(tiny_dir):
    clock = FakeClock()
    llm = make(tiny_dir, clock=clock)
    res = llm.reserve(20, lease_s=5.0)
    assert llm.kv_usage()["pages_in_use"] == llm.tables.pages_for(20)
    clock.t += 5.0
    llm.step()  # the step loop expires lapsed leases
    assert llm.kv_usage() == {"pages_in_use": 0, "reservations": 0, "num_pages": 64}
    with pytest.raises(ReservationError, match="expired"):
        llm.add_prefilled_request(PROMPTS[0], 5, res.reservation_id, GREEDY)
    assert_engine_empty(llm)


def test_layer_hook_runs_after_every_layer_in_order(tiny_dir):
    llm = make(tiny_dir)
    seen = []
    llm.runner.add_layer_hook(lambda layer, batch: seen.append((layer, batch.num_tokens)))
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    n = llm.config.num_layers
    assert seen == [(i, len(PROMPTS[0])) for i in range(n)] + [(i, 1) for i in range(n)]
    assert_engine_empty(llm)


def test_attention_observation_matches_eager_attention(tiny_dir):
    from transformers import AutoModelForCausalLM

    llm = make(tiny_dir, page_size=4)
    ids = PROMPTS[2]
    llm.tables.append("obs", len(ids))
    batch = StepBatch([SeqStep("obs", ids, 0, 0, llm.tables.get("obs").pages, [len(ids) - 1])],
                      observe={"obs": ObserveSpec(window=4, slot_mass=True)})
    out = llm.execute(batch)
    llm.tables.free("obs")
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        ref = hf(torch.tensor([ids]), output_attentions=True).attentions  # per layer [1, heads, q, k]
    for layer, att in enumerate(ref):
        rec = out.observations[("obs", layer)]
        torch.testing.assert_close(rec["window"], att[0, :, -4:].mean(0), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rec["slot_mass"], att[0].sum((0, 1)), atol=1e-4, rtol=1e-5)
    assert_engine_empty(llm)


def test_stream_never_shows_part_of_a_stop_string(tiny_dir):
    llm = make(tiny_dir)
    full = llm.generate(PROMPTS[0], GREEDY)[0]
    words = full.text.split()
    stop = f"{words[3]} {words[4]} t999"  # words 3-4 appear, then a word that never comes: never hits
    rid = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]))
    shown = ""
    for o in llm.generate_until_idle():
        assert o.request_id == rid
        shown += o.new_text
        if not o.finished:
            partial = (words[3], f"{words[3]} {words[4]}")
            assert not o.text.endswith(partial), f"a partial stop string reached the stream: {o.text!r}"
    assert shown == full.text
    assert_engine_empty(llm)


def test_prefill_only_needs_room_for_one_token(tiny_dir):
    llm = make(tiny_dir, num_pages=4, page_size=4)  # 16 slots: a 12-token prompt + 1
    prompt = list(range(10, 22))
    big = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    with pytest.raises(InvalidRequestError):
        llm.add_request(prompt, big)  # a whole generation does not fit
    rid = llm.add_request(prompt, big, prefill_only=True)
    outs = llm.generate_until_idle()
    assert len(outs) == 1 and len(outs[0].token_ids) == 1 and not outs[0].finished
    assert llm.outputs._state == {}, "held request kept detokenizer state"
    llm.release_held(rid)
    assert_engine_empty(llm)
