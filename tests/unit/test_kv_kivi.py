"""KIVI-style 4-bit pages ("kivi4", engine/kv_cache/kivi.py) on a tiny model: the codec's error bounds, a
page sealing when its last slot is written, the read rule (own page from full-precision staging, earlier
pages from cells) making chunked, single-step and speculative runs agree, rollback into a page sealed in
the same step, shipping sealed pages by page_io equal to local decoding (unsealed pages refused, typed;
the sender and receiver: test_kv_kivi_transfer.py),
prefix caching composing, eviction refused, a sliding window (Mistral) applied to cells and staging alike --
and every test ending with no staging row held."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.errors import InvalidRequestError
from engine.kv_cache import kivi
from engine.kv_cache.backend import make_backend
from engine.kv_cache.kivi import KVFormatError, dequantize_pages, quantize_pages
from engine.kv_cache.page_io import export_kv, import_kv
from engine.kv_cache.spec import KIVI_VALUE_GROUP, KVPageSpec
from engine.llm import LLM
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.prompts import TINY_PROMPTS

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = TINY_PROMPTS


def make(tiny_dir, page_size=4, **kw):
    return LLM(model=str(tiny_dir), dtype="float32", num_pages=kw.pop("num_pages", 64), page_size=page_size,
               kv_storage="kivi4", **kw)


def assert_kivi_empty(llm) -> None:
    assert_engine_empty(llm)
    assert llm.backend.num_staged == 0, "staging rows leaked"


def run(llm, prompts=PROMPTS, params=GREEDY):
    out = [o.token_ids for o in llm.generate(prompts, params)]
    assert_kivi_empty(llm)
    return out


@pytest.mark.parametrize("ps, hd", [(16, 64), (4, 16), (32, 64), (128, 64), (8, 128)])
def test_codec_error_is_half_a_step_per_channel_and_per_token_group(ps, hd):
    torch.manual_seed(0)
    k = torch.randn(3, ps, 2, hd) * torch.logspace(-2, 1.5, hd)  # channels of any scale (outliers)
    v = torch.randn(3, ps, 2, hd) * torch.logspace(-2, 2, ps).view(1, ps, 1, 1)  # tokens of any scale
    g = min(hd, KIVI_VALUE_GROUP)
    kc, vc = quantize_pages(k, v)
    assert kc.dtype == torch.uint8 and kc.shape == vc.shape == (3, ps, 2, KVPageSpec(1, 2, hd, ps, "float32",
                                                                                      "kivi4").token_head_bytes())
    k2, v2 = dequantize_pages(kc, vc, hd)
    k_step = (k.amax(1, keepdim=True) - k.amin(1, keepdim=True)) / 15  # per (page, head, channel)
    vg = v.view(3, ps, 2, hd // g, g)
    v_step = ((vg.amax(-1, keepdim=True) - vg.amin(-1, keepdim=True)) / 15).expand_as(vg).reshape(v.shape)
    # half a step, plus float16 rounding of the step and of the zero point
    assert torch.all((k2 - k).abs() <= 0.5 * k_step * 1.01 + k.abs().amax(1, keepdim=True) * 2 ** -10)
    assert torch.all((v2 - v).abs() <= 0.5 * v_step * 1.01 + v.abs().amax(-1, keepdim=True) * 2 ** -10)  # per group


def test_bytes_per_token_are_about_a_third_of_bfloat16():
    spec = KVPageSpec(30, 3, 64, 16, "bfloat16", "kivi4")
    assert spec.token_head_bytes() == 44  # 32 nibble bytes + (2 x 4 value + 16 key-metadata bytes) / 2
    assert spec.bytes_per_token_layer() / KVPageSpec(30, 3, 64, 16, "bfloat16").bytes_per_token_layer() < 0.35
    with pytest.raises(ValueError, match="kivi4"):
        KVPageSpec(30, 3, 64, 24, "bfloat16", "kivi4")  # 24 does not divide 256: scales would not spread
    a, b = KVPageSpec(2, 2, 16, 4, "float32", "kivi4"), KVPageSpec(2, 2, 16, 8, "float32", "kivi4")
    assert a.signature() != b.signature()  # cells carry their page's scales: page size is part of the layout


def test_a_page_seals_when_its_last_slot_is_written():
    torch.manual_seed(1)
    b = make_backend(KVPageSpec(1, 2, 16, 4, "float32", "kivi4"), 8)
    k, v = torch.randn(6, 2, 16), torch.randn(6, 2, 16)
    slots = torch.tensor([12, 13, 14, 28, 29, 30])  # pages 3 and 7, three slots each
    b.write(0, slots, k, v)
    assert not b.sealed[3] and b.num_staged == 2
    rk, rv = b.read(0, slots)
    assert torch.equal(rk, k) and torch.equal(rv, v)  # unsealed: exact, from staging
    k4 = torch.randn(1, 2, 16) * 10
    b.write(0, torch.tensor([15]), k4, k4)
    assert b.sealed[3] and not b.sealed[7]
    rk, _ = b.read(0, torch.tensor([12, 13, 14, 15]))
    h = b.h if kivi.ROTATE_K else torch.eye(16)  # keys are quantized in the rotated space
    want = torch.cat([k[:3], k4]) @ h
    step = (want.amax(0) - want.amin(0)) / 15  # per (head, channel) over the page
    assert not torch.equal(rk[:3], k[:3]) and torch.all((rk @ h - want).abs() <= step * 0.51 + 1e-3)
    b.release_pages([3, 7])
    assert b.num_staged == 0


def test_one_page_of_context_reads_exactly_like_raw_pages(tiny_dir):
    """With pages longer than every sequence nothing seals: kivi4 is the full-precision tail alone."""
    raw = LLM(model=str(tiny_dir), dtype="float32", num_pages=8, page_size=64)
    want = [o.token_ids for o in raw.generate(PROMPTS, GREEDY)]
    assert_greedy_equal(want, run(make(tiny_dir, page_size=64, num_pages=8)))


def test_chunked_prefill_and_batching_read_the_same_numbers(tiny_dir):
    """The read rule is per query position: a prompt in one step, in chunks of 3, or alone agrees."""
    want = run(make(tiny_dir, max_num_batched_tokens=512))
    assert_greedy_equal(want, run(make(tiny_dir, max_num_batched_tokens=3, max_num_seqs=2)))
    alone = [run(make(tiny_dir), [p])[0] for p in PROMPTS]
    assert_greedy_equal(want, alone)


@pytest.mark.parametrize("proposer", ["oracle", "always_wrong", "ngram"])
def test_speculative_output_equals_plain_output(tiny_dir, proposer):
    """Verify steps of 1 + 3 tokens fill and seal pages, then roll back into them: the staging copy is
    kept until the page can no longer be rewritten, so the rewrite reseals from exact content."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = run(make(tiny_dir), params=params)
    opts = {"futures": {tuple(p): o for p, o in zip(PROMPTS, want)}} if proposer != "ngram" else {}
    spec = make(tiny_dir, speculative={"proposer": proposer, "max_draft": 3, "gate": False, "proposer_options": opts})
    assert_greedy_equal(want, run(spec, params=params))
    st = spec.spec.stats
    assert st.num_drafted > 0
    if proposer == "oracle":  # every draft accepted: whole pages sealed inside verify steps
        assert st.acceptance_rate == 1.0, st
    if proposer == "always_wrong":  # every draft rolled back, some into pages the same step sealed
        assert st.num_accepted == 0, st
        assert spec.backend.num_reopened > 0  # and rewritten from inside, resealed from staging


