"""KV moved between replicas of different layouts (engine side of issue 9 item 3), by hand.

A prompt is prefilled on one replica (`prefill_only`), its KV read out per (layer, global KV-head
range) with `kv_io.export_heads`, written into pages reserved on a replica of another layout with
`kv_io.import_heads`, and decoded there: the tokens are greedy-equal to one process alone. Layouts: a
random-weight Llama with 8 query / 2 KV heads, TP=4 (each KV head on two ranks) -> TP=1, TP=1 -> TP=4,
TP=2 -> TP=4, PP=2 -> TP=2. Page sizes differ between the two sides, as between real prefill and decode
pools. Every engine ends empty and every rank process is reaped. SmolLM2's layouts (TP=3 -> TP=1, TP=1 ->
TP=3, PP=2 -> TP=1) are test_parallel_kv_transfer's `slow` cases: the sender and receiver there call these
same two functions on the real model, so a second SmolLM2 run by hand here checked nothing more (issue 33).
"""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.parallel.kv_io import export_heads, import_heads
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.parallel_helpers import PROMPTS, assert_ranks_gone, reshard_engine, tiny_8q_2kv

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny82(tmp_path_factory):
    return tiny_8q_2kv(tmp_path_factory, "rs")


engine = reshard_engine


def prefill_there_decode_here(model_dir, src: dict, dst: dict, prompts, params) -> list[list[int]]:
    prefill, decode = engine(model_dir, page_size=4, **src), engine(model_dir, page_size=8, **dst)
    got = []
    try:
        for p in prompts:
            rid = prefill.add_request(p, params, prefill_only=True)
            first = [o for o in prefill.generate_until_idle() if o.request_id == rid][0]
            pages, n = prefill.held_pages(rid)
            res = decode.reserve(n)
            for chunk in export_heads(prefill, list(range(prefill.config.num_layers)), pages, 0, n):
                import_heads(decode, chunk, res.pages, 0, n)
            prefill.release_held(rid)
            did = decode.add_prefilled_request(p, first.token_ids[0], res.reservation_id, params)
            got.append([o for o in decode.generate_until_idle() if o.request_id == did][-1].token_ids)
        assert_engine_empty(prefill)
        assert_engine_empty(decode)
    finally:
        prefill.close()
        decode.close()
    for llm in (prefill, decode):
        if llm.model is None:
            assert_ranks_gone(llm)
    return got


@pytest.fixture(scope="module")
def tiny_alone(tiny82) -> list[list[int]]:
    """The reference of every layout: the prompts in one process (computed once; each layout changes only the
    replicas under test)."""
    with engine(tiny82) as llm:
        out = [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY)]
        assert_engine_empty(llm)
    return out


@pytest.mark.parametrize("src, dst", [(dict(tp=4), dict()), (dict(), dict(tp=4)), (dict(tp=2), dict(tp=4)),
                                      (dict(pp=2), dict(tp=2))], ids=["tp4-tp1", "tp1-tp4", "tp2-tp4", "pp2-tp2"])
def test_tiny_kv_moves_between_layouts(tiny82, tiny_alone, src, dst):
    assert_greedy_equal(tiny_alone, prefill_there_decode_here(tiny82, src, dst, PROMPTS[:3], GREEDY))

