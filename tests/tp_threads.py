"""Tensor parallelism inside one process, for fast unit tests: each rank a thread, the all-reduce a barrier
(`ThreadAllReduce`), one forward over a prompt (`run_forward`), and `sharded_forward` running `size` ranks of
a model's shards side by side and checking every rank came back with the same logits as rank 0."""
from __future__ import annotations

import threading
from typing import Callable

import torch

from engine.attention_context import SeqLayout, build_context
from engine.kv_cache.backend import make_backend
from engine.kv_cache.spec import KVPageSpec
from engine.model import LlamaForward


class ThreadAllReduce:
    """Sum over `n` threads in rank order: each rank calls its own `for_rank(r)` callable."""

    def __init__(self, n: int):
        self.parts: list[torch.Tensor | None] = [None] * n
        self.barrier = threading.Barrier(n)

    def for_rank(self, rank: int):
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0].clone())
            self.barrier.wait()  # everyone has read the parts before the next call overwrites them
            return total
        return all_reduce


def run_forward(model: LlamaForward, spec: KVPageSpec, ids: list[int]) -> torch.Tensor:
    backend = make_backend(spec, 4)
    ctx = build_context([SeqLayout("a", len(ids), 0, [0, 1, 2, 3])], spec.page_size, model.scale)
    with torch.inference_mode():
        hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)), ctx, backend)
        return model.logits(hidden)  # [num_tokens, vocab]


def sharded_forward(size: int, rank_logits: Callable[[int, Callable], torch.Tensor]) -> torch.Tensor:
    """`rank_logits(r, all_reduce)` on `size` threads at once; every rank must return rank 0's logits
    exactly (the same sums in the same order), which are returned."""
    reducer, out = ThreadAllReduce(size), [None] * size

    def rank(r: int) -> None:
        out[r] = rank_logits(r, reducer.for_rank(r))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank thread is stuck in an all-reduce"
    assert all(o is not None and torch.equal(o, out[0]) for o in out), "the ranks' logits differ"
    return out[0]


def tp_forward(cfg, full: dict, spec: KVPageSpec, ids: list[int], size: int) -> torch.Tensor:
    """The logits of `size` TP ranks built from `full`'s shards (engine.parallel.shard), run as threads."""
    from engine.parallel.shard import local_config, shard_kv_spec, shard_weights

    def rank_logits(r: int, all_reduce) -> torch.Tensor:
        model = LlamaForward(local_config(cfg, r, size), shard_weights(full, cfg, r, size), torch.float32,
                             all_reduce=all_reduce)
        return run_forward(model, shard_kv_spec(spec, r, size), ids)

    return sharded_forward(size, rank_logits)


class ThreadAllToAll:
    """`torch.distributed.all_to_all_single` with split sizes over `n` threads: each rank calls its own
    `for_rank(r)` callable (`engine.parallel.dispatch.AllToAll`)."""

    def __init__(self, n: int):
        self.chunks: list[list[torch.Tensor] | None] = [None] * n
        self.barrier = threading.Barrier(n)

    def for_rank(self, rank: int):
        def all_to_all(out: torch.Tensor, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
            self.chunks[rank] = list(x.split(in_splits))
            self.barrier.wait()
            got = [self.chunks[src][rank] for src in range(len(self.chunks))]
            assert [len(g) for g in got] == out_splits, "the receiver's splits disagree with what was sent"
            out.copy_(torch.cat(got))
            self.barrier.wait()  # everyone has read the chunks before the next call overwrites them
        return all_to_all