def test_shipped_sealed_pages_decode_like_local_pages(tiny_dir):
    """KV quantized on one engine and moved as stored (page_io, what the transfer layer calls) continues
    exactly like the engine that computed it; an unsealed page refuses to leave, typed."""
    prompt = list(range(20, 44))  # 24 tokens = 6 whole pages of 4
    pre, dec = make(tiny_dir, max_num_batched_tokens=7), make(tiny_dir)
    local = run(make(tiny_dir), [prompt])[0]
    rid = pre.add_request(prompt, GREEDY, prefill_only=True)
    first = [o for o in pre.generate_until_idle() if o.request_id == rid][0].token_ids[0]
    pages, n = pre.held_pages(rid)
    res = dec.reserve(n)
    dst = res.pages
    for layer in pre.kv_spec.local_layers:
        k, v = export_kv(pre.backend, layer, pages, 0, n)
        import_kv(dec.backend, layer, dst, 0, n, bytes(k) + bytes(v))
    assert dec.backend.num_staged == 0 and bool(dec.backend.sealed[dst].all())
    with pytest.raises(KVFormatError, match="not sealed"):
        pre.backend.sealed[pages[-1]] = False  # as for a prompt ending inside a page
        export_kv(pre.backend, 0, pages, 0, n)
    pre.release_held(rid)
    assert_kivi_empty(pre)
    dec.add_prefilled_request(prompt, first, res.reservation_id, GREEDY)
    got = [o for o in dec.generate_until_idle()][-1].token_ids
    assert_greedy_equal([local], [got])
    assert_kivi_empty(dec)


