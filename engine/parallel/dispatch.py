"""`AllToAllDispatch`: an MoE layer's tokens sent to the ranks that hold their experts and the outputs sent back,
for expert parallelism with data-parallel attention (`expert_worker.py`, `ExpertSpec.attention == "data"`).

Each expert rank attends only its own sequences, so a rank holds the hidden states of its own tokens only. Per
MoE layer, `dispatch(layer, h)` on every rank, in step:
    route its tokens over all experts (the router is whole on every rank) -> for each rank r, the tokens with
    at least one of their top-k experts in r's block, ascending (a token goes once to a rank, however many of
    its experts are there) -> all-to-all of the counts, then of the rows, then of their expert ids and weights
    (one float32 exchange) -> the
    rank runs its own experts on what it received (the `engine.moe` implementation `moe_choice` names, which
    computes only the assignments to its experts: a partial sum per row) -> all-to-all of the partial sums back
    -> each token's partials added in rank order (its experts' sum; the shared expert is the model's business).
A rank with no tokens this step (`idle`) still takes part in every layer's exchanges, sending nothing: the
other ranks' tokens may need its experts. Collectives: `torch.distributed.all_to_all_single` with split sizes
(gloo on CPU, NCCL on CUDA), four per MoE layer; the rows cross the wire in the model dtype.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from engine.moe import IMPLS, MoELayer, moe_choice, route


AllToAll = Callable[[torch.Tensor, torch.Tensor, list[int], list[int]], None]  # (out, in, out splits, in splits)


class AllToAllDispatch:
    """`rank` of `size` ranks trading tokens (its index in `group`), each holding `experts_per_rank` experts in
    rank order; `all_to_all` replaces torch.distributed's in tests (ranks as threads)."""

    def __init__(self, rank: int, size: int, experts_per_rank: int, group=None, all_to_all: AllToAll | None = None):
        self.rank, self.size, self.per_rank = rank, size, experts_per_rank
        self.all_to_all = all_to_all or (lambda out, x, o, i: dist.all_to_all_single(out, x, o, i, group=group))

    def _exchange(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """Rows of `x` split by `send` (counts per destination rank, in rank order) -> the rows every rank sent
        here, by source rank."""
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        self.all_to_all(out, x.contiguous(), recv, send)
        return out

    def __call__(self, layer: MoELayer, h: torch.Tensor) -> torch.Tensor:
        """h [num_tokens, hidden] (this rank's tokens, post-attention normed) -> the routed experts' weighted sum
        for them [num_tokens, hidden], computed wherever each expert lives."""
        weights, ids = route(layer, h)  # [num_tokens, top_k] each
        owner = ids // self.per_rank  # the rank holding each assignment's expert
        picks = [(owner == r).any(dim=1).nonzero().squeeze(1) for r in range(self.size)]  # tokens per rank
        send = [len(p) for p in picks]
        ones = [1] * self.size
        recv = self._exchange(torch.tensor(send, device=h.device), ones, ones).tolist()  # rows each rank sends here
        tokens = torch.cat(picks)  # [sent rows]: token of each row sent, by destination rank
        x = self._exchange(h.index_select(0, tokens), send, recv)
        # ids and weights in one exchange, as float32 (exact for both: expert ids < 2^24, weights float32 or bf16)
        k = ids.shape[1]
        routing = torch.cat([ids.float(), weights.float()], dim=1).index_select(0, tokens)  # [sent rows, 2k]
        routing = self._exchange(routing, send, recv)
        their_ids, their_weights = routing[:, :k].long(), routing[:, k:].to(weights.dtype)
        if x.shape[0]:  # this rank's experts on every row sent here: partial sums
            partial = IMPLS[moe_choice(h.device)](layer, x, their_weights, their_ids)
        else:
            partial = x
        back = self._exchange(partial, recv, send)  # [sent rows]: the partials of this rank's tokens
        return torch.zeros_like(h).index_add_(0, tokens, back)  # rank order: each token's partials summed

    def idle(self, layers: list[MoELayer], hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        """Take part in every MoE layer's exchanges of a step with no tokens of this rank's own."""
        empty = torch.empty(0, hidden, dtype=dtype, device=device)
        for layer in layers:
            self(layer, empty)
