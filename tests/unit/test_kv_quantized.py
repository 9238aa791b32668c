"""Quantized KV pages ("int8", "fp8"; engine/kv_cache/quantized.py): the cell codec's error bounds, cells
moving bit-exactly between pools of different page sizes, KV quantized on a prefill engine and shipped
over the fake transport decoding exactly like one engine with the same format (the wire format is the
storage format), layouts of different formats refusing each other, the bytes shipped per token, and the
Hadamard rotation: orthonormal for any head dim, attention in the rotated space equal to plain attention."""
from __future__ import annotations

import random

import pytest
import torch

from engine import SamplingParams
from engine.attention_context import SeqLayout, build_context
from engine.kv_cache.backend import make_backend
from engine.kv_cache.page_io import export_kv, import_kv
from engine.kv_cache.quantized import dequantize, hadamard, quantize
from engine.kv_cache.spec import KVPageSpec
from engine.llm import LLM
from kv_transfer.config import ReceiverConfig, SenderConfig
from kv_transfer.contract import FailedPrecondition, TransferState
from kv_transfer.fake_transport import FakeTransport
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.kv_helpers import close_all, ship_all
from tests.prompts import TINY_PROMPTS

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = TINY_PROMPTS
FORMATS = ["int8", "fp8"]


def make(tiny_dir, fmt, page_size=4, **kw):
    return LLM(model=str(tiny_dir), dtype="float32", num_pages=64, page_size=page_size, kv_storage=fmt, **kw)


