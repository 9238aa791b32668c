"""engine.kernels.cpu.numba_kernels: the numba bf16 GEMV against float32 math rounded once to bf16, and `Linear`'s use of
it (one or two rows) against its oneDNN path (more rows)."""
import numpy as np
import pytest
import torch

from engine.kernels.cpu import numba_kernels as cpu_kernels
from engine.kernels.cpu.numba_kernels import bits as _bits, from_bits as _from_bits
from engine.linear import Linear


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 units in the last place (same-sign finite values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("bias,residual", [(False, False), (True, False), (False, True), (True, True)])
def test_gemv_is_float32_math_rounded_once(rows, bias, residual):
    g = torch.Generator().manual_seed(rows * 7 + 2 * bias + residual)
    w = torch.randn(97, 200, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 200, generator=g).to(torch.bfloat16)
    b = torch.randn(97, generator=g).to(torch.bfloat16) if bias else None
    r = torch.randn(rows, 97, generator=g).to(torch.bfloat16) if residual else None
    got = _from_bits(cpu_kernels.gemv_bf16(_bits(w), _bits(x), None if b is None else _bits(b),
                                           None if r is None else _bits(r)))
    ref = x.double() @ w.double().T
    if b is not None:
        ref = ref + b.double()
    if r is not None:
        ref = ref + r.double()
    ref = ref.float().to(torch.bfloat16)
    assert got.shape == (rows, 97) and got.dtype == torch.bfloat16
    same_sign = torch.sign(got.float()) == torch.sign(ref.float())
    # float32 sums in another order than float64's: at most one bf16 ulp apart, and mostly equal
    assert (_ulps(got, ref)[same_sign] <= 1).all() and (got.float() - ref.float()).abs().max() < 0.05
    assert (got == ref).float().mean() > 0.95


def test_nan_and_inf_propagate():
    w = torch.ones(4, 8, dtype=torch.bfloat16)
    x = torch.ones(1, 8, dtype=torch.bfloat16)
    x[0, 3] = float("nan")
    assert _from_bits(cpu_kernels.gemv_bf16(_bits(w), _bits(x))).isnan().all()
    x[0, 3] = float("inf")
    assert torch.isposinf(_from_bits(cpu_kernels.gemv_bf16(_bits(w), _bits(x)))).all()
    big = torch.full((1, 8), 3e38, dtype=torch.bfloat16)  # the sum overflows float32: +inf, not NaN
    assert torch.isposinf(_from_bits(cpu_kernels.gemv_bf16(_bits(w), _bits(big)))).all()


@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_small_rows_agree_with_onednn_rows(with_bias):
    """The same rows through the GEMV (as rows 1-2) and through oneDNN (inside a 3-row batch)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    b = torch.randn(64, generator=g).to(torch.bfloat16) if with_bias else None
    lin = Linear(w, b)
    assert lin.gemv is not None
    x = torch.randn(3, 96, generator=g).to(torch.bfloat16)
    res = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    batched, batched_add = lin(x), lin.add_to(x, res)
    assert 3 > cpu_kernels.MAX_ROWS  # the batched call above took the other path
    for i in range(3):
        one = lin(x[i:i + 1])
        assert (one.float() - batched[i:i + 1].float()).abs().max() <= 0.0625
        if b is None:  # add_to fuses the residual on both paths only without a bias
            one_add = lin.add_to(x[i:i + 1], res[i:i + 1])
            assert (one_add.float() - batched_add[i:i + 1].float()).abs().max() <= 0.0625


def test_float32_linear_never_takes_the_gemv():
    lin = Linear(torch.randn(8, 16))
    assert lin.gemv is None
    x = torch.randn(1, 16)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight))


def test_bits_round_trip_is_a_view():
    t = torch.randn(4, 5).to(torch.bfloat16)
    a = _bits(t)
    assert a.dtype == np.uint16 and np.shares_memory(a, t.view(torch.int16).numpy())
    assert torch.equal(_from_bits(a.copy()), t)


def test_kernels_compile_without_a_cache_location(monkeypatch):
    """No writable cache location: numba refuses `cache=True` when decorating; `_jit` compiles uncached."""
    import numba.core.caching as caching

    def refuse(*args, **kwargs):
        raise RuntimeError("cannot cache function: no locator available")

    monkeypatch.setattr(caching.CacheImpl, "__init__", refuse)

    @cpu_kernels._jit(fastmath=True)
    def twice(a):
        return a * 2

    assert twice(21) == 42 and twice._cache.__class__.__name__ == "NullCache"


@pytest.mark.parametrize("rows", [1, 16, 300])
def test_rms_norm_rounds_where_hugging_face_does(rows):
    """Bit-equal to LlamaRMSNorm in bf16: float32 normalization, rounded to bf16, times the weight."""
    g = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn(rows, 576, generator=g)).to(torch.bfloat16)
    w = (1 + 0.2 * torch.randn(576, generator=g)).to(torch.bfloat16)
    h = x.float()
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16)
    got = _from_bits(cpu_kernels.rms_norm_bf16(_bits(x), _bits(w), 1e-5))
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
