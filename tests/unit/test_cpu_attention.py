"""engine.kernels.cpu.decode_attention: the paged decode attention (numba, and the AVX512-BF16 C kernel for head_dim 64
where it runs) against float64 attention over the same pages (grouped-query ratios, page sizes,
scattered and padded page tables, one table per row or per (row, KV head)), numba's polynomial exp, and the backend's choice of it (bf16 decode
groups on CPU; float32, observed and windowed groups keep SDPA)."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine import SamplingParams
from engine.attention_context import ObserveSpec, SeqLayout, build_context
from engine.kernels.cpu import decode_attention as cpu_attention, prefill_attention as cpu_prefill_attention
from engine.kernels.cpu.decode_attention import _exp, attend_decode_bf16, attend_decode_reference
from engine.kernels.cpu.numba_kernels import _jit, bits, from_bits
from engine.kv_cache.backend import RawKVBackend, make_backend
from engine.kv_cache.spec import KVPageSpec
from engine.llm import LLM
from tests.conftest import assert_engine_empty
from tests.tiny_models import write_tiny_llama


def _reference(q, k_pool, v_pool, page_index, lens, scale):
    return attend_decode_reference(q, k_pool, v_pool, page_index, torch.tensor(lens), scale)


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,native", [
    (9, 3, 64, "on"), (10, 2, 64, "on"), (9, 3, 64, "off"), (10, 2, 64, "off"), (4, 4, 16, "off"), (8, 2, 32, "off"),
    (8, 4, 256, "off")])  # Gemma 3's head_dim: numba
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_kernel_matches_float64_attention(q_heads, kv_heads, head_dim, page_size, native, monkeypatch):
    """head_dim 64 takes the C kernel of csrc/decode_attention_bf16.c where the CPU has AVX512-BF16
    (native "on"; (10, 2) has 5 query heads per KV head: one block of 4 and one of 1), numba otherwise."""
    if native == "on" and cpu_attention.native_library() is None:
        pytest.skip("the C decode kernel does not run here (no compiler or no AVX512-BF16)")
    monkeypatch.setenv("PDSERVE_NATIVE", "1" if native == "on" else "0")
    g = torch.Generator().manual_seed(q_heads * 100 + page_size)
    lens = [1, 2, page_size, page_size + 1, 37, 130]
    num_pages = 2 + sum(-(-n // page_size) for n in lens)
    k_pool = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    v_pool = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    free = list(range(1, num_pages))
    random.Random(page_size).shuffle(free)  # scattered pages; rows padded with page 0 like the builder's
    width = max(-(-n // page_size) for n in lens)
    table = []
    for n in lens:
        used = [free.pop() for _ in range(-(-n // page_size))]
        table.append(used + [0] * (width - len(used)))
    page_index = torch.tensor(table, dtype=torch.long)
    q = (2 * torch.randn(len(lens), q_heads, head_dim, generator=g)).to(torch.bfloat16)
    scale = head_dim ** -0.5
    got = from_bits(attend_decode_bf16(bits(q), bits(k_pool), bits(v_pool), page_index.numpy(),
                                       np.array(lens, dtype=np.int64), scale))
    want = _reference(q, k_pool, v_pool, page_index, lens, scale)
    assert got.shape == q.shape and got.dtype == torch.bfloat16
    # float32 math rounded once to bf16: within one bf16 step of the float64 result
    assert ((got.double() - want).abs() <= want.abs() * 2 ** -7 + 1e-3).all()
    assert got[0].double().sub(v_pool[table[0][0], 0].double().repeat_interleave(q_heads // kv_heads, 0)).abs().max() == 0


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,native", [
    (9, 3, 64, "on"), (10, 2, 64, "on"), (9, 3, 64, "off"), (8, 2, 32, "off")])
def test_a_page_table_per_kv_head_reads_each_heads_own_pages(q_heads, kv_heads, head_dim, native, monkeypatch):
    """Sparse attention's per-KV-head choice: each KV head of a row has its own pages and slot count
    (tables [B, kv_heads, P]); C (native "on") and numba against the torch reference, and identical
    tables per head give the bits of the one-table-per-row call."""
    if native == "on" and cpu_attention.native_library() is None:
        pytest.skip("the C decode kernel does not run here (no compiler or no AVX512-BF16)")
    monkeypatch.setenv("PDSERVE_NATIVE", "1" if native == "on" else "0")
    ps, rows, width = 4, 3, 12
    g = torch.Generator().manual_seed(q_heads + head_dim)
    k_pool = torch.randn(60, ps, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    v_pool = torch.randn(60, ps, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    table = torch.stack([torch.randperm(59, generator=g)[:width] + 1 for _ in range(rows * kv_heads)])
    table = table.view(rows, kv_heads, width)  # distinct scattered pages per (row, KV head)
    lens = torch.randint(1, width * ps + 1, (rows, kv_heads), generator=g)
    lens[0, 0], lens[-1, -1] = 1, width * ps  # one slot; every slot of the table
    q = (2 * torch.randn(rows, q_heads, head_dim, generator=g)).to(torch.bfloat16)
    scale = head_dim ** -0.5
    got = from_bits(attend_decode_bf16(bits(q), bits(k_pool), bits(v_pool), table.numpy(), lens.numpy(), scale))
    want = attend_decode_reference(q, k_pool, v_pool, table, lens, scale)
    assert ((got.double() - want).abs() <= want.abs() * 2 ** -7 + 1e-3).all()
    per_row = attend_decode_reference(q, k_pool, v_pool, table[:, 0], lens[:, 0], scale)
    assert (want - per_row).abs().max() > 0.1  # the other heads' own pages did change their outputs
    shared = table[:, :1].expand(rows, kv_heads, width).contiguous()
    same = attend_decode_bf16(bits(q), bits(k_pool), bits(v_pool), shared.numpy(),
                              lens[:, :1].expand(rows, kv_heads).contiguous().numpy(), scale)
    one = attend_decode_bf16(bits(q), bits(k_pool), bits(v_pool), table[:, 0].contiguous().numpy(),
                             lens[:, 0].contiguous().numpy(), scale)
    assert np.array_equal(same, one)
    with pytest.raises(ValueError, match="lengths"):
        attend_decode_bf16(bits(q), bits(k_pool), bits(v_pool), table.numpy(), lens[:, 0].contiguous().numpy(), scale)


def test_exp_polynomial_is_close_to_exp_and_flushes_below_the_float32_range():
    @_jit(fastmath=True)
    def apply(x, out):
        for i in range(x.shape[0]):
            out[i] = _exp(x[i])

    x = np.concatenate([np.linspace(-87, 0, 200_001), [-87.5, -200.0, -1e30]]).astype(np.float32)
    out = np.empty_like(x)
    apply(x, out)
    ref = np.exp(x.astype(np.float64))
    inside = x >= -87
    assert (np.abs(out[inside] - ref[inside]) <= 5e-6 * ref[inside]).all()
    assert out[-1] == 0 and out[-2] == 0 and out[-3] == 0 and out[inside][-1] == 1.0


def _decode_context(lens, ps=4, observe=None, window=None):
    pages, free, layouts = {}, list(range(1, 200)), []
    random.Random(1).shuffle(free)
    for i, n in enumerate(lens):
        pages[i] = [free.pop() for _ in range(-(-(n + 1) // ps))]
        layouts.append(SeqLayout(f"r{i}", 1, n, pages[i]))
    return build_context(layouts, ps, 0.25, observe=observe, sliding_window=window), pages


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_backend_takes_the_kernel_for_bf16_decode_groups_only(dtype, monkeypatch):
    lens = [5, 17, 9]
    calls = []
    import engine.kv_cache.raw as kb  # the raw format module holds the kernel call
    real = kb.attend_decode_bf16
    monkeypatch.setattr(kb, "attend_decode_bf16", lambda *a: calls.append(1) or real(*a))
    spec = KVPageSpec(1, 2, 16, 4, dtype, "raw")
    on, off = make_backend(spec, 200), make_backend(spec, 200)
    off.paged_kernel = False
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(on.k[0].shape, generator=g) for _ in range(2))
    for b in (on, off):  # the same pages in both
        b.k[0].copy_(k)
        b.v[0].copy_(v)
    for observe, window in [(None, None), ({"r1": ObserveSpec(slot_mass=True)}, None), (None, 8)]:
        ctx, _ = _decode_context(lens, observe=observe, window=window)
        q = torch.randn(len(lens), 4, 16, generator=g).to(on.k[0].dtype)
        calls.clear()
        a, b = on.attend(0, q, ctx), off.attend(0, q, ctx)
        took = bool(calls)
        assert took == (dtype == "bfloat16" and observe is None and window is None)
        assert (a.float() - b.float()).abs().max() <= (0.03 if took else 0)


@pytest.fixture(scope="module")
def tiny_dirs(tiny_dir, tmp_path_factory):
    """head_dim 16 (the default tiny config) and 64 (the native kernels' shape)."""
    return {16: tiny_dir, 64: write_tiny_llama(tmp_path_factory, "tiny64", hidden_size=128, num_attention_heads=2,
                                               num_key_value_heads=1)}


@pytest.mark.parametrize("head_dim,switch", [(16, "paged_kernel"), (64, "paged_kernel"), (64, "prefill_kernel")])
def test_bf16_engine_generates_alike_with_and_without_the_kernel(tiny_dirs, monkeypatch, head_dim, switch):
    """Ragged prompts, chunked prefill and preemption in bf16, with the decode kernel (paged_kernel: numba
    at head_dim 16, C at 64 where it runs) or the native multi-query kernel (prefill_kernel) switched on and
    off: logits within bf16 noise of SDPA's, and both runs end with no pages held."""
    if switch == "prefill_kernel" and not cpu_prefill_attention.available():
        pytest.skip("the native multi-query kernel does not run here: SDPA either way")
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 90, 41, 170, 9)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run(kernel: bool):
        monkeypatch.setattr(RawKVBackend, switch, kernel)
        llm = LLM(model=str(tiny_dirs[head_dim]), dtype="bfloat16", num_pages=80, page_size=4, keep_logits=True,
                  max_num_batched_tokens=64)
        outs = llm.generate(prompts, params)
        assert_engine_empty(llm)
        return outs, llm.scheduler.stats

    got, stats = run(True)
    assert stats.num_preemptions > 0 and stats.num_chunked_prefills > 0, stats
    want, _ = run(False)
    for a, b in zip(got, want):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        assert n >= 4  # greedy paths agree at least until a near-tie flips (bf16)
        la, lb = torch.stack(a.logits[:n]), torch.stack(b.logits[:n])
        assert (la - lb).abs().max() <= 0.1 * lb.abs().max()


