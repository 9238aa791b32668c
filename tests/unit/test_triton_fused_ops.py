"""The fused Triton kernels of the CUDA forward (engine/kernels/cuda/fused_ops.py) against their torch
references (engine/kernels/reference.py), on CPU under Triton's interpreter: RoPE + K/V write, residual add +
RMSNorm, SwiGLU's activation; float32 exactly (to float rounding), bfloat16 within a rounding step."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels import reference as ref  # noqa: E402
from engine.kernels.cuda import fused_ops  # noqa: E402
from engine.rope import RotaryTable  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 16), (8, 2, 32)])
def test_rope_write(dtype, heads):
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(hq)
    t, pages, ps = 6, 8, 4
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    table = RotaryTable(d, {"rope_theta": 10000.0}, 64, dtype)
    pos = torch.tensor([0, 1, 5, 9, 33, 63])
    slots = torch.tensor([0, 3, 9, 17, 30, 31])
    pools = [torch.zeros(pages, ps, hkv, d, dtype=dtype) for _ in range(4)]
    q = fused_ops.rope_write(qkv, table.cos[pos], table.sin_signed[pos], pools[0], pools[1], slots, hq, hkv)
    want = ref.rope_write(qkv, table.cos[pos], table.sin_signed[pos], pools[2], pools[3], slots, hq, hkv)
    tol = TOL[dtype]
    torch.testing.assert_close(q.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(pools[0].float(), pools[2].float(), atol=tol, rtol=tol)
    assert torch.equal(pools[1], pools[3])  # V is stored unchanged
    untouched = torch.ones(pages * ps, dtype=torch.bool)
    untouched[slots] = False
    assert not pools[0].view(pages * ps, -1)[untouched].any()  # nothing written beside the slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(dtype, with_delta):
    g = torch.Generator().manual_seed(1)
    x, delta = (torch.randn(5, 576, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(576, generator=g).to(dtype)
    out, res = fused_ops.add_rms_norm(x, delta if with_delta else None, w, 1e-5)
    want_out, want_res = ref.add_rms_norm(x, delta if with_delta else None, w, 1e-5)
    if dtype == torch.float32:
        assert torch.equal(res, want_res)  # the residual add rounds exactly as torch's
    else:  # Triton's interpreter truncates float32 -> bfloat16 (the GPU rounds to nearest even): 1 ulp
        torch.testing.assert_close(res, want_res, atol=0, rtol=2 ** -7)
    torch.testing.assert_close(out.float(), want_out.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype):
    gate_up = torch.randn(3, 2 * 1536, generator=torch.Generator().manual_seed(2)).to(dtype)
    torch.testing.assert_close(fused_ops.silu_mul(gate_up).float(), ref.silu_mul(gate_up).float(),
                               atol=TOL[dtype], rtol=TOL[dtype])
