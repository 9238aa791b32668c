"""Acceptance (compressed KV, real parts): SmolLM2 (float32 compute, as every exactness test) with int8
pages and SnapKV at 30% on the prefill engine, the kept KV shipped over gRPC on loopback into a decode engine with int8 pages, decodes
exactly like one engine compressing locally with the same policy -- and ships ~0.155x the bytes of raw
bfloat16 KV for the prompt. Both engines end with zero pages and reservations."""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from kv_transfer.contract import TransferState, make_transport
from tests.exactness import assert_greedy_equal
from tests.kv_helpers import close_all, ship_all
from tests.prompts import token_prompts

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
POLICY = {"method": "snapkv", "budget": 0.3, "min_prompt": 256}
LENGTHS = [40, 300, 700]  # the first is too short to evict


def engine(policy=None, page_size=16):
    return LLM(model="smollm2-135m", dtype="float32", page_size=page_size, num_pages=256, kv_storage="int8",
               kv_eviction=policy, max_num_batched_tokens=512)


def test_compressed_on_the_prefill_side_and_shipped_equals_compressed_locally(smollm2_dir):
    local = engine(POLICY)
    prompts = token_prompts(local.tokenizer, LENGTHS)
    want = [o.token_ids for o in local.generate(prompts, PARAMS)]
    pre, dec = engine(POLICY), engine(page_size=32)
    got, descs, (tx, rx, transport) = ship_all(pre, dec, prompts, PARAMS, make_transport("grpc"), 256 << 10, 300)
    assert_greedy_equal(want, got)
    c, pol = pre.config, pre.eviction
    raw_bytes = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2  # per token, raw bfloat16 (what serving uses)
    for d, p in zip(descs, prompts):
        kept = pol.keep_count(len(p)) if pol.applies(len(p)) else len(p)
        st = rx.status(d.reservation_id)
        assert st.state == TransferState.DONE and st.bytes == kept * c.num_layers * 2 * c.num_kv_heads * 66
        if pol.applies(len(p)):
            assert st.bytes / (len(p) * raw_bytes) <= 0.17
    close_all(tx, rx, transport, [pre, dec, local])
