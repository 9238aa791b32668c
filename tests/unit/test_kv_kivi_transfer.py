"""kivi4 between a prefill and a decode engine (the real `KVSender`/`KVReceiver` over the in-process fake
transport), for prompts that end on a page boundary and inside a page (engine/kv_cache/kivi.py, "Transfer"):
whole pages ship as stored -- the decode side's cells equal the cells a colocated engine computed, byte for
byte --, the tail of a prompt ending inside a page is recomputed on the decode side in its first step, and
the output equals one engine's. Every test ends with no page, reservation, transfer or staging row held."""
from __future__ import annotations

import time

import pytest
import torch

from engine import SamplingParams
from engine.errors import InvalidRequestError
from engine.kv_cache.page_io import export_kv
from engine.llm import LLM
from kv_transfer import codec
from kv_transfer.config import ReceiverConfig, SenderConfig
from kv_transfer.contract import InvalidFrame, TransferState
from kv_transfer.fake_transport import FakeTransport
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from tests.exactness import assert_greedy_equal
from tests.kv_helpers import close_all, decode_all, drive, prefill_held, ship_all, wire

PS = 4
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LENGTHS = [3, 8, 11, 13, 24]  # < one page (nothing ships), aligned, tails of 3 and 1, aligned


def make(tiny_dir, **kw):
    return LLM(model=str(tiny_dir), dtype="float32", num_pages=kw.pop("num_pages", 64), page_size=PS,
               kv_storage="kivi4", **kw)


def prompt_of(n: int) -> list[int]:
    return [(7 * i + 3) % 250 + 2 for i in range(n)]


@pytest.mark.parametrize("proposer", [None, "oracle", "always_wrong"])
def test_shipped_equals_local_for_prompts_on_and_off_page_boundaries(tiny_dir, proposer):
    """Also with draft-verify on the decode side: the tail chunk runs as a plain step, then verify steps
    (all drafts accepted, or all rolled back into pages) give the plain tokens."""
    prompts = [prompt_of(n) for n in LENGTHS]
    local_llm = make(tiny_dir)
    local = [o.token_ids for o in local_llm.generate(prompts, GREEDY)]
    spec = None if proposer is None else {"proposer": proposer, "max_draft": 3, "gate": False, "proposer_options":
                                          {"futures": {tuple(p): o for p, o in zip(prompts, local)}}}
    pre, dec = make(tiny_dir, max_num_batched_tokens=7), make(tiny_dir, speculative=spec)  # chunks end in pages
    got, descs, (tx, rx, transport) = ship_all(pre, dec, prompts, GREEDY)
    assert_greedy_equal(local, got)
    for d, n in zip(descs, LENGTHS):  # only whole pages crossed the wire
        st = rx.status(d.reservation_id)
        assert st.state == TransferState.DONE and st.bytes == rx.layout.transfer_bytes(n - n % PS), (n, st)
    if proposer is not None:
        st = dec.spec.stats
        assert st.num_drafted > 0 and st.num_accepted == (st.num_drafted if proposer == "oracle" else 0), st
    close_all(tx, rx, transport, [pre, dec, local_llm])
    assert pre.backend.num_staged == dec.backend.num_staged == local_llm.backend.num_staged == 0


