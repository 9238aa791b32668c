"""Gemma 3 text forward (`Gemma3ForCausalLM`, model_type gemma3_text) over the paged KV cache.

Built by `engine.forward.build_forward` where the config carries a `GemmaConfig` (engine/gemma_config.py);
called as `LlamaForward` is (same `forward` / `logits` contract, tensor parallelism through `all_reduce`,
pipeline stages through `layers`). What differs from a Llama layer, each as transformers computes it:
- embeddings scaled by sqrt(hidden_size), the scale rounded to the model dtype first;
- Gemma RMSNorm: x normalised in float32, times (1 + w) in float32, then rounded to the model dtype
  (`gemma_norm`); four per layer: input, post-attention (on the attention output, before the residual
  add), pre-feedforward and post-feedforward (likewise), plus per-head q and k norms before RoPE;
- attention scaled by query_pre_attn_scalar ** -0.5; GeGLU MLP with gelu-tanh;
- local layers (`GemmaConfig.local_layers`) attend to the last `sliding_window` positions with their own
  RoPE table (rope_local_base_freq), global layers to every position with the global RoPE (its scaling);
  the runner builds the step's windowed view of the attention context (`AttentionContext.local`) and the
  local layers read it. Every layer keeps its KV in the same pages (docs/engine.md: why);
- final logits soft-capped (cap * tanh(logits / cap)) in the model dtype when the config sets a cap.
Plain torch throughout (no fused Triton forward, no CUDA graphs: `graph_decode` refuses local windows).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention_context import AttentionContext
from engine.config import ModelConfig
from engine.linear import Linear
from engine.model import AllReduce, LayerHook, LlamaForward
from engine.rope import RotaryTable, apply_rotary
from engine.sdpa_backends import sdpa_context


@dataclass
class GemmaLayer:
    input_norm: torch.Tensor  # every norm held as (1 + w) in float32
    qkv: Linear
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: Linear
    post_norm: torch.Tensor  # post_attention_layernorm: on the attention output
    pre_ff_norm: torch.Tensor
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear
    post_ff_norm: torch.Tensor
    local: bool  # a sliding-window layer


def gemma_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: x [..., dim] normalised in float32, times `scale` (= 1 + w, float32), in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * scale).type_as(x)


class GemmaForward(LlamaForward):
    """Shares `LlamaForward`'s residual (tensor-parallel all-reduce), weight bytes and stage bookkeeping;
    its own layers, norms, RoPE tables and forward."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, device="cpu",
                 all_reduce: AllReduce | None = None, layers: range | None = None):
        g = cfg.gemma
        self.cfg, self.all_reduce, self.dtype, self.device = cfg, all_reduce, dtype, torch.device(device)
        self.layer_ids = range(cfg.num_layers) if layers is None else layers
        self.is_first, self.is_last = self.layer_ids.start == 0, self.layer_ids.stop == cfg.num_layers
        self.fused, self._norm_bits = False, None
        self.experts = self.expert_reduce = None  # (no experts: LlamaForward's expert-parallel fields)

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype).contiguous()

        def norm(name: str) -> torch.Tensor:
            return 1.0 + weights[name].to(device=device, dtype=dtype).float()  # as transformers: w cast, then 1 + w

        tied = cfg.tie_word_embeddings or "lm_head.weight" not in weights
        self.embed = None
        if self.is_first or (self.is_last and tied):
            self.embed = w("model.embed_tokens.weight")
        # transformers: torch.tensor(sqrt(hidden)) (float32) rounded to the weights' dtype
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5).to(dtype=dtype, device=device)
        self.lm_head = self.final_norm = None
        if self.is_last:
            self.lm_head = Linear(self.embed if tied else w("lm_head.weight"))
            self.final_norm = norm("model.norm.weight")
        local = set(g.local_layers)
        self.layers = []
        for i in self.layer_ids:
            p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
            self.layers.append(GemmaLayer(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=Linear(torch.cat([w(a + f"{n}_proj.weight") for n in "qkv"])),
                q_norm=norm(a + "q_norm.weight"), k_norm=norm(a + "k_norm.weight"),
                o=Linear(w(a + "o_proj.weight")),
                post_norm=norm(p + "post_attention_layernorm.weight"),
                pre_ff_norm=norm(p + "pre_feedforward_layernorm.weight"),
                gate_up=Linear(torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])),
                down=Linear(w(p + "mlp.down_proj.weight")),
                post_ff_norm=norm(p + "post_feedforward_layernorm.weight"),
                local=i in local))
        self.rotary = RotaryTable(cfg.head_dim, cfg.rope, cfg.max_position, dtype, device)  # global layers
        self.local_rotary = self.rotary
        if any(lw.local for lw in self.layers) and g.local_rope != cfg.rope:
            self.local_rotary = RotaryTable(cfg.head_dim, g.local_rope, cfg.max_position, dtype, device)
        self.scale = g.query_pre_attn_scalar ** -0.5

    def weight_bytes(self) -> int:
        """Bytes a decode step reads (as `LlamaForward.weight_bytes`: layers, final norm, LM head)."""
        total = 0
        if self.is_last:
            total += self.lm_head.nbytes() + self.final_norm.numel() * self.final_norm.element_size()
        for lw in self.layers:
            for part in vars(lw).values():
                if isinstance(part, Linear):
                    total += part.nbytes()
                elif isinstance(part, torch.Tensor):
                    total += part.numel() * part.element_size()
        return total

    def _norm(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return gemma_norm(x, scale, self.cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext,
                backend, layer_hook: LayerHook | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden] (see LlamaForward)."""
        cfg, t = self.cfg, input_ids.shape[0]
        heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        nq, nkv = heads * hd, kv_heads * hd
        ropes = {False: self.rotary.lookup(positions)}
        ropes[True] = ropes[False] if self.local_rotary is self.rotary else self.local_rotary.lookup(positions)
        local_ctx = ctx.local if ctx.local is not None else ctx  # None: no row is past the window this step
        x = F.embedding(input_ids, self.embed) * self.embed_scale if hidden is None else hidden
        with sdpa_context(self.device):
            for i, lw in zip(self.layer_ids, self.layers):
                h = self._norm(x, lw.input_norm)
                qkv = lw.qkv(h)  # [num_tokens, (q_heads + 2 kv_heads) * head_dim]
                q = self._norm(qkv[:, :nq].reshape(t, heads, hd), lw.q_norm)
                k = self._norm(qkv[:, nq:nq + nkv].reshape(t, kv_heads, hd), lw.k_norm)
                qk = apply_rotary(torch.cat([q, k], dim=1), *ropes[lw.local])
                backend.write(i, ctx.write_slots, qk[:, heads:], qkv[:, nq + nkv:].view(t, kv_heads, hd))
                o = backend.attend(i, qk[:, :heads], local_ctx if lw.local else ctx)  # [num_tokens, q_heads, hd]
                x = x + self._norm(self._reduced(lw.o(o.reshape(t, nq))), lw.post_norm)
                gate, up = lw.gate_up(self._norm(x, lw.pre_ff_norm)).chunk(2, dim=-1)
                m = self._reduced(lw.down(F.gelu(gate, approximate="tanh") * up))
                x = x + self._norm(m, lw.post_ff_norm)
                if layer_hook is not None:
                    layer_hook(i)
        return self._norm(x, self.final_norm) if self.is_last else x

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel projection's output: summed over tensor-parallel ranks before Gemma's norm."""
        return partial if self.all_reduce is None else self.all_reduce(partial)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] -> float32 logits [n, vocab], soft-capped in the model dtype if configured."""
        logits = self.lm_head(hidden)
        cap = self.cfg.gemma.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