def test_prefix_caching_shares_sealed_pages(tiny_dir):
    system = list(range(100, 117))  # 17 tokens: 4 whole pages shared, the 5th recomputed
    prompts = [system + [3, 4, 5], system + [9], system + [7, 7, 7, 7, 7]]
    want = run(make(tiny_dir), prompts)
    cached = make(tiny_dir, enable_prefix_caching=True)
    got = [run(cached, [p])[0] for p in prompts]  # one by one: later ones hit the cache
    assert_greedy_equal(want, got)
    assert cached.prefix_stats()["hit_tokens"] >= 32


def test_prefix_caching_with_rollbacks(tiny_dir):
    """Cached sealed pages shared while drafts are rejected and pages reopened: still the plain tokens."""
    system = list(range(100, 117))
    prompts = [system + [3, 4, 5], system + [9], system + [7, 7, 7, 7, 7]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    want = run(make(tiny_dir), prompts, params)
    opts = {"futures": {tuple(p): o for p, o in zip(prompts, want)}}
    llm = make(tiny_dir, enable_prefix_caching=True,
               speculative={"proposer": "always_wrong", "max_draft": 3, "gate": False, "proposer_options": opts})
    got = [run(llm, [p], params)[0] for p in prompts]
    assert_greedy_equal(want, got)
    assert llm.prefix_stats()["hit_tokens"] >= 32 and llm.backend.num_reopened > 0


def test_eviction_is_refused_with_kivi4(tiny_dir):
    with pytest.raises(InvalidRequestError, match="kivi4"):
        make(tiny_dir, kv_eviction={"method": "streaming", "budget": 0.5, "min_prompt": 8})
    llm = make(tiny_dir)
    with pytest.raises(InvalidRequestError, match="kivi4"):
        llm.add_request(PROMPTS[0], SamplingParams(kv_eviction={"method": "streaming", "budget": 0.5}))
    assert_kivi_empty(llm)


def test_yaml_pool_takes_kivi4_but_not_with_eviction():
    from pydantic import ValidationError

    from cluster.spec_sections import KVPages

    assert KVPages(storage="kivi4").storage == "kivi4"
    with pytest.raises(ValidationError, match="kivi4"):
        KVPages(storage="kivi4", eviction={"method": "snapkv", "budget": 0.3})
    # colocated and disaggregated (whole pages ship; the decode side recomputes a tail: test_kv_kivi_transfer.py)
    from cluster.spec import parse_spec

    kv = {"kv": {"storage": "kivi4"}}
    assert parse_spec({"model": "m", "mode": "colocated", "pools": {"colocated": kv}}).pools.colocated.kv.storage == "kivi4"
    assert parse_spec({"model": "m", "pools": {"prefill": kv, "decode": kv}}).pools.decode.kv.storage == "kivi4"
    from cluster.spec_errors import SpecError

    with pytest.raises(SpecError, match="pools.decode.kv.page_size.*same page size"):
        parse_spec({"model": "m", "pools": {"prefill": kv, "decode": {"kv": {"storage": "kivi4", "page_size": 32}}}})


def test_a_sliding_window_applies_to_cells_and_staging(tmp_path):
    """Mistral's sliding window (Gemma 3's local layers alike: tests/integration/test_new_models_kv.py): pages
    too long to seal read exactly like raw pages, and chunked / batched reads of sealed pages agree."""
    from tests.tiny_models import write_tiny

    d = write_tiny("mistral", tmp_path / "mistral", sliding_window=8, initializer_range=0.1)
    assert max(map(len, PROMPTS)) + GREEDY.max_tokens > 8
    raw = LLM(model=str(d), dtype="float32", num_pages=8, page_size=64)
    want = [o.token_ids for o in raw.generate(PROMPTS, GREEDY)]
    assert_greedy_equal(want, run(make(d, page_size=64, num_pages=8)))
    sealed = run(make(d, max_num_batched_tokens=512))
    assert_greedy_equal(sealed, run(make(d, max_num_batched_tokens=3, max_num_seqs=2)))
