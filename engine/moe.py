"""Mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral): the router, the experts' SwiGLU, Qwen2-MoE's gated
shared expert, and the one point that chooses how a step's tokens reach their experts.

Who calls it: `engine.model.LlamaForward` builds an `MoELayer` for each sparse layer (`load_moe_layer`, from
the checkpoint's per-expert tensors or transformers' fused 3-D ones) and calls `moe_forward(layer, h)` where
a dense layer runs its gate_up / down projections (or, under expert or tensor parallelism, `routed_forward`
and `shared_forward` apart, to reduce each where it belongs: `engine.model`). The model's interface, KV pages,
prefix caching, speculation and KV transfer do not see the difference: only the MLP changes.

Order of `moe_forward(layer, h)`:
    route: router logits (model dtype) -> softmax over all experts in float32 -> top-k -> renormalised to
    sum 1 where the config says (Mixtral always, Qwen3-MoE per `norm_topk_prob`) -> the implementation
    `moe_choice()` names, each summing a token's k weighted expert outputs in ascending expert order
    (as transformers' `index_add_` does, so float32 results agree):
  "grouped" (CPU's): the step's (token, expert) assignments sorted by expert; each active expert runs one
      GEMM over all of its rows, so its weights are read once per step however many tokens chose it (up to
      `HOST_GROUPING_MAX` assignments grouped in Python from the ids: no sort kernels at batch 1-2, top-2).
      bf16 on CPU with small experts (`kernel_rows` > 0): the whole step in one numba call
      (`engine.kernels.cpu.moe_experts`: sort, the experts of few rows by its own dot products, weighting and
      sum), experts of many rows through `expert` (oneDNN): torch's per-expert ops cost ~100 us an active
      expert at tiny widths, more than reading its weights. Wide experts (Qwen3-30B's) keep the torch path.
      It reads the per-expert counts on the host, so a CUDA graph cannot hold it.
  "triton" (CUDA, by name until a GPU run has measured it): the same grouping on the device (`engine.kernels.cuda.moe_grouped`: sort and block
      padding in torch ops, two Triton GEMMs with SwiGLU and the weights fused, a per-token sum in ascending
      expert order), no host sync and static shapes: eager steps and CUDA graphs both read each active
      expert's weights once. `grouped` and `per_token` are its references (tests/unit/test_moe_triton.py).
  "per_token" (the reference): each token runs its k experts one row at a time: weights read once per
      assignment. Plain torch; the grouped paths' tests compare against it.
  "dense": every expert on every row through two batched matmuls over the stacked weights, unchosen experts
      weighted 0. No host sync, static shapes (E/k times the FLOPs, every expert's weights read): what a CUDA
      graph captures by default today.
Then, where the layer has one (Qwen2-MoE), the shared expert: SwiGLU of `shared_intermediate_size` on every
token times sigmoid(shared_expert_gate(h)), added to the routed sum (routed + shared, as transformers adds them).
Choice: `PDSERVE_MOE` = "auto" (grouped; dense while a CUDA graph is being captured: the Triton kernel has run
only under Triton's interpreter so far, so it becomes CUDA's default once a GPU run has measured it), "grouped",
"triton", "per_token" or "dense".

Expert parallelism (`engine.parallel.expert_worker`): a rank's layer holds a contiguous block of the experts
(`MoELayer.experts`, global ids) and the whole router; every implementation routes over all experts and
computes only the assignments to its own, so a rank's output is its partial sum (zero for a token none of its
experts chose), summed over the ranks by the model's `expert_reduce`; the shared expert is whole on every rank
(like the dense layers) and added once, after that sum (`engine.model`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from engine.config import MoEConfig
from engine.kernels.cpu.activations import swiglu
from engine.kernels.cpu.moe_experts import kernel_rows, moe_experts_bf16
from engine.linear import Linear

CHOICES = ("auto", "grouped", "triton", "per_token", "dense")
HOST_GROUPING_MAX = 4  # assignments (tokens x top-k) up to which `grouped` groups on the host (no sort kernels)


@dataclass
class SharedExpert:
    """Qwen2-MoE's shared expert: a SwiGLU MLP every token runs, scaled by sigmoid(gate . h)."""
    gate_up: Linear  # [2 * shared_intermediate, hidden]: gate rows, then up rows
    down: Linear  # [hidden, shared_intermediate]
    gate: torch.Tensor  # [1, hidden]: shared_expert_gate (whole on every rank, also under TP)

    def nbytes(self) -> int:
        return self.gate_up.nbytes() + self.down.nbytes() + self.gate.numel() * self.gate.element_size()


