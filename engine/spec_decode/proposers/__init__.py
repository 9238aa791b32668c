"""Proposers, registered by name: `propose(state) -> draft token ids` (DESIGN.md "Proposer").

A proposer is built once per engine by `make_proposer(name, ctx, **options)` and asked for drafts each
step (`propose_batch`, default: `propose` per request). It may learn from the target's logits (`observe`,
called after every forward with the input token of each row that has logits and that row) and holds
per-request state until `release(request_id)`. This registry is torch-free; implementations load lazily.

    ngram        prompt lookup over prompt + output (CopySpec-style), per-request n-gram index
    recycling    Token Recycling: adjacency matrix of the target's top candidates per token (< 2 MB)
    draft_model  a small causal LM with the target's vocabulary, its own paged KV; greedy drafts, or
                 drafts sampled with the request's own keyed noise (coupled) when it samples
    self_sparse  the target itself with sparse (Quest) attention over the request's own pages (TriForce /
                 MagicDec): drafts write KV into the request's slots that verification rewrites or rolls back
    oracle       test fake: the reference continuation (always right)
    always_wrong test fake: the reference continuation shifted by one id (always wrong)
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROPOSERS = {
    "ngram": "engine.spec_decode.proposers.ngram:NgramProposer",
    "recycling": "engine.spec_decode.proposers.recycling:RecyclingProposer",
    "draft_model": "engine.spec_decode.proposers.draft_model:DraftModelProposer",
    "self_sparse": "engine.spec_decode.proposers.self_sparse:SelfSparseProposer",
    "oracle": "engine.spec_decode.proposers.fakes:OracleProposer",
    "always_wrong": "engine.spec_decode.proposers.fakes:AlwaysWrongProposer",
}


@dataclass
class DraftState:
    """What a proposer sees of one request (read-only views; nothing here is the engine's live object)."""
    request_id: str
    token_ids: list[int]  # prompt + committed outputs (do not modify)
    num_prompt: int
    max_draft: int  # propose at most this many tokens
    # How the target samples this request (params, seed, output ids; `output_index` = the next output's):
    # a proposer that samples its drafts with the same keyed noise proposes what the target will draw
    # whenever the two distributions agree (draft_model). None: greedy, or not given.
    sampling: Any = None  # engine.sampler.SampleRequest for the first draft position


@dataclass(frozen=True)
class TargetParts:
    """The target engine's parts a proposer that runs the target itself uses (self_sparse)."""
    runner: Any  # engine.runner.ModelRunner: execute(StepBatch) -> StepOutput
    backend: Any  # the KV backend (None with tensor/pipeline parallelism: attention runs in ranks)
    tables: Any  # engine.kv_cache.block_table.BlockTables
    allocator: Any  # engine.kv_cache.allocator.PageAllocator


@dataclass(frozen=True)
class ProposerContext:
    """What the target engine tells a proposer when building it."""
    vocab_size: int
    model_dir: Path
    dtype: str
    target: TargetParts | None = None


class Proposer:
    name = "base"

    def propose(self, state: DraftState) -> list[int]:
        raise NotImplementedError

    def propose_batch(self, states: list[DraftState]) -> list[list[int]]:
        return [self.propose(s) for s in states]

    def observe(self, input_ids: list[int], logits) -> None:
        """logits [len(input_ids), vocab]: the target's prediction after each of these input tokens."""

    def release(self, request_id: str) -> None:
        """The request ended: drop its state."""


def make_proposer(name: str, ctx: ProposerContext, **options: Any) -> Proposer:
    from engine.errors import InvalidRequestError

    if name not in PROPOSERS:
        raise InvalidRequestError("speculative.proposer", f"unknown proposer {name!r}; one of {', '.join(PROPOSERS)}")
    module, cls = PROPOSERS[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)(ctx, **options)
    except TypeError as e:
        raise InvalidRequestError("speculative.proposer_options", f"{name}: {e}") from None
