"""Helpers of the parallel-engine tests: run one engine to completion and close it, compare a parallel
engine with one process (greedy-equal, logits within 1e-4), check every rank process is reaped."""
from __future__ import annotations

import os

import torch

from engine.llm import LLM
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal, assert_logits_close
from tests.prompts import COUNT, MIXED, SHORT

PROMPTS = [MIXED, SHORT, COUNT, [7] * 23]
# 16-token budget: the 40- and 23-token prompts are prefilled in chunks beside the others' decodes
BATCHING = dict(max_num_batched_tokens=16, max_num_seqs=4, page_size=4, num_pages=96)


def tiny_8q_2kv(tmp_path_factory, name: str):
    """A 3-layer random Llama with 8 query / 2 KV heads: TP 1, 2, 4 and PP 3 all split it."""
    from tests.tiny_models import write_tiny

    return write_tiny("llama", tmp_path_factory.mktemp(name) / "l82", num_hidden_layers=3, num_attention_heads=8,
                      num_key_value_heads=2, initializer_range=0.1)


def reshard_engine(model_dir, tp: int = 1, pp: int = 1, page_size: int = 4, ep: int = 1) -> LLM:
    """An engine of the resharding tests: float32, small pool, 16-token chunks."""
    return LLM(model=str(model_dir), dtype="float32", page_size=page_size, num_pages=64,
               max_num_batched_tokens=16, tensor_parallel_size=tp, pipeline_parallel_size=pp,
               expert_parallel_size=ep)


def assert_ranks_gone(llm: LLM) -> None:
    procs = llm.runner.ranks.procs
    assert all(p.returncode is not None for p in procs), "a rank process is still running"
    assert not any(os.path.exists(f"/proc/{p.pid}") for p in procs), "a rank process was not reaped"


def generate(model_dir, prompts, params, alone=(), **kw) -> tuple[list[list[int]], list]:
    """(tokens, logits) per prompt of `prompts` run together, then of each of `alone` run by itself in the same
    engine; the engine is closed and checked empty (and rank-free) on return."""
    llm = LLM(model=str(model_dir), dtype="float32", keep_logits=True, **{**BATCHING, **kw})
    try:
        outs = llm.generate(prompts, params) + [o for p in alone for o in llm.generate([p], params)]
        assert_engine_empty(llm)
    finally:
        llm.close()
    if llm.model is None:  # parallel: ranks in processes
        assert_ranks_gone(llm)
    return [o.token_ids for o in outs], [o.logits for o in outs]


def assert_parallel_equal(model_dir, prompts, params, alone=(), **parallel_kw) -> None:
    """`parallel_kw` (tensor_parallel_size=..., pipeline_parallel_size=..., expert_parallel_size=..., other
    LLM options) against the same engine in one process: greedy-equal, logits within 1e-4 (`prompts` together,
    then each of `alone` by itself)."""
    common = {k: v for k, v in parallel_kw.items() if not k.endswith("parallel_size")}
    ref, ref_logits = generate(model_dir, prompts, params, alone, **common)
    got, got_logits = generate(model_dir, prompts, params, alone, **parallel_kw)
    ref_stacked = [torch.stack(lg) for lg in ref_logits]
    assert_greedy_equal(ref, got, ref_stacked)
    for r, g, tokens in zip(ref_stacked, got_logits, got):
        assert_logits_close(r, torch.stack(g), len(tokens), atol=1e-4)