@pytest.mark.parametrize("n", [3, 8, 11])
def test_received_cells_equal_the_colocated_engines_and_the_tail_is_recomputed(tiny_dir, n):
    """Step by step: after commit the decode side's whole pages hold exactly the colocated engine's cells;
    its first step computes the tail and the first token's KV (what the colocated engine computed in its
    last prefill chunk and first decode step) and samples the same second token."""
    prompt, sealed = prompt_of(n), n - n % PS
    ref = make(tiny_dir, max_num_batched_tokens=7)  # the prefill engine's chunking: the same shapes
    ref.add_request(prompt, GREEDY, request_id="ref")
    while ref.requests["ref"].num_output < 2:
        ref.step()
    pre, dec, transport = make(tiny_dir, max_num_batched_tokens=7), make(tiny_dir), FakeTransport()
    rx = KVReceiver(dec, ReceiverConfig())
    address = rx.serve(transport)
    tx = KVSender(pre, transport, SenderConfig(chunk_bytes=1024))
    desc = rx.reserve(n, GREEDY)
    tx.send(pre.add_request(prompt, GREEDY, prefill_only=True), desc, address)
    joined, end = [], time.monotonic() + 30
    while not joined:
        if pre.has_unfinished():
            tx.step()
        else:
            tx.poll()
            rx.wait_for_work(0.002)
        joined += rx.pump()
        assert time.monotonic() < end, "the transfer did not commit"
    rid = joined[0]
    pages, ref_pages = dec.tables.get(rid).pages, ref.tables.get("ref").pages
    assert dec.tables.get(rid).num_slots == dec.requests[rid].num_computed == sealed
    for layer in dec.kv_spec.local_layers:
        got, want = export_kv(dec.backend, layer, pages, 0, sealed), export_kv(ref.backend, layer, ref_pages, 0, sealed)
        assert bytes(got[0]) == bytes(want[0]) and bytes(got[1]) == bytes(want[1]), layer
    dec.step()  # the tail and the first token, one chunk; samples the second token
    assert dec.requests[rid].token_ids == ref.requests["ref"].token_ids
    slots = torch.tensor(dec.tables.slots(rid, 0, n + 1))
    ref_slots = torch.tensor(ref.tables.slots("ref", 0, n + 1))
    for layer in dec.kv_spec.local_layers:
        (k, v), (rk, rv) = dec.backend.read(layer, slots), ref.backend.read(layer, ref_slots)
        assert torch.equal(k[:sealed], rk[:sealed]) and torch.equal(v[:sealed], rv[:sealed])
        torch.testing.assert_close(k[sealed:], rk[sealed:], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v[sealed:], rv[sealed:], rtol=1e-5, atol=1e-5)
    dec.abort(rid)
    ref.abort("ref")
    close_all(tx, rx, transport, [pre, dec, ref])
    assert pre.backend.num_staged == dec.backend.num_staged == ref.backend.num_staged == 0


def test_a_chunk_past_the_whole_pages_is_refused(tiny_dir):
    """A kivi4 reservation takes whole pages only: a chunk reaching into the tail page (which would be
    marked sealed over cells nobody quantized) is refused, typed, and the transfer's pages freed."""
    pre, dec, transport = make(tiny_dir), make(tiny_dir), FakeTransport()
    rx = KVReceiver(dec, ReceiverConfig())
    rx.serve(transport)
    prompt = prompt_of(8)
    rid, _ = prefill_held(pre, prompt, GREEDY)
    desc = rx.reserve(7, GREEDY)  # 7 tokens: only the first page (4 tokens) ships
    pages, _ = pre.held_pages(rid)
    k, v = export_kv(pre.backend, 0, pages, 0, 7)  # (sealed on this side: its prompt filled both pages)
    frames = [codec.open_frame(desc, rx.layout, prompt[:7], pre.kv_spec.num_kv_heads),
              codec.parse_frame(codec.chunk_wire(rx.layout, 0, 0, 7, k, v))]
    with pytest.raises(InvalidFrame, match="whole kivi4 pages"):
        rx.handle_push(iter(wire(frames)), None)
    rx.pump()
    assert rx.status(desc.reservation_id).state == TransferState.FAILED
    pre.release_held(rid)
    close_all(None, rx, transport, [pre, dec])
    assert pre.backend.num_staged == dec.backend.num_staged == 0


def test_num_computed_is_checked(tiny_dir):
    dec = make(tiny_dir)
    res = dec.reserve(8)
    with pytest.raises(InvalidRequestError, match="num_computed"):
        dec.add_prefilled_request(prompt_of(8), 5, res.reservation_id, GREEDY, num_computed=9)
    dec.allocator.cancel(res.reservation_id, "test")
    close_all(llms=[dec])


def test_decode_side_prefix_cache_shares_whole_pages_and_the_tail_is_still_recomputed(tiny_dir):
    """The second time a prompt comes, the decode side's cached pages cover its whole pages (kv_start =
    whole pages): nothing but the finish crosses the wire, and the tail is recomputed as before."""
    prompt = prompt_of(13)  # 3 whole pages + 1
    local_llm = make(tiny_dir)
    want = [o.token_ids for o in local_llm.generate([prompt, prompt], GREEDY)]
    pre, dec, transport = make(tiny_dir), make(tiny_dir, enable_prefix_caching=True), FakeTransport()
    rx = KVReceiver(dec, ReceiverConfig())
    address = rx.serve(transport)
    tx = KVSender(pre, transport, SenderConfig(chunk_bytes=1024))
    got = []
    for _ in range(2):
        desc = rx.reserve(len(prompt), GREEDY, token_ids=prompt)
        tx.send(pre.add_request(prompt, GREEDY, prefill_only=True), desc, address)
        got += decode_all(dec, [desc.request_id], drive(tx, rx))
    assert desc.kv_start == 12 and rx.status(desc.reservation_id).bytes == 0
    assert_greedy_equal(want, got)
    dec.reset_prefix_cache()
    close_all(tx, rx, transport, [pre, dec, local_llm])
    assert pre.backend.num_staged == dec.backend.num_staged == 0
