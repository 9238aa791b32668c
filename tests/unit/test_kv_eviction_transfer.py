"""Eviction on the prefill side, shipped: a prefill engine that thins the prompt KV at the end of prefill
sends only the kept tokens (compacted), the decode engine adopts exactly that many slots and frees the
rest of its reservation, and the output equals one engine evicting locally with the same policy -- with
raw and int8 pages. A finish frame announcing kept tokens that did not all arrive is refused."""
from __future__ import annotations

import pytest

from engine import SamplingParams
from engine.llm import LLM
from kv_transfer import codec
from kv_transfer.config import ReceiverConfig
from kv_transfer.contract import FailedPrecondition, TransferState
from kv_transfer.fake_transport import FakeTransport
from kv_transfer.receiver import KVReceiver
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.kv_helpers import close_all, ship_all

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(10, 70)), [7, 8, 9] * 20 + [5], list(range(100, 140)), [3, 4]]  # the last two: kept whole
POLICIES = [{"method": "snapkv", "budget": 0.5, "min_prompt": 48, "window": 8, "pool": 3},
            {"method": "streaming", "budget": 12, "min_prompt": 48, "sinks": 4}]


def make(tiny_dir, page_size, fmt="raw", policy=None, **kw):
    return LLM(model=str(tiny_dir), dtype="float32", num_pages=64, page_size=page_size, kv_storage=fmt,
               kv_eviction=policy, **kw)


@pytest.mark.parametrize("fmt", ["raw", "int8"])
@pytest.mark.parametrize("policy", POLICIES)
def test_evicted_prefill_shipped_equals_local_eviction(tiny_dir, fmt, policy):
    local = make(tiny_dir, 4, fmt, policy)
    want = [o.token_ids for o in local.generate(PROMPTS, GREEDY)]
    pre = make(tiny_dir, 4, fmt, policy, max_num_batched_tokens=16)  # chunked: the last chunk decides
    dec = make(tiny_dir, 8, fmt)  # the decode side needs no policy: it adopts what arrives
    got, descs, (tx, rx, transport) = ship_all(pre, dec, PROMPTS, GREEDY)
    assert_greedy_equal(want, got)
    c, pol = pre.config, pre.eviction
    cell = dec.kv_spec.token_head_bytes()
    for d, p in zip(descs, PROMPTS):
        st = rx.status(d.reservation_id)
        kept = pol.keep_count(len(p)) if pol.applies(len(p)) else len(p)
        assert st.state == TransferState.DONE and st.bytes == kept * c.num_layers * 2 * c.num_kv_heads * cell
    assert pre.num_evicted_tokens == sum(len(p) - pol.keep_count(len(p)) for p in PROMPTS if pol.applies(len(p)))
    close_all(tx, rx, transport, [pre, dec])
    assert_engine_empty(local)


def test_a_finish_announcing_kept_tokens_that_did_not_arrive_is_refused(tiny_dir):
    dec = make(tiny_dir, 4)
    transport = FakeTransport()
    rx = KVReceiver(dec, ReceiverConfig())
    address = rx.serve(transport)
    desc = rx.reserve(40, GREEDY)
    layout = codec.TransferLayout.from_spec(dec.kv_spec, dec.kv_spec.token_head_bytes())
    c = dec.config
    frames = [codec.encode(codec.open_frame(desc, layout, list(range(40)), c.num_kv_heads))]
    half = memoryview(bytes(10 * c.num_kv_heads * dec.kv_spec.token_head_bytes()))
    for layer in range(c.num_layers):  # tokens [0, 10) of every layer, but the finish claims 12
        frames.append(codec.chunk_wire(layout, layer, 0, 10, half, half))
    frames.append(codec.encode(codec.finish_frame(5, c.num_layers, num_slots=12)))
    with pytest.raises(FailedPrecondition, match="kept tokens"):
        rx.handle_push(iter(frames), None)
    rx.pump()
    close_all(None, rx, transport, [dec])
