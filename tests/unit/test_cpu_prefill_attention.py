"""engine.kernels.cpu.prefill_attention: the AVX512-BF16 multi-query paged attention against float64 attention over
the same pages (prefill from empty, chunks after a cached prefix, several rows, grouped-query ratios, page
sizes, scattered and padded page tables), inputs it refuses before reading, the backend's choice of it,
and the build's failure path (the torch path stays). Engine runs with and without it: test_cpu_attention.py."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu import native as cpu_native, prefill_attention as cpu_prefill_attention
from engine.attention_context import ObserveSpec, SeqLayout, build_context
from engine.kernels.cpu.prefill_attention import prefill_attention_bf16
from engine.kv_cache.backend import make_backend, torch_dtype
from engine.kv_cache.spec import KVPageSpec

needs_kernel = pytest.mark.skipif(not cpu_prefill_attention.available(),
                                  reason="no C compiler or no AVX512-BF16 on this CPU: the torch path runs")


def _pages(lens, page_size, seed):
    """Scattered pages per row, rows padded with page 0 (as the context builder pads): [rows, width]."""
    need = [-(-n // page_size) for n in lens]
    free = list(range(1, 2 + sum(need)))
    random.Random(seed).shuffle(free)
    width = max(need)
    return np.array([[free.pop() for _ in range(k)] + [0] * (width - k) for k in need], dtype=np.int64), 2 + sum(need)


def _reference(q, k_pool, v_pool, page_index, lens, q_len, scale):
    """float64 attention: row b's query i over slots [0, lens[b] - q_len + i]: [rows * q_len, heads, dim]."""
    heads, (kv_heads, d) = q.shape[1], k_pool.shape[2:]
    out = []
    for b, n in enumerate(lens):
        k = k_pool[torch.from_numpy(page_index[b])].reshape(-1, kv_heads, d)[:n].double()
        v = v_pool[torch.from_numpy(page_index[b])].reshape(-1, kv_heads, d)[:n].double()
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        s = torch.einsum("ihd,jhd->hij", q[b * q_len:(b + 1) * q_len].double(), k) * scale
        seen = torch.arange(n)[None, :] <= n - q_len + torch.arange(q_len)[:, None]  # [q_len, n]
        out.append(torch.einsum("hij,jhd->ihd", s.masked_fill(~seen, float("-inf")).softmax(-1), v))
    return torch.cat(out)


