"""Llama-family forward (Llama, Mistral, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, Mixtral) over a paged KV cache.

Called by `engine.runner.ModelRunner` once per step with packed token ids, explicit positions and an
`AttentionContext`; K/V go to, and attention comes from, the KV backend (keys stored after RoPE). The
model holds plain tensors (no nn.Module): q/k/v and gate/up projections are fused into one matmul each,
which is where most of the CPU time goes. GQA, RMSNorm, SwiGLU, tied embeddings. bf16 on CPU: RMSNorm by
a numba kernel (`cpu_kernels`), SwiGLU's activation by a C kernel (`cpu_activations`), each rounding
where Hugging Face rounds. Qwen3 RMS-normalises each query and key head before RoPE (`_qk`); Qwen2-MoE,
Qwen3-MoE and Mixtral layers run a mixture-of-experts MLP (`engine.moe`, Qwen2-MoE's with a gated shared
expert: `_moe`) where the others run gate_up / down. Those
models take the torch path on CUDA too (the fused Triton forward covers the plain layer only).

Tensor parallelism (`engine.parallel`): a rank builds this with its shard of the weights, a config with
its local head counts and an `all_reduce` callable; o and down are then row-parallel (partial sums
all-reduced before the residual add); MoE layers hold every expert's slice of its width
(`engine.parallel.shard`) and reduce their partial output with the same `all_reduce`. Pipeline parallelism: a
stage builds it with `layers` (its slice of the global layer ids); only the first stage embeds, only the last
norms and holds the LM head. Expert parallelism: a rank builds it with `experts` (the global expert ids it
holds) and an `expert_reduce` that sums the MoE layers' partial outputs over the ranks (in place of
`all_reduce` for them); everything else is whole, the shared expert too (added after that sum: `_moe`). With
data-parallel attention an `expert_dispatch` (`engine.parallel.dispatch`) takes the rank's own tokens to their
experts' ranks and back instead. Without any, the path is the single-process one, unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from engine.attention_context import AttentionContext
from engine.config import ModelConfig
from engine import kernels
from engine.kernels.cpu import activations as cpu_activations
from engine.kernels.cpu.activations import swiglu
from engine.kernels.cpu.numba_kernels import bits, from_bits, rms_norm_bf16
from engine.linear import Linear
from engine.moe import MoELayer, load_moe_layer, moe_forward, routed_forward, shared_forward
from engine.rope import RotaryTable, apply_rotary
from engine.sdpa_backends import sdpa_context

LayerHook = Callable[[int], None]  # called with the global layer index after that layer ran
AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over the tensor-parallel group


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # [(q_heads + 2 * kv_heads) * head_dim, hidden], bias for Qwen2
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear | None  # [2 * intermediate, hidden]; None in an MoE layer
    down: Linear | None
    q_norm: torch.Tensor | None = None  # [head_dim]: Qwen3's per-head RMSNorm weights
    k_norm: torch.Tensor | None = None
    moe: MoELayer | None = None  # Qwen2-MoE / Qwen3-MoE / Mixtral sparse layers: experts, router, shared expert


class LlamaForward:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device="cpu",
                 all_reduce: AllReduce | None = None, layers: range | None = None, experts: range | None = None,
                 expert_reduce: AllReduce | None = None, expert_dispatch=None):
        self.cfg = cfg
        self.all_reduce = all_reduce  # set on tensor-parallel ranks: o and down hold partial sums
        self.experts, self.expert_reduce = experts, expert_reduce  # expert-parallel ranks: MoE outputs partial
        # expert parallelism with data-parallel attention: this rank's tokens sent to their experts and back
        self.expert_dispatch = expert_dispatch  # engine.parallel.dispatch.AllToAllDispatch
        self.layer_ids = range(cfg.num_layers) if layers is None else layers  # a pipeline stage: a slice
        self.is_first = self.layer_ids.start == 0  # embeds token ids (later stages receive hidden states)
        self.is_last = self.layer_ids.stop == cfg.num_layers  # final norm and LM head
        self.dtype = dtype
        self.device = torch.device(device)

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype).contiguous()

        tied = cfg.tie_word_embeddings or "lm_head.weight" not in weights
        self.embed = None  # [vocab, hidden]
        if self.is_first or (self.is_last and tied):
            self.embed = w("model.embed_tokens.weight")
        self.lm_head = self.final_norm = None
        if self.is_last:
            self.lm_head = Linear(self.embed if tied else w("lm_head.weight"))
            self.final_norm = w("model.norm.weight")
        self.layers: list[LayerWeights] = [self._layer(w, i, weights) for i in self.layer_ids]
        self.rotary = RotaryTable(cfg.head_dim, cfg.rope, cfg.max_position, dtype, device)
        self.scale = cfg.head_dim ** -0.5
        # the Triton forward (kernels/cuda/fused_forward): the plain Llama layer only
        self.fused = kernels.triton_paged_attention(self.device) and not cfg.qk_norm and cfg.moe is None
        # bf16 on CPU: RMSNorm by the numba kernel (norm weight id -> its bits); float32 keeps F.rms_norm
        self._norm_bits: dict[int, object] | None = None
        if dtype == torch.bfloat16 and self.device.type == "cpu":
            norms = [lw.input_norm for lw in self.layers] + [lw.post_norm for lw in self.layers]
            norms += [n for lw in self.layers for n in (lw.q_norm, lw.k_norm) if n is not None]
            self._norm_bits = {id(t): bits(t) for t in norms + ([self.final_norm] if self.is_last else [])}
            cpu_activations.available()  # build/load the SwiGLU kernel now, not in a request's first step

    def _layer(self, w: Callable[[str], torch.Tensor], i: int, weights) -> LayerWeights:
        p = f"model.layers.{i}."
        a = p + "self_attn."
        bias = None
        if self.cfg.qkv_bias:
            bias = torch.cat([w(a + f"{n}_proj.bias") for n in "qkv"])
        sparse = self.cfg.moe is not None and i in self.cfg.moe.sparse_layers
        return LayerWeights(
            input_norm=w(p + "input_layernorm.weight"),
            qkv=Linear(torch.cat([w(a + f"{n}_proj.weight") for n in "qkv"]), bias),
            o=Linear(w(a + "o_proj.weight")),
            post_norm=w(p + "post_attention_layernorm.weight"),
            gate_up=None if sparse else Linear(torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])),
            down=None if sparse else Linear(w(p + "mlp.down_proj.weight")),
            q_norm=w(a + "q_norm.weight") if self.cfg.qk_norm else None,
            k_norm=w(a + "k_norm.weight") if self.cfg.qk_norm else None,
            moe=load_moe_layer(self.cfg.moe, weights, w, p, self.experts) if sparse else None,
        )

    def weight_bytes(self) -> int:
        """Bytes a decode step must read: every layer, the final norm and the LM head (embedding rows are
        gathered, not read whole, unless the head is tied to them). MoE layers count every expert: a step
        reads only its active ones (`engine.moe`)."""
        total = 0
        if self.is_last:
            total += self.lm_head.nbytes() + self.final_norm.numel() * self.final_norm.element_size()
        for lw in self.layers:
            for part in (p for p in vars(lw).values() if p is not None):
                total += part.nbytes() if isinstance(part, (Linear, MoELayer)) else part.numel() * part.element_size()
        return total

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self._norm_bits is not None and x.dim() == 2 and x.dtype == torch.bfloat16:
            return from_bits(rms_norm_bf16(bits(x), self._norm_bits[id(weight)], self.cfg.rms_norm_eps))
        return F.rms_norm(x, (x.shape[-1],), weight, self.cfg.rms_norm_eps)  # [num_tokens, hidden]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                backend, layer_hook: LayerHook | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden]. A pipeline
        stage after the first gets the previous stage's `hidden` [num_tokens, hidden] instead of
        embedding the ids; a stage before the last returns its hidden states un-normed."""
        if self.fused:  # CUDA: fewer, fused kernels (imports triton, so only where it was chosen)
            from engine.kernels.cuda.fused_forward import fused_forward, fused_forward_ok

            if fused_forward_ok(self, backend, layer_hook, hidden):
                return fused_forward(self, input_ids, positions, ctx, backend, layer_hook)
        cfg = self.cfg
        t = input_ids.shape[0]
        nq, nkv, hd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
        cos, sin = self.rotary.lookup(positions)
        x = F.embedding(input_ids, self.embed) if hidden is None else hidden  # [num_tokens, hidden]
        with sdpa_context(self.device):  # CUDA: named SDPA backends (engine/sdpa_backends.py)
            for i, lw in zip(self.layer_ids, self.layers):
                h = self._norm(x, lw.input_norm)
                qkv = lw.qkv(h)  # [num_tokens, (q_heads + 2 kv_heads) * head_dim]
                qk = apply_rotary(self._qk(lw, qkv, t), cos, sin)  # RoPE on q and k heads at once
                q, k = qk[:, :cfg.num_heads], qk[:, cfg.num_heads:]
                backend.write(i, ctx.write_slots, k, qkv[:, nq + nkv:].view(t, cfg.num_kv_heads, hd))
                o = backend.attend(i, q, ctx)  # [num_tokens, q_heads, head_dim]
                x = self._residual(lw.o, o.reshape(t, nq), x)
                h = self._norm(x, lw.post_norm)
                if lw.moe is None:
                    x = self._residual(lw.down, swiglu(lw.gate_up(h)), x)  # silu(gate) * up
                else:
                    x = x + self._moe(lw.moe, h)
                if layer_hook is not None:
                    layer_hook(i)
        return self._norm(x, self.final_norm) if self.is_last else x

    def _moe(self, layer: MoELayer, h: torch.Tensor) -> torch.Tensor:
        """The MoE MLP's whole output [num_tokens, hidden] on every rank. A TP rank's experts and shared expert
        hold its slice of their width, an EP rank its block of experts: partial sums, reduced here. With
        data-parallel attention the rank's own tokens go to the ranks of their experts and come back summed."""
        if self.expert_dispatch is not None:  # the shared expert whole (or this TP rank's slice), added after
            y, s = self.expert_dispatch(layer, h), shared_forward(layer, h)
            y = y if s is None else y + s
            return y if self.all_reduce is None else self.all_reduce(y)  # EP x TP: the width slices summed
        if self.expert_reduce is None and self.all_reduce is None:
            return moe_forward(layer, h)
        y = routed_forward(layer, h)  # [num_tokens, hidden]: this rank's part
        s = shared_forward(layer, h)  # None without a shared expert
        if self.expert_reduce is None:  # TP only: both are partial over the same ranks, so one all-reduce
            return self.all_reduce(y if s is None else y + s)
        # EP: the shared expert is whole on every rank (as the dense layers; under EP x TP split in the group),
        # computed on each and added once after the experts' sum: adding it to one rank's partial first
        # would save its compute on the others but sum (p0 + s) + p1, not transformers' (p0 + p1) + s
        y = self.expert_reduce(y)
        if s is None:
            return y
        return y + (s if self.all_reduce is None else self.all_reduce(s))

    def _qk(self, lw: LayerWeights, qkv: torch.Tensor, t: int) -> torch.Tensor:
        """The query then key heads of `qkv`, [num_tokens, q_heads + kv_heads, head_dim], before RoPE; Qwen3
        RMS-normalises each head over its head_dim first (q_norm, k_norm)."""
        cfg, hd = self.cfg, self.cfg.head_dim
        nq, nkv = cfg.num_heads * hd, cfg.num_kv_heads * hd
        if lw.q_norm is None:
            return qkv[:, :nq + nkv].view(t, cfg.num_heads + cfg.num_kv_heads, hd)
        q = self._norm(qkv[:, :nq].reshape(t * cfg.num_heads, hd), lw.q_norm)  # [num_tokens * q_heads, head_dim]
        k = self._norm(qkv[:, nq:nq + nkv].reshape(t * cfg.num_kv_heads, hd), lw.k_norm)
        return torch.cat([q.view(t, cfg.num_heads, hd), k.view(t, cfg.num_kv_heads, hd)], dim=1)

    def _residual(self, linear: Linear, inp: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x + linear(inp); under tensor parallelism the rank's partial product is summed over ranks
        first (the fused add would add the residual once per rank)."""
        if self.all_reduce is None:
            return linear.add_to(inp, x)
        return x + self.all_reduce(linear(inp))  # [num_tokens, hidden]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] -> float32 logits [n, vocab]."""
        return self.lm_head(hidden).float()
