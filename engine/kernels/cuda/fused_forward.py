"""The Llama forward on the Triton path: the same layers as `LlamaForward.forward`, with RoPE and the K/V
write in one kernel, each residual add fused into the next RMSNorm, and SwiGLU's activation in one kernel
(engine/kernels/cuda/fused_ops.py). Chosen by `LlamaForward.forward` when `fused_forward_ok` says so; the
torch path stays for CPU, float32 exactness runs (PDSERVE_ATTENTION=torch) and everything this skips.

The residual stream is carried as (x, delta): a layer's attention and MLP outputs are not added to x at
once; the next norm adds them (one kernel instead of two), and the final norm adds the last one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.cuda.fused_ops import add_rms_norm, rope_write, silu_mul


def fused_forward_ok(model, backend, layer_hook, hidden) -> bool:
    """A whole model in this process over raw pages on the Triton path, with no per-write side work (layer
    hooks are fine: they run after each layer)."""
    from engine.kv_cache.backend import RawKVBackend

    return (hidden is None and model.is_first and model.is_last
            and model.all_reduce is None and type(backend) is RawKVBackend and backend.triton_paged
            and backend.summaries is None and model.cfg.head_dim % 2 == 0
            and backend.k[model.layer_ids.start].is_contiguous())


def fused_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, ctx, backend, layer_hook=None
                  ) -> torch.Tensor:
    """input_ids, positions: [num_tokens] -> final normed hidden states [num_tokens, hidden]. `layer_hook(i)`
    runs after layer i (its K/V are in the pages then: the prefill worker ships them layer by layer)."""
    cfg = model.cfg
    t = input_ids.shape[0]
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    cos, sin = model.rotary.cos[positions], model.rotary.sin_signed[positions]  # [num_tokens, head_dim]
    x = F.embedding(input_ids, model.embed)  # [num_tokens, hidden]
    delta = None
    eps = cfg.rms_norm_eps
    for i, lw in zip(model.layer_ids, model.layers):
        h, x = add_rms_norm(x, delta, lw.input_norm, eps)
        qkv = lw.qkv(h)  # [num_tokens, (q_heads + 2 kv_heads) * head_dim]
        q = rope_write(qkv, cos, sin, backend.k[i], backend.v[i], ctx.write_slots, hq, hkv)
        o = backend.attend(i, q, ctx)  # [num_tokens, q_heads, head_dim]
        delta = lw.o(o.reshape(t, hq * cfg.head_dim))
        h, x = add_rms_norm(x, delta, lw.post_norm, eps)
        delta = lw.down(silu_mul(lw.gate_up(h)))
        if layer_hook is not None:
            layer_hook(i)
    return add_rms_norm(x, delta, model.final_norm, eps)[0]
