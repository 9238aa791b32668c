"""Prefix caching on the disaggregated KV path, sender + receiver over the in-process fake transport (tiny
random Llama, float32, pages of 4 tokens).

The decode engine shares its cached prefix into each reservation (`KVReceiver.reserve(..., token_ids=)`);
the descriptor's `kv_start` says where the KV to ship begins; the prefill engine starts after its own cached
prefix and ships only tokens from `kv_start` on, reading the gap [kv_start, its cached prefix) by slot from
the cached pages. Prompts share a 30-token prefix at various lengths (none, under a page, exactly a page
boundary, one past it, the whole prompt cached at a boundary, an identical prompt) and run concurrently;
outputs are greedy-equal to one engine with the cache off; bytes shipped are exactly the tokens from
`kv_start`; the receiver refuses chunks below it and an open frame announcing another start. Every test
ends with nothing in use on either side, only evictable cache pages, and an empty pool after a reset.
"""
from __future__ import annotations

import random

import pytest

from engine import SamplingParams
from engine.kv_cache.page_io import stored_token_head_bytes
from engine.llm import LLM
from kv_transfer import codec
from kv_transfer.config import ReceiverConfig, SenderConfig
from kv_transfer.contract import FailedPrecondition, InvalidFrame, TransferState
from kv_transfer.fake_transport import FakeTransport
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from tests.exactness import assert_greedy_equal
from tests.kv_helpers import close_all, decode_all, drive, prefill_held, wire
from tests.unit.leak_checks import assert_allocator_empty

PS = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
rng = random.Random(11)
BASE = [rng.randrange(3, 256) for _ in range(30)]
TAIL = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 7, 3, 9, 6)]
PROMPTS = [
    BASE[:8] + TAIL[0],  # exactly two pages (a page boundary)
    BASE[:9] + TAIL[1],  # one token past the boundary
    BASE[:16],  # the whole prompt cached on the decode side, ending at a page boundary: nothing to ship
    list(BASE),  # identical prompt: 7 full pages cached, the partial last page shipped
    BASE[:3] + TAIL[2],  # under a page: no hit
    TAIL[3] + BASE,  # same tokens at other positions: no hit
    BASE + TAIL[4],  # extends the warm prompt
    BASE[:16] + TAIL[0],
]
KV_START = [8, 8, 16, 28, 0, 0, 28, 16]  # what a decode engine warmed on BASE already holds of each


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return [o.token_ids for o in make(tiny_dir, False).generate(PROMPTS, GREEDY)]


def make(tiny_dir, cache: bool, **kw):
    return LLM(model=str(tiny_dir), dtype="float32", page_size=PS, num_pages=kw.pop("num_pages", 128),
               enable_prefix_caching=cache, **kw)


def token_bytes(llm) -> int:
    """Payload bytes of one token's KV over every layer (K and V)."""
    layout = codec.TransferLayout.from_spec(llm.kv_spec, stored_token_head_bytes(llm.kv_spec))
    return layout.transfer_bytes(1)


def ship(pre, dec, prompts, share: bool = True):
    """Reserve every prompt on `dec` (sharing its cached prefix), prefill all on `pre` at once and ship;
    decode to the end. (token ids per prompt, descriptors, receiver statuses, (tx, rx, transport))."""
    transport = FakeTransport()
    rx = KVReceiver(dec, ReceiverConfig())
    address = rx.serve(transport)
    tx = KVSender(pre, transport, SenderConfig(chunk_bytes=1024))
    descs = []
    for p in prompts:
        descs.append(rx.reserve(len(p), GREEDY, token_ids=list(p) if share else None))
        tx.send(pre.add_request(p, GREEDY, prefill_only=True), descs[-1], address)
    got = decode_all(dec, [d.request_id for d in descs], drive(tx, rx))
    return got, descs, [rx.status(d.reservation_id) for d in descs], (tx, rx, transport)


def assert_only_cache_left(*llms) -> None:
    for llm in llms:
        u = llm.kv_usage()
        assert u["pages_in_use"] == 0 and u["reservations"] == 0, u
        if llm.prefix_cache is not None:
            assert u["cached_pages"] == u["evictable_pages"]
            llm.reset_prefix_cache()
        assert_allocator_empty(llm.allocator)


@pytest.mark.parametrize("pre_cache,dec_cache", [(True, True), (False, True), (True, False), (False, False)])
def test_shared_prefixes_ship_only_the_uncached_suffix_and_stay_greedy_equal(tiny_dir, reference, pre_cache,
                                                                              dec_cache):
    pre, dec = make(tiny_dir, pre_cache, max_num_batched_tokens=16), make(tiny_dir, dec_cache)
    pre.generate(BASE, GREEDY)  # both sides have the system prompt cached (when their cache is on)
    dec.generate(BASE, GREEDY)
    got, descs, statuses, ends = ship(pre, dec, PROMPTS)
    assert_greedy_equal(reference, got)
    want = KV_START if dec_cache else [0] * len(PROMPTS)
    assert [d.kv_start for d in descs] == want
    per_token = token_bytes(dec)
    for p, d, st in zip(PROMPTS, descs, statuses):  # exactly the tokens from kv_start, nothing below it
        assert st.state == TransferState.DONE and st.bytes == (len(p) - d.kv_start) * per_token
    if dec_cache:
        assert dec.prefix_stats()["kv_bytes_not_received"] == sum(want) * per_token
    if pre_cache:  # every prompt sharing at least one full page of BASE started after it (chunks of 16)
        assert pre.prefix_stats()["hit_tokens"] >= 8 + 8 + 12 + 28 + 28 + 12
    close_all(*ends, [pre, dec])
    assert_only_cache_left(pre, dec)