def _case(rows, q_len, cached, heads, kv_heads, dim, page_size, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [cached + q_len + 5 * b for b in range(rows)]  # rows of different lengths
    page_index, num_pages = _pages(lens, page_size, seed)
    k_pool = torch.randn(num_pages, page_size, kv_heads, dim, generator=g).to(torch.bfloat16)
    v_pool = torch.randn(num_pages, page_size, kv_heads, dim, generator=g).to(torch.bfloat16)
    # q as the model hands it over: a view into packed q/k heads (token stride > heads * dim)
    q = (2 * torch.randn(rows * q_len, heads + kv_heads, dim, generator=g)).to(torch.bfloat16)[:, :heads]
    return q, k_pool, v_pool, page_index, np.array(lens, dtype=np.int64)


@needs_kernel
@pytest.mark.parametrize("rows,q_len,cached", [(1, 37, 0), (1, 300, 0), (2, 16, 45), (3, 5, 100), (1, 2, 0)])
@pytest.mark.parametrize("heads,kv_heads,dim,page_size", [(9, 3, 64, 16), (4, 4, 128, 4), (8, 2, 64, 1),
                                                          (8, 4, 256, 16)])  # Gemma 3's head_dim
def test_kernel_matches_float64_attention(rows, q_len, cached, heads, kv_heads, dim, page_size):
    q, k_pool, v_pool, page_index, lens = _case(rows, q_len, cached, heads, kv_heads, dim, page_size)
    scale = dim ** -0.5
    got = prefill_attention_bf16(q, k_pool, v_pool, page_index, lens, q_len, scale)
    want = _reference(q, k_pool, v_pool, page_index, lens, q_len, scale)
    assert got.shape == (rows * q_len, heads, dim) and got.dtype == torch.bfloat16
    # probabilities rounded to bf16 (as torch's flash kernel), float32 sums, output rounded once
    assert ((got.double() - want).abs() <= want.abs() * 2 ** -6 + 6e-3).all()
    # no closer to SDPA in bf16 than SDPA itself is to float64, give or take rounding
    sdpa = _reference(q.float(), k_pool.float(), v_pool.float(), page_index, lens, q_len, scale)
    assert (got.double() - sdpa).abs().mean() <= 2 * (sdpa.to(torch.bfloat16).double() - sdpa).abs().mean() + 1e-3
    if cached == 0:  # the first query of a fresh prompt sees one slot: exactly that slot's V
        first = v_pool[page_index[0, 0], 0].repeat_interleave(heads // kv_heads, 0)
        assert torch.equal(got[0], first)


@needs_kernel
def test_kernel_agrees_with_sdpa_on_a_causal_prompt():
    q, k_pool, v_pool, page_index, lens = _case(1, 200, 0, 9, 3, 64, 16, seed=3)
    got = prefill_attention_bf16(q, k_pool, v_pool, page_index, lens, 200, 0.125)
    k = k_pool[torch.from_numpy(page_index[0])].reshape(1, -1, 3, 64)[:, :200].transpose(1, 2)
    v = v_pool[torch.from_numpy(page_index[0])].reshape(1, -1, 3, 64)[:, :200].transpose(1, 2)
    sdpa = F.scaled_dot_product_attention(q.unsqueeze(0).transpose(1, 2), k, v, is_causal=True, scale=0.125,
                                          enable_gqa=True).transpose(1, 2)[0]
    assert (got.float() - sdpa.float()).abs().max() <= 0.03


@needs_kernel
def test_bad_inputs_are_refused_before_the_kernel_reads():
    q, k_pool, v_pool, page_index, lens = _case(2, 4, 10, 4, 2, 64, 4)
    call = lambda **kw: prefill_attention_bf16(**{**dict(q=q, k_pool=k_pool, v_pool=v_pool, page_index=page_index,  # noqa: E731
                                                        ctx_lens=lens, q_len=4, scale=0.1), **kw})
    assert call().shape == (8, 4, 64)
    with pytest.raises(ValueError, match="outside"):
        call(ctx_lens=np.array([14, page_index.shape[1] * 4 + 1]))  # more slots than the row's pages
    with pytest.raises(ValueError, match="outside"):
        call(ctx_lens=np.array([3, 14]))  # fewer slots than queries
    with pytest.raises(ValueError, match="page ids"):
        call(page_index=np.where(page_index == page_index.max(), 10_000, page_index))
    with pytest.raises(ValueError, match="query tokens"):
        call(q_len=3)
    with pytest.raises(ValueError, match="bf16"):
        call(q=q.float())
    with pytest.raises(ValueError, match="unsupported"):
        call(q=q[..., :32], k_pool=k_pool[..., :32].contiguous(), v_pool=v_pool[..., :32].contiguous())


def _prefill_context(chunks, ps=4, observe=None, window=None):
    """Rows r{i} bringing q_len new tokens after `cached` slots each: (q_len, cached) per row."""
    free, layouts = list(range(1, 200)), []
    random.Random(2).shuffle(free)
    for i, (q_len, cached) in enumerate(chunks):
        layouts.append(SeqLayout(f"r{i}", q_len, cached, [free.pop() for _ in range(-(-(q_len + cached) // ps))]))
    return build_context(layouts, ps, 0.125, observe=observe, sliding_window=window)


@pytest.mark.parametrize("dtype,fmt", [("bfloat16", "raw"), ("float32", "raw"), ("bfloat16", "int8")])
def test_backend_takes_the_kernel_for_raw_bf16_multi_query_groups_only(dtype, fmt, monkeypatch):
    calls = []
    real = cpu_prefill_attention.prefill_attention_bf16
    monkeypatch.setattr(cpu_prefill_attention, "prefill_attention_bf16", lambda *a: calls.append(1) or real(*a))
    spec = KVPageSpec(1, 2, 64, 4, dtype, fmt)
    on, off = make_backend(spec, 200), make_backend(spec, 200)
    off.prefill_kernel = False
    g = torch.Generator().manual_seed(0)
    dt = torch_dtype(dtype)
    k, v = (torch.randn(200 * 4, 2, 64, generator=g).to(dt) for _ in range(2))
    for b in (on, off):  # the same K/V in both, through the backend's own write (int8 quantizes)
        b.write(0, torch.arange(200 * 4), k, v)
    chunks = [(7, 0), (7, 20)]  # one group: two rows of 7 queries, the second after 20 cached slots
    for observe, window in [(None, None), ({"r1": ObserveSpec(slot_mass=True)}, None), (None, 8)]:
        ctx = _prefill_context(chunks, observe=observe, window=window)
        q = torch.randn(14, 4, 64, generator=g).to(dt)
        calls.clear()
        a, b = on.attend(0, q, ctx), off.attend(0, q, ctx)
        took = bool(calls)
        assert took == (dtype == "bfloat16" and fmt == "raw" and observe is None and window is None
                        and cpu_prefill_attention.available())
        assert (a.float() - b.float()).abs().max() <= (0.03 if took else 0)


def test_native_off_or_unbuildable_leaves_the_torch_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_NATIVE", "0")
    assert not cpu_prefill_attention.available()
    monkeypatch.delenv("PDSERVE_NATIVE")
    with monkeypatch.context() as m:  # a CPU with AMX keeps torch's flash attention (see available())
        m.setattr(cpu_native, "cpu_flags", lambda: frozenset({"avx512_bf16", "amx_bf16"}))
        assert not cpu_prefill_attention.available()
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    cpu_native._load.cache_clear()
    try:
        assert cpu_native.library("attention_bf16") is None
        assert not list((tmp_path / "native").glob("*.so"))  # nothing half-written left behind
    finally:
        cpu_native._load.cache_clear()


@needs_kernel
def test_threads_running_the_kernel_at_once_do_not_share_scratch():
    """ctypes lets go of the GIL during a call: two engines in two threads run kernels concurrently, each
    with its own workspace (one shared buffer would mix their repacked K/V)."""
    from concurrent.futures import ThreadPoolExecutor

    cases = [_case(1, 300, 40 * i, 9, 3, 64, 16, seed=i) for i in range(4)]
    want = [prefill_attention_bf16(q, k, v, p, n, 300, 0.125) for q, k, v, p, n in cases]

    def run(i):
        q, k, v, p, n = cases[i % 4]
        return i % 4, prefill_attention_bf16(q, k, v, p, n, 300, 0.125)

    with ThreadPoolExecutor(4) as pool:
        for i, got in pool.map(run, range(32)):
            assert torch.equal(got, want[i])
