"""KV moved between replicas of different layouts (engine side of issue 9 item 3), by hand.

A prompt is prefilled on one replica (`prefill_only`), its KV read out per (layer, global KV-head
range) with `kv_io.export_heads`, written into pages reserved on a replica of another layout with
`kv_io.import_heads`, and decoded there: the tokens are greedy-equal to one process alone. Layouts: a
random-weight Llama with 8 query / 2 KV heads, TP=4 (each KV head on two ranks) -> TP=1, TP=1 -> TP=4,
TP=2 -> TP=4, PP=2 -> TP=2; SmolLM2 (`slow`): TP=3 -> TP=1, TP=1 -> TP=3, PP=2 -> TP=1. Page sizes
differ between the two sides, as between real prefill and decode pools. Every engine ends empty and
every rank process is reaped.
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


def alone(model_dir, prompts, params) -> list[list[int]]:
    with engine(model_dir) as llm:
        return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("src, dst", [(dict(tp=4), dict()), (dict(), dict(tp=4)), (dict(tp=2), dict(tp=4)),
                                      (dict(pp=2), dict(tp=2))], ids=["tp4-tp1", "tp1-tp4", "tp2-tp4", "pp2-tp2"])
def test_tiny_kv_moves_between_layouts(tiny82, src, dst):
    prompts = PROMPTS[:3]
    assert_greedy_equal(alone(tiny82, prompts, GREEDY), prefill_there_decode_here(tiny82, src, dst, prompts, GREEDY))


@pytest.mark.slow
@pytest.mark.parametrize("src, dst", [(dict(tp=3), dict()), (dict(), dict(tp=3)), (dict(pp=2), dict())],
                         ids=["tp3-tp1", "tp1-tp3", "pp2-tp1"])
def test_smollm2_kv_moves_between_layouts(smollm2_dir, src, dst):
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_dir)
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert_greedy_equal(alone(smollm2_dir, prompts, params),
                        prefill_there_decode_here(smollm2_dir, src, dst, prompts, params))
