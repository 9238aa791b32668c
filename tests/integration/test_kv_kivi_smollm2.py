"""kivi4 disaggregated, real parts: SmolLM2 (float32 compute, as every exactness test) prefilled on one
engine with kivi4 pages, the whole pages shipped over gRPC on loopback into a decode engine with kivi4
pages, which recomputes the tail of each prompt ending inside a page (engine/kv_cache/kivi.py,
"Transfer") -- decodes exactly like one engine with kivi4 pages, for prompts on and off page boundaries,
and ships only whole pages (~0.34x the bytes of raw bfloat16). Both engines end with zero pages,
reservations and staging rows."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from kv_transfer.contract import TransferState, make_transport
from tests.exactness import assert_greedy_equal
from tests.kv_helpers import close_all, ship_all
from tests.prompts import token_prompts

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LENGTHS = [9, 32, 53]  # < one page (nothing ships), 2 whole pages, 3 pages + a 5-token tail


def engine(**kw):
    return LLM(model="smollm2-135m", dtype="float32", page_size=16, num_pages=64, kv_storage="kivi4", **kw)


def test_kivi4_shipped_over_grpc_equals_kivi4_computed_locally(smollm2_dir):
    local = engine(max_num_batched_tokens=48)  # prefill chunks end inside pages
    prompts = token_prompts(local.tokenizer, LENGTHS)
    want = [o.token_ids for o in local.generate(prompts, PARAMS)]
    pre, dec = local, engine()  # (local is idle again: it prefills for the transfer now)
    got, descs, (tx, rx, transport) = ship_all(pre, dec, prompts, PARAMS, make_transport("grpc"), 64 << 10, 120)
    assert_greedy_equal(want, got)
    c = pre.config
    raw_bytes = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2  # per token, raw bfloat16
    for d, n in zip(descs, LENGTHS):
        st, whole = rx.status(d.reservation_id), n - n % 16
        assert st.state == TransferState.DONE and st.bytes == rx.layout.transfer_bytes(whole), (n, st)
        if whole:
            assert st.bytes / (whole * raw_bytes) <= 0.35
    close_all(tx, rx, transport, [pre, dec])
    assert pre.backend.num_staged == dec.backend.num_staged == 0
