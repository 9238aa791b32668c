"""The Triton paged attention kernel (engine/kernels/cuda/paged_attention.py) against its torch reference,
on CPU under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA): float32 and
bfloat16 pages, GQA groups, ragged contexts, padding rows, 1 + k queries per row, KV splits, a column-major
page table as CUDA graphs pass it."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels.cuda.paged_attention import num_splits, paged_attention  # noqa: E402
from engine.kernels.reference import paged_attention as reference  # noqa: E402

CASES = [  # batch, q heads, kv heads, head dim, page size, q_len, splits, context lengths
    (3, 4, 2, 16, 16, 1, 1, [5, 40, 0]),  # a padding row (length 0)
    (2, 9, 3, 64, 16, 1, 4, [100, 300]),  # SmolLM2's heads; splits over ragged rows
    (2, 8, 2, 32, 16, 3, 2, [20, 70]),  # 1 + 2 queries per row (verify)
    (1, 4, 4, 16, 8, 5, 1, [5]),  # q_len == context: the first query sees one key
    (4, 2, 1, 48, 16, 1, 8, [1, 17, 64, 129]),  # head dim not a power of two; more splits than keys
]


def _inputs(case, dtype, seed=0):
    b, hq, hkv, d, ps, ql, _, lens = case
    g = torch.Generator().manual_seed(seed)
    pages = 64
    k = torch.randn(pages, ps, hkv, d, generator=g).to(dtype)
    v = torch.randn(pages, ps, hkv, d, generator=g).to(dtype)
    width = max(1, -(-max(lens) // ps))
    table = torch.stack([torch.randperm(pages, generator=g)[:width] for _ in range(b)]).to(torch.int32)
    q = torch.randn(b * ql, hq, d, generator=g).to(dtype)
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}h{c[1]}/{c[2]}d{c[3]}q{c[5]}s{c[6]}")
def test_kernel_matches_reference(case, dtype, atol):
    q, k, v, table, lens = _inputs(case, dtype)
    ql, splits = case[5], case[6]
    got = paged_attention(q, k, v, table, lens, case[3] ** -0.5, ql, splits)
    want = reference(q, k, v, table, lens, case[3] ** -0.5, ql)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)
    pad = [i for i, n in enumerate(lens.tolist()) if n == 0]
    for r in pad:  # padding rows read nothing and write zeros
        assert torch.count_nonzero(got[r * ql:(r + 1) * ql]) == 0


def test_column_major_table_and_splits_agree():
    case = CASES[1]
    q, k, v, table, lens = _inputs(case, torch.float32, seed=3)
    col = table.t().contiguous().t()  # same values, strides (1, batch): how graph_decode lays it out
    one = paged_attention(q, k, v, table, lens, 0.125, 1, 1)
    for splits in (2, 8):
        torch.testing.assert_close(paged_attention(q, k, v, col, lens, 0.125, 1, splits), one, atol=1e-5, rtol=1e-5)


def test_the_kernel_can_fail():
    """A wrong page table must change the answer (the comparison above is not vacuous)."""
    case = CASES[1]
    q, k, v, table, lens = _inputs(case, torch.float32)
    want = reference(q, k, v, table, lens, 0.125)
    got = paged_attention(q, k, v, table.flip(1).contiguous(), lens, 0.125, 1, 4)
    assert not torch.allclose(got, want, atol=1e-3)


def test_num_splits_fills_the_gpu_and_stays_a_power_of_two():
    assert num_splits(1, 8, 2048, 132) == 8  # 2048 / 256 keys per split at least
    assert num_splits(1, 8, 32768, 132) == 32  # 2 x 132 SMs / 8 programs -> 33 -> 32
    assert num_splits(128, 8, 2048, 132) == 1  # 1024 programs already
    assert num_splits(3, 3, 100, 132) == 1
    for b in (1, 2, 3, 5, 7, 16):
        n = num_splits(b, 3, 8192, 132)
        assert n & (n - 1) == 0


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: f"b{c[0]}h{c[1]}/{c[2]}d{c[3]}q{c[5]}s{c[6]}")
@pytest.mark.parametrize("align", [1, 16])
def test_int8_cells_match_reference_on_dequantized_pages(case, dtype, atol, align):
    """int8 pages (engine/kv_cache/quantized.py cells: values + a float16 scale, padded to `align` bytes as
    the Triton path stores them) dequantized as they load."""
    from engine.kv_cache.quantized import dequantize, quantize

    q, k, v, table, lens = _inputs(case, dtype, seed=5)
    d = case[3]
    width = -(-(d + 2) // align) * align
    k_cells, v_cells = quantize(k, "int8", width), quantize(v, "int8", width)  # [P, ps, kv_heads, width] uint8
    assert k_cells.shape[-1] == width and (align == 1 or width % 16 == 0)
    got = paged_attention(q, k_cells, v_cells, table, lens, 0.2, case[5], case[6])
    want = reference(q, dequantize(k_cells, "int8", dtype, d), dequantize(v_cells, "int8", dtype, d), table, lens,
                     0.2, case[5])
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("splits", [1, 4])
def test_quest_pages_per_kv_head_match_the_torch_sparse_path(dtype, atol, splits):
    """Per-(row, KV head) page lists, as sparse attention chooses them (kv_cache/sparse.Selection: chosen
    pages in page order, the row's partly filled last page among them, padding page 0 with 0 slots after),
    against `sparse.attend_torch` over the same choice; a padding row (0 slots) gives zeros."""
    from engine.kv_cache.sparse import Selection, attend_torch

    g = torch.Generator().manual_seed(11)
    b, hq, hkv, d, ps, chosen, pages = 3, 8, 2, 32, 16, 4, 64
    k = torch.randn(pages, ps, hkv, d, generator=g).to(dtype)
    v = torch.randn(pages, ps, hkv, d, generator=g).to(dtype)
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    lens = [150, 40, 0]  # rows of 10, 3 and 0 pages
    sel_pages = torch.zeros(b, hkv, chosen, dtype=torch.long)
    sel_slots = torch.zeros(b, hkv, chosen, dtype=torch.long)
    for r, n in enumerate(lens):
        if n == 0:
            continue
        table = torch.randperm(pages, generator=g)[:-(-n // ps)]
        for h in range(hkv):
            full = len(table) - 1
            pick = sorted(torch.randperm(full, generator=g)[:min(chosen - 1, full)].tolist()) + [full]
            sel_pages[r, h, :len(pick)] = table[pick]
            sel_slots[r, h, :len(pick)] = torch.tensor([ps] * (len(pick) - 1) + [n - full * ps])
    sel = Selection(sel_pages, sel_slots)
    heads = torch.arange(hkv).view(1, -1, 1)
    want = attend_torch(k[sel_pages, :, heads], v[sel_pages, :, heads], q, sel, 0.2)
    want[2] = 0  # (SDPA over a fully masked row gives NaN; the kernel's padding row gives zeros)
    got = paged_attention(q, k, v, sel_pages, sel_slots.sum(-1), 0.2, 1, splits)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)
