"""Helpers of the parallel-engine tests: run one engine to completion and close it, compare a parallel
engine with one process (greedy-equal, logits within 1e-4), check every rank process is reaped."""
from __future__ import annotations

import os

import torch

from engine.llm import LLM
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal, assert_logits_close

PROMPTS = [[5, 9, 33, 7, 81, 4, 4, 19, 200, 3, 17], [60, 61, 62], list(range(10, 50)), [7] * 23]
# 16-token budget: the 40- and 23-token prompts are prefilled in chunks beside the others' decodes
BATCHING = dict(max_num_batched_tokens=16, max_num_seqs=4, page_size=4, num_pages=96)


def assert_ranks_gone(llm: LLM) -> None:
    procs = llm.runner.ranks.procs
    assert all(p.returncode is not None for p in procs), "a rank process is still running"
    assert not any(os.path.exists(f"/proc/{p.pid}") for p in procs), "a rank process was not reaped"


def generate(model_dir, prompts, params, **kw) -> tuple[list[list[int]], list]:
    """(tokens, logits) per prompt; the engine is closed and checked empty (and rank-free) on return."""
    llm = LLM(model=str(model_dir), dtype="float32", keep_logits=True, **{**BATCHING, **kw})
    try:
        outs = llm.generate(prompts, params)
        assert_engine_empty(llm)
    finally:
        llm.close()
    if llm.model is None:  # parallel: ranks in processes
        assert_ranks_gone(llm)
    return [o.token_ids for o in outs], [o.logits for o in outs]


def assert_parallel_equal(model_dir, prompts, params, **parallel_kw) -> None:
    """`parallel_kw` (tensor_parallel_size=..., pipeline_parallel_size=..., other LLM options) against the
    same engine in one process: greedy-equal, logits within 1e-4."""
    common = {k: v for k, v in parallel_kw.items() if not k.endswith("parallel_size")}
    ref, ref_logits = generate(model_dir, prompts, params, **common)
    got, got_logits = generate(model_dir, prompts, params, **parallel_kw)
    ref_stacked = [torch.stack(lg) for lg in ref_logits]
    assert_greedy_equal(ref, got, ref_stacked)
    for r, g, tokens in zip(ref_stacked, got_logits, got):
        assert_logits_close(r, torch.stack(g), len(tokens), atol=1e-4)