def test_the_gap_between_the_decode_and_prefill_caches_is_read_from_cached_pages(tiny_dir, reference):
    """Prefill holds 28 tokens of BASE, decode only 8: tokens [8, 28) are never computed by this prefill
    but must be shipped -- read by slot from the prefill's cached pages."""
    pre, dec = make(tiny_dir, True), make(tiny_dir, True)
    pre.generate(BASE, GREEDY)
    dec.generate(BASE[:8] + TAIL[0], GREEDY)
    prompt = BASE + TAIL[4]
    got, descs, statuses, ends = ship(pre, dec, [prompt])
    assert_greedy_equal([reference[6]], got)
    assert descs[0].kv_start == 8 and statuses[0].bytes == (len(prompt) - 8) * token_bytes(dec)
    assert pre.prefix_stats()["hit_tokens"] == 28  # computed only the last 8 tokens
    close_all(*ends, [pre, dec])
    assert_only_cache_left(pre, dec)


def test_a_held_prefill_on_cached_pages_ships_from_kv_start(tiny_dir, reference):
    """send() after the prefill already ended HELD on shared pages: the push thread reads from kv_start."""
    pre, dec = make(tiny_dir, True), make(tiny_dir, True)
    pre.generate(BASE, GREEDY)
    dec.generate(BASE[:12], GREEDY)
    prompt = BASE + TAIL[4]
    rid, _ = prefill_held(pre, prompt, GREEDY)
    transport = FakeTransport()
    rx = KVReceiver(dec, ReceiverConfig())
    address = rx.serve(transport)
    tx = KVSender(pre, transport, SenderConfig(chunk_bytes=1024))
    desc = rx.reserve(len(prompt), GREEDY, token_ids=prompt)
    assert desc.kv_start == 12
    tx.send(rid, desc, address)
    got = decode_all(dec, [desc.request_id], drive(tx, rx))
    assert_greedy_equal([reference[6]], got)
    assert rx.status(desc.reservation_id).bytes == (len(prompt) - 12) * token_bytes(dec)
    close_all(tx, rx, transport, [pre, dec])
    assert_only_cache_left(pre, dec)


def test_the_receiver_refuses_chunks_below_kv_start_and_a_wrong_announced_start(tiny_dir):
    pre, dec = make(tiny_dir, False), make(tiny_dir, True)
    dec.generate(BASE, GREEDY)
    prompt = BASE + TAIL[4]
    transport = FakeTransport()
    rx = KVReceiver(dec, ReceiverConfig())
    rx.serve(transport)
    spec = dec.kv_spec
    layout = codec.TransferLayout.from_spec(spec, stored_token_head_bytes(spec))
    row = memoryview(bytes(layout.payload_bytes(1, layout.num_heads) // 2))

    desc = rx.reserve(len(prompt), GREEDY, token_ids=prompt)
    assert desc.kv_start == 28
    below = [codec.encode(codec.open_frame(desc, layout, prompt, spec.num_kv_heads)),
             codec.chunk_wire(layout, 0, 27, 28, row, row)]  # one token under the start
    with pytest.raises(InvalidFrame, match=r"tokens \[27, 28\) outside \[28, 36\)"):
        rx.handle_push(iter(below), None)
    assert rx.status(desc.reservation_id).state == TransferState.FAILED

    desc = rx.reserve(len(prompt), GREEDY, token_ids=prompt)
    from dataclasses import replace
    old_sender = codec.encode(codec.open_frame(replace(desc, kv_start=0), layout, prompt, spec.num_kv_heads))
    with pytest.raises(FailedPrecondition, match="from token 0"):  # a sender that would ship everything
        rx.handle_push(iter([old_sender]), None)
    rx.pump()
    assert dec.allocator.num_reservations == 0  # both failed: their shared pages went back to the cache
    close_all(None, rx, transport, [pre, dec])
    assert_only_cache_left(pre, dec)


def test_a_prompt_fully_held_by_the_decode_side_ships_no_chunk(tiny_dir, reference):
    pre, dec = make(tiny_dir, True), make(tiny_dir, True)
    dec.generate(BASE, GREEDY)
    got, descs, statuses, ends = ship(pre, dec, [BASE[:16]])
    assert_greedy_equal([reference[2]], got)
    assert descs[0].kv_start == 16 and statuses[0].chunks == 0 and statuses[0].bytes == 0
    close_all(*ends, [pre, dec])
    assert_only_cache_left(pre, dec)


def test_wire_frames_without_kv_start_still_parse_as_zero(tiny_dir):
    """Backward compatibility: an Open frame from a sender that predates the field reads as kv_start 0."""
    from kv_transfer import kv_transfer_pb2 as pb

    old = pb.Frame(open=pb.Open(request_id="r", reservation_id="x", nonce="n")).SerializeToString()
    assert codec.parse_frame(old).open.kv_start == 0
    assert wire([pb.Frame(open=pb.Open(kv_start=4))])[0] != old