@dataclass
class MoELayer:
    cfg: MoEConfig
    router: torch.Tensor  # [num_experts, hidden]
    gate_up: torch.Tensor  # [num_experts, 2 * expert_intermediate, hidden]: gate rows, then up rows
    down: torch.Tensor  # [num_experts, hidden, expert_intermediate]
    gate_up_linear: list[Linear]  # one per expert, over views of `gate_up` (packed / GEMV paths on CPU)
    down_linear: list[Linear]
    first_expert: int = 0  # global id of gate_up[0]: an expert-parallel rank holds experts from here on
    shared: SharedExpert | None = None  # Qwen2-MoE: the gated shared expert

    @property
    def experts(self) -> range:
        """Global ids of the experts this layer holds (all of them outside expert parallelism)."""
        return range(self.first_expert, self.first_expert + self.gate_up.shape[0])

    def nbytes(self) -> int:
        """Every expert's weights and the router (a step reads only its active experts': `expert_bytes`)."""
        extra = sum(lin.nbytes() - lin.weight.numel() * lin.weight.element_size()
                    for lin in self.gate_up_linear + self.down_linear)  # float32 copies where bf16 cannot pack
        extra += self.shared.nbytes() if self.shared is not None else 0
        return sum(t.numel() * t.element_size() for t in (self.router, self.gate_up, self.down)) + extra

    def expert_bytes(self) -> int:
        """One expert's weight bytes (gate, up and down)."""
        return (self.gate_up[0].numel() + self.down[0].numel()) * self.gate_up.element_size()


def load_moe_layer(cfg: MoEConfig, weights: Mapping[str, torch.Tensor], w: Callable[[str], torch.Tensor],
                   prefix: str, experts: range | None = None) -> MoELayer:
    """The MoE MLP of the layer whose names start with `prefix` ("model.layers.3."). Checkpoints name experts
    one by one (Qwen3-MoE: mlp.gate, mlp.experts.E.{gate,up,down}_proj; Mixtral: block_sparse_moe.gate,
    block_sparse_moe.experts.E.{w1,w3,w2}); transformers 5 saved with `save_original_format=False` writes
    mlp.experts.gate_up_proj [E, 2I, H] and mlp.experts.down_proj [E, H, I]. `w` reads a tensor in the
    model's dtype and device. `experts` (expert parallelism): the global ids this rank holds; `weights` then
    has those experts' tensors (fused ones already sliced to them, `engine.parallel.experts.expert_slice`)."""
    experts = range(cfg.num_experts) if experts is None else experts
    block = "block_sparse_moe." if cfg.naming == "mixtral" else "mlp."
    if prefix + "mlp.experts.gate_up_proj" in weights:
        block = "mlp."
    p = prefix + block
    if p + "experts.gate_up_proj" in weights:
        gate_up, down = w(p + "experts.gate_up_proj"), w(p + "experts.down_proj")
    else:
        g, u, d = ("w1", "w3", "w2") if cfg.naming == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        n = experts
        gate_up = torch.stack([torch.cat([w(f"{p}experts.{e}.{g}.weight"), w(f"{p}experts.{e}.{u}.weight")])
                               for e in n])
        down = torch.stack([w(f"{p}experts.{e}.{d}.weight") for e in n])
    assert gate_up.shape[:2] == (len(experts), 2 * cfg.intermediate_size), gate_up.shape
    gate_up, down = gate_up.contiguous(), down.contiguous()
    return MoELayer(cfg, w(p + "gate.weight"), gate_up, down, [Linear(t) for t in gate_up], [Linear(t) for t in down],
                    experts.start, _shared(cfg, w, p))


def _shared(cfg: MoEConfig, w: Callable[[str], torch.Tensor], p: str) -> SharedExpert | None:
    """Qwen2-MoE's mlp.shared_expert.{gate,up,down}_proj and mlp.shared_expert_gate (a TP rank's slices of
    the first three: `engine.parallel.shard`)."""
    if not cfg.shared_intermediate_size:
        return None
    s = p + "shared_expert."
    gate_up = torch.cat([w(s + "gate_proj.weight"), w(s + "up_proj.weight")])
    return SharedExpert(Linear(gate_up), Linear(w(s + "down_proj.weight")), w(p + "shared_expert_gate.weight"))