@pytest.mark.parametrize("fmt, rel", [("int8", 1 / 254), ("fp8", 1 / 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codec_error_is_bounded_per_token_and_head(fmt, rel, dtype):
    torch.manual_seed(0)
    x = (torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50).view(50, 1, 1)).to(dtype)  # rows of any scale
    x[7] = 0  # an all-zero row stays zero
    cells = quantize(x, fmt)
    assert cells.dtype == torch.uint8 and cells.shape == (50, 3, 66)
    y = dequantize(cells, fmt, torch.float32)
    absmax = x.float().abs().amax(-1, keepdim=True)
    qmax = 127 if fmt == "int8" else 448
    scale = cells[..., 64:].contiguous().view(torch.float16).float()  # the stored step, [50, 3, 1]
    want = (absmax / qmax).clamp_min(2 ** -14)  # tiny rows share the smallest normal float16 step
    assert torch.all((scale - want).abs() <= want * 2 ** -10)  # float16 rounding of the step only
    # int8: half a step; fp8 e4m3: 3 mantissa bits (half an ulp is 1/16 of the value), subnormals 2^-9 steps
    bound = scale * 0.5 * 1.001 if fmt == "int8" else x.float().abs() * rel + scale * 2 ** -10
    assert torch.all((y - x.float()).abs() <= bound)
    assert torch.equal(y[7], torch.zeros_like(y[7]))
    assert torch.equal(quantize(y, fmt), cells)  # dequantized values re-quantize to the same cells


@pytest.mark.parametrize("fmt", FORMATS)
def test_cells_round_trip_between_page_sizes_bit_exactly(fmt):
    rng = random.Random(1)
    for trial in range(20):
        src_ps, dst_ps = rng.choice([1, 4, 16]), rng.choice([2, 8, 32])
        src = make_backend(KVPageSpec(1, 3, 8, src_ps, "bfloat16", fmt), 64)
        dst = make_backend(KVPageSpec(1, 3, 8, dst_ps, "bfloat16", fmt), 64)
        src.write(0, torch.arange(64 * src_ps), torch.randn(64 * src_ps, 3, 8), torch.randn(64 * src_ps, 3, 8))
        n = rng.randint(1, 60)
        start = rng.randint(0, n - 1)
        src_pages = rng.sample(range(64), -(-n // src_ps))
        dst_pages = rng.sample(range(64), -(-n // dst_ps))
        k, v = export_kv(src, 0, src_pages, start, n)
        assert len(k) == (n - start) * 3 * 10  # 8 values + a 2-byte scale per (token, head)
        import_kv(dst, 0, dst_pages, start, n, bytes(k) + bytes(v))

        def slots(pages, ps):
            return torch.tensor([pages[t // ps] * ps + t % ps for t in range(start, n)])
        for pool_src, pool_dst in ((src.k[0], dst.k[0]), (src.v[0], dst.v[0])):
            a = pool_src.view(-1, 3, 10)[slots(src_pages, src_ps)]
            b = pool_dst.view(-1, 3, 10)[slots(dst_pages, dst_ps)]
            assert torch.equal(a, b), (trial, fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_kv_shipped_decodes_like_one_engine_with_that_format(tiny_dir, fmt):
    alone = make(tiny_dir, fmt)
    reference = [o.token_ids for o in alone.generate(PROMPTS, GREEDY)]
    assert_engine_empty(alone)
    pre, dec = make(tiny_dir, fmt, 4, max_num_batched_tokens=16), make(tiny_dir, fmt, 8)
    got, descs, (tx, rx, transport) = ship_all(pre, dec, PROMPTS, GREEDY)
    assert_greedy_equal(reference, got)  # same cells on both sides: exactly the same tokens
    c = pre.config
    for d, p in zip(descs, PROMPTS):
        st = rx.status(d.reservation_id)
        assert st.state == TransferState.DONE
        assert st.bytes == len(p) * c.num_layers * 2 * c.num_kv_heads * (c.head_dim + 2)
    close_all(tx, rx, transport, [pre, dec])


def _assert_refused(pre, dec):
    """A transfer from `pre` into pages `dec` reserved is refused as a layout mismatch; nothing leaks."""
    assert pre.kv_spec.signature() != dec.kv_spec.signature()
    transport = FakeTransport()
    rx = KVReceiver(dec, ReceiverConfig())
    address = rx.serve(transport)
    tx = KVSender(pre, transport, SenderConfig(chunk_bytes=1024))
    desc = rx.reserve(len(PROMPTS[0]), GREEDY)
    rid = pre.add_request(PROMPTS[0], GREEDY, prefill_only=True)
    with pytest.raises(FailedPrecondition, match="layout"):
        tx.send(rid, desc, address)
    pre.abort(rid)
    rx.cancel(desc.reservation_id)
    rx.pump()
    close_all(tx, rx, transport, [pre, dec])


def test_a_raw_decode_pool_refuses_quantized_pages(tiny_dir):
    _assert_refused(make(tiny_dir, "int8"), make(tiny_dir, "raw"))


def test_cells_padded_for_the_triton_path_are_another_layout(tiny_dir, monkeypatch):
    """Where the Triton kernel reads int8 cells (PDSERVE_ATTENTION=triton) they are padded to 16 bytes; the
    same tokens as unpadded int8 pages, and a transfer between the two layouts is refused, not misread."""
    plain = make(tiny_dir, "int8")
    want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    monkeypatch.setenv("PDSERVE_ATTENTION", "triton")
    pytest.importorskip("triton")
    padded = make(tiny_dir, "int8", decode_graphs="off")
    d = padded.config.head_dim
    assert padded.kv_spec.cell_align == 16 and padded.kv_spec.token_head_bytes() == -(-(d + 2) // 16) * 16
    assert padded.backend.k[0].shape[-1] == padded.kv_spec.token_head_bytes() and padded.backend.triton_paged
    got = [o.token_ids for o in padded.generate(PROMPTS, GREEDY)]
    assert_greedy_equal(want, got)
    assert_engine_empty(padded)
    _assert_refused(padded, plain)


def test_compression_off_is_unchanged_and_int8_stays_close(tiny_dir):
    """raw pages are the default; int8 agrees with raw on most greedy tokens of the tiny model."""
    raw = LLM(model=str(tiny_dir), dtype="float32", num_pages=64, page_size=4)
    assert raw.kv_spec.storage_format == "raw"
    base = [o.token_ids for o in raw.generate(PROMPTS, GREEDY)]
    q = [o.token_ids for o in make(tiny_dir, "int8").generate(PROMPTS, GREEDY)]
    agree = sum(a == b for x, y in zip(base, q) for a, b in zip(x, y))
    assert agree >= 0.75 * sum(map(len, base)), (agree, base, q)


@pytest.mark.parametrize("head_dim", [64, 96, 80, 8])
def test_rotation_is_orthonormal_for_any_head_dim(head_dim):
    h = hadamard(head_dim)
    assert torch.allclose(h @ h.T, torch.eye(head_dim), atol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_in_the_rotated_space_equals_attention_over_the_stored_values(fmt):
    """The backend rotates queries in and outputs out instead of rotating the cache back: the result must
    equal plain attention over the dequantized, unrotated K/V that `read()` returns."""
    torch.manual_seed(3)
    spec = KVPageSpec(1, 2, 16, 4, "float32", fmt)
    b = make_backend(spec, 16)
    n = 13
    pages = [5, 2, 9, 11]
    slots = torch.tensor([pages[t // 4] * 4 + t % 4 for t in range(n)])
    k, v = torch.randn(n, 2, 16) * 3, torch.randn(n, 2, 16)
    k[:, :, 3] *= 20  # an outlier channel, as real keys have
    b.write(0, slots, k, v)
    rk, rv = b.read(0, slots)
    assert (rk - k).norm() / k.norm() < (0.01 if fmt == "int8" else 0.05)
    q = torch.randn(1, 4, 16)  # one decode token, 4 query heads over 2 KV heads
    ctx = build_context([SeqLayout("r", 1, n - 1, pages)], 4, 0.25)
    got = b.attend(0, q, ctx)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.view(1, 1, 4, 16).transpose(1, 2), rk.unsqueeze(0).transpose(1, 2), rv.unsqueeze(0).transpose(1, 2),
        scale=0.25, enable_gqa=True).transpose(1, 2).reshape(1, 4, 16)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("proposer", ["oracle", "always_wrong", "ngram"])
def test_speculative_output_equals_plain_output_over_quantized_pages(tiny_dir, fmt, proposer):
    """Cells are quantized per (token, head), so a verify step writing 1 + k tokens stores exactly what
    k + 1 single-token steps would; rejected drafts roll back. Same tokens, same pages left: none."""
    plain = make(tiny_dir, fmt)
    want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    spec = make(tiny_dir, fmt, speculative={"proposer": proposer, "max_draft": 3, "gate": False})
    got = [o.token_ids for o in spec.generate(PROMPTS, GREEDY)]
    assert_greedy_equal(want, got)
    assert_engine_empty(spec)