def test_rows_past_their_pages_are_refused_before_the_kernel_reads():
    pool = bits(torch.zeros(4, 4, 1, 8, dtype=torch.bfloat16))
    q = bits(torch.zeros(2, 1, 8, dtype=torch.bfloat16))
    table = np.array([[1, 2], [3, 0]], dtype=np.int64)
    with pytest.raises(ValueError, match="outside"):
        attend_decode_bf16(q, pool, pool, table, np.array([9, 2], dtype=np.int64), 1.0)
    with pytest.raises(ValueError, match="outside"):
        attend_decode_bf16(q, pool, pool, table, np.array([0, 2], dtype=np.int64), 1.0)
    with pytest.raises(ValueError, match="lengths"):
        attend_decode_bf16(q, pool, pool, table, np.array([2], dtype=np.int64), 1.0)
    assert attend_decode_bf16(q, pool, pool, table, np.array([8, 1], dtype=np.int64), 1.0).shape == (2, 1, 8)


@pytest.mark.parametrize("dtype,fmt,ragged", [("bfloat16", "raw", True), ("float32", "raw", False),
                                               ("bfloat16", "int8", False), ("bfloat16", "kivi4", False)])
def test_only_the_kernel_backend_skips_length_buckets(dtype, fmt, ragged):
    backend = make_backend(KVPageSpec(1, 2, 16, 4, dtype, fmt), 64)
    assert backend.ragged_decode is ragged
    lens = [3, 300, 41, 170, 9, 260]  # far apart: the builder would split them
    layouts = [SeqLayout(f"r{i}", 1, n, list(range(-(-(n + 1) // 4)))) for i, n in enumerate(lens)]
    groups = build_context(layouts, 4, 0.25, bucket_decode=not backend.ragged_decode).groups
    assert (len(groups) == 1) is ragged and sum(g.batch for g in groups) == len(lens)
