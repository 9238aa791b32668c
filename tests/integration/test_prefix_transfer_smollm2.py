"""SmolLM2-135M (float32), prefix caching on both sides of a real loopback gRPC KV transfer: greedy-equal to
one engine with the cache off, only the KV past the decode side's cached prefix on the wire.

A 200-token "system prompt" is shared at lengths 0, 16 (a page boundary), 17 (one past it), 100 and 200,
then questions; a prefill engine warmed on the whole system prompt and a decode engine on its first 50
tokens (so the sender reads the gap between the two caches, tokens [48, 192), from its cached pages), all
requests shipped concurrently over gRPC. Bytes on the wire are exactly the tokens from each `kv_start`; both
engines end with only evictable cache pages, and `reset_prefix_cache()` empties them.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv_cache.page_io import stored_token_head_bytes
from kv_transfer import codec
from kv_transfer.config import ReceiverConfig, SenderConfig
from kv_transfer.contract import TransferState, make_transport
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from tests.exactness import assert_greedy_equal
from tests.kv_helpers import close_all, decode_all, drive
from tests.prompts import token_prompts
from tests.unit.leak_checks import assert_allocator_empty

pytestmark = pytest.mark.slow
PS = 16
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    system, *questions = token_prompts(tok, [200, 30, 41, 23, 57, 35, 12])
    shared = [0, 16, 17, 100, 200, 200]
    return system, [system[:n] + q for n, q in zip(shared, questions)] + [system[:16]]


@pytest.fixture(scope="module")
def reference(prompts):
    llm = LLM(dtype="float32", page_size=PS, num_pages=256, keep_logits=True)
    outs = llm.generate(prompts[1], PARAMS)
    close_all(llms=[llm])
    return [o.token_ids for o in outs], [torch.stack(o.logits) for o in outs]


def test_shared_system_prompt_ships_only_the_uncached_suffix_over_grpc(prompts, reference):
    system, batch = prompts
    pre = LLM(dtype="float32", page_size=PS, num_pages=256, enable_prefix_caching=True, max_num_batched_tokens=128)
    dec = LLM(dtype="float32", page_size=PS, num_pages=256, enable_prefix_caching=True)
    pre.generate(system, SamplingParams(max_tokens=1))  # prefill holds 192 tokens of it, decode 48
    dec.generate(system[:50], SamplingParams(max_tokens=1))
    transport = make_transport("grpc")
    rx = KVReceiver(dec, ReceiverConfig())
    address = rx.serve(transport)
    tx = KVSender(pre, transport, SenderConfig(chunk_bytes=256 << 10))
    descs = []
    for p in batch:
        descs.append(rx.reserve(len(p), PARAMS, token_ids=p))
        tx.send(pre.add_request(p, PARAMS, prefill_only=True), descs[-1], address)
    got = decode_all(dec, [d.request_id for d in descs], drive(tx, rx, timeout_s=300))
    assert_greedy_equal(reference[0], got, reference[1])
    assert [d.kv_start for d in descs] == [0, 16, 16, 48, 48, 48, 16]
    layout = codec.TransferLayout.from_spec(dec.kv_spec, stored_token_head_bytes(dec.kv_spec))
    for p, d in zip(batch, descs):
        st = rx.status(d.reservation_id)
        assert st.state == TransferState.DONE and st.bytes == layout.transfer_bytes(len(p) - d.kv_start)
    not_sent = sum(layout.transfer_bytes(d.kv_start) for d in descs)
    assert dec.prefix_stats()["kv_bytes_not_received"] == not_sent > 0
    print(f"\nKV bytes sent {sum(rx.status(d.reservation_id).bytes for d in descs)}, not sent {not_sent}; "
          f"prefill tokens saved {pre.prefix_stats()['prefill_tokens_saved']}")
    close_all(tx, rx, transport, [pre, dec])
    for llm in (pre, dec):
        u = llm.kv_usage()
        assert u["cached_pages"] == u["evictable_pages"]
        llm.reset_prefix_cache()
        assert_allocator_empty(llm.allocator)