# ---- routing and one expert ------------------------------------------------------------------------
def route(layer: MoELayer, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h [num_tokens, hidden] -> (weights [num_tokens, top_k], expert ids [num_tokens, top_k]), as
    transformers' routers compute them (weights in float32 for Mixtral, in the model dtype for Qwen3-MoE)."""
    logits = F.linear(h, layer.router)  # [num_tokens, num_experts], the model dtype (as transformers)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, layer.cfg.top_k, dim=-1)
    if layer.cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if layer.cfg.weights_in_model_dtype:
        weights = weights.to(h.dtype)
    return weights, ids


def expert(layer: MoELayer, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert `e`'s (global id, one the layer holds) SwiGLU MLP on rows x [rows, hidden] -> [rows, hidden]."""
    i = e - layer.first_expert
    return layer.down_linear[i](swiglu(layer.gate_up_linear[i](x)))


# ---- the implementations ----------------------------------------------------------------------------
def per_token(layer: MoELayer, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The reference: token by token, its experts one row at a time in ascending expert order."""
    out, held = torch.zeros_like(h), layer.experts  # [num_tokens, hidden]
    for t, row_ids in enumerate(ids.tolist()):
        for j in sorted((j for j, e in enumerate(row_ids) if e in held), key=row_ids.__getitem__):
            y = expert(layer, row_ids[j], h[t:t + 1]) * weights[t, j:j + 1]  # 1-d: promotes as HF's [n, 1]
            out[t:t + 1] += y.to(out.dtype)
    return out


def grouped(layer: MoELayer, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Assignments grouped by expert: one GEMM per active expert over all of its rows."""
    if h.dtype == torch.bfloat16 and h.device.type == "cpu" and kernel_rows(layer.gate_up, layer.down) > 0:
        # one numba call for the step (experts of many rows through `expert`); wide experts keep the torch path
        return moe_experts_bf16(h, ids, weights, layer.first_expert, layer.gate_up, layer.down,
                                lambda e, x: expert(layer, layer.first_expert + e, x))
    t, k = ids.shape
    if t * k <= HOST_GROUPING_MAX:
        return _grouped_on_host(layer, h, weights, ids)
    flat, ws = ids.reshape(-1), weights.reshape(-1)  # [t * k] expert and weight of each assignment, token-major
    held, kept = len(layer.experts), None
    if held < layer.cfg.num_experts:  # an expert-parallel rank: only the assignments to its own experts
        flat = flat - layer.first_expert  # local ids
        kept = ((flat >= 0) & (flat < held)).nonzero().squeeze(1)  # [assignments] kept, ascending
        flat, ws = flat[kept], ws[kept]
    order = torch.argsort(flat, stable=True)  # assignments by expert, tokens ascending within one
    counts = torch.bincount(flat, minlength=held).tolist()  # the host sync (see moe_choice)
    rows = (order if kept is None else kept[order]) // k  # token of each sorted assignment
    xs = h.index_select(0, rows)  # [assignments, hidden]: each expert's rows side by side
    ws = ws.index_select(0, order)[:, None]  # [assignments, 1]
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:  # [n, hidden]: expert e's weights read once
            outs.append(expert(layer, layer.first_expert + e, xs[start:start + n]))
            start += n
    if not outs:  # an expert-parallel rank none of whose experts was chosen
        return torch.zeros_like(h)
    ys = (torch.cat(outs) * ws).to(h.dtype)  # weighted, rounded to the model dtype as transformers does
    # one index_add in sorted order: each token's outputs summed in ascending expert order
    return torch.zeros_like(h).index_add_(0, rows, ys)


def _grouped_on_host(layer: MoELayer, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`grouped` for a few assignments (decode at small batch): grouped in Python from the ids, an expert
    chosen once reads its token's row in place; the sort, gather and scatter kernels would cost more than
    they save."""
    by_expert: dict[int, list[tuple[int, int]]] = {}  # expert -> (token, slot) pairs, tokens ascending
    held = layer.experts
    for tok, row in enumerate(ids.tolist()):
        for j, e in enumerate(row):
            if e in held:
                by_expert.setdefault(e, []).append((tok, j))
    w = weights.tolist()  # Python floats hold the float32 / bf16 values exactly: y * w rounds as y * tensor
    out = torch.zeros_like(h)  # [num_tokens, hidden]
    for e in sorted(by_expert):  # ascending expert order: each token's sum in transformers' order
        pairs = by_expert[e]
        tok = pairs[0][0]
        x = h[tok:tok + 1] if len(pairs) == 1 else h[[p[0] for p in pairs]]  # [rows, hidden]
        y = expert(layer, e, x)  # expert e's weights read once for all of its rows
        for r, (tok, j) in enumerate(pairs):
            out[tok:tok + 1] += (y[r:r + 1] * w[tok][j]).to(out.dtype)
    return out


def dense(layer: MoELayer, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Every expert on every row (batched matmuls), the unchosen weighted 0: no data-dependent shapes."""
    gate_up = torch.matmul(h.unsqueeze(0), layer.gate_up.transpose(1, 2))  # [E, num_tokens, 2 * inter]
    act = swiglu(gate_up.flatten(0, 1)).view(gate_up.shape[0], h.shape[0], -1)  # [E, num_tokens, inter]
    ys = torch.matmul(act, layer.down.transpose(1, 2))  # [E, num_tokens, hidden]
    full = torch.zeros(h.shape[0], layer.cfg.num_experts, dtype=weights.dtype, device=h.device)
    full.scatter_(1, ids, weights)  # [num_tokens, E]
    full = full[:, layer.experts.start:layer.experts.stop]  # the experts held (all, outside expert parallelism)
    out = torch.zeros_like(h)
    for e in range(ys.shape[0]):  # ascending expert order, as the others
        out += (ys[e] * full[:, e:e + 1]).to(out.dtype)
    return out


def grouped_triton(layer: MoELayer, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`grouped` on the device in Triton: no host sync, static shapes (CUDA graphs capture it)."""
    from engine.kernels.cuda.moe_grouped import moe_grouped  # imports triton: only where it was chosen

    return moe_grouped(h, ids, weights, layer.gate_up, layer.down, layer.first_expert)


IMPLS = {"grouped": grouped, "triton": grouped_triton, "per_token": per_token, "dense": dense}


def moe_choice(device: torch.device) -> str:
    """The implementation for the next call (read at call time: tests and benches set PDSERVE_MOE)."""
    choice = os.environ.get("PDSERVE_MOE", "auto") or "auto"
    if choice not in CHOICES:
        raise ValueError(f"PDSERVE_MOE={choice!r}: name one of {', '.join(CHOICES)}")
    if choice == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("PDSERVE_MOE=triton runs on CUDA (on a CPU only under TRITON_INTERPRET=1, for tests)")
    if choice != "auto":
        return choice
    if device.type != "cuda":
        return "grouped"
    # (the Triton kernel, "triton", is chosen by name until a GPU run has measured it: it has only run under
    # Triton's interpreter so far; bench/gpu_check.sh measures it beside these)
    if torch.cuda.is_current_stream_capturing():
        return "dense"  # a CUDA graph cannot hold grouped's host read of the per-expert counts
    return "grouped"


def moe_forward(layer: MoELayer, h: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """h [num_tokens, hidden] (post-attention normed) -> the MoE MLP's output [num_tokens, hidden]: the routed
    experts' sum, plus the gated shared expert where the layer has one."""
    y = routed_forward(layer, h, impl)
    s = shared_forward(layer, h)
    return y if s is None else y + s  # transformers' order: expert_output + shared_expert_output


def routed_forward(layer: MoELayer, h: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """The routed experts' weighted sum [num_tokens, hidden] (an expert-parallel rank's: its experts' part)."""
    weights, ids = route(layer, h)
    return IMPLS[impl or moe_choice(h.device)](layer, h, weights, ids)


def shared_forward(layer: MoELayer, h: torch.Tensor) -> torch.Tensor | None:
    """sigmoid(shared_expert_gate(h)) * shared_expert(h) [num_tokens, hidden] (a TP rank's: its slice of the
    shared expert's width, a partial sum); None where the layer has no shared expert."""
    sh = layer.shared
    if sh is None:
        return None
    y = sh.down(swiglu(sh.gate_up(h)))  # [num_tokens, hidden]
    return torch.sigmoid(F.linear(h, sh.gate)) * y  # gate [num_tokens, 1], in the model dtype as transformers
