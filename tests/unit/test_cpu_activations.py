"""engine.kernels.cpu.activations: SwiGLU's activation by the C kernel against torch's bf16 silu-then-mul (what
Hugging Face's LlamaMLP computes), including widths that are not a multiple of 16, special values and
the torch path where the kernel does not run."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu import activations as cpu_activations
from engine.kernels.cpu.activations import swiglu

needs_kernel = pytest.mark.skipif(cpu_activations._lib() is None,
                                  reason="no C compiler or no AVX512-BF16 on this CPU: the torch path runs")


def _torch(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@needs_kernel
@pytest.mark.parametrize("rows,inter", [(1, 1536), (16, 1536), (7, 40), (3, 5), (0, 64)])
def test_kernel_rounds_where_torch_rounds(rows, inter):
    g = torch.Generator().manual_seed(rows * 1000 + inter)
    x = (torch.randn(rows, 2 * inter, generator=g) * 4).to(torch.bfloat16)
    got, want = swiglu(x), _torch(x)
    assert got.shape == want.shape == (rows, inter) and got.dtype == torch.bfloat16
    differ = (got.view(torch.int16) != want.view(torch.int16)).sum().item()
    # the same two roundings; an exp that differs from torch's in float32's last bit moves a bf16
    # rounding only when a value sits on a rounding boundary (then by one bf16 step)
    assert differ <= max(1, got.numel() // 10_000), differ
    assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=0)


@needs_kernel
def test_special_values_come_out_as_torch_s():
    gate = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 1e30, -1e30, float("inf"), float("-inf"),
                         float("nan"), 3.0, -3.0, 0.5, -0.5, 20.0, -20.0])
    up = torch.tensor([1.0, 2.0, 3.0, -1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, float("inf"), 0.0, float("nan"),
                       -2.0, 1e-3, 1e3])
    x = torch.cat([gate, up]).view(1, -1).to(torch.bfloat16)
    got, want = swiglu(x), _torch(x)
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(got[ok], want[ok])


def test_torch_path_where_the_kernel_does_not_run(monkeypatch):
    x = torch.randn(4, 64).to(torch.bfloat16)
    monkeypatch.setenv("PDSERVE_NATIVE", "0")
    assert torch.equal(swiglu(x), _torch(x))
    y = torch.randn(4, 64)  # float32 never takes the kernel
    monkeypatch.delenv("PDSERVE_NATIVE")
    assert torch.equal(swiglu(y), _torch(y))
    z = torch.randn(64, 4).to(torch.bfloat16).t()  # not contiguous
    assert torch.equal(swiglu(z), _torch(z))
