"""Failure semantics of the KV plane (fake transport, fake clock, no sleeps on deadlines or leases).

Every transfer ends exactly once, done or failed(reason). Expired or finished reservations free their pages
and late chunks for them are rejected and never written; a duplicated chunk is idempotent; an unknown
reservation is NOT_FOUND, a bad token UNAUTHENTICATED, oversize RESOURCE_EXHAUSTED; corruption fails that
transfer only. Each test ends with zero pages and reservations on both engines.
"""
from __future__ import annotations

import dataclasses
import time

import pytest

from engine.kv_cache.page_io import slot_runs

from engine import SamplingParams
from engine.llm import LLM
from kv_transfer.config import ReceiverConfig, SenderConfig
from kv_transfer.contract import (Cancelled, DataLoss, ErrorCode, FailedPrecondition, PermissionDenied,
                                  TransferState, Unauthenticated, Unavailable, UnknownReservation)
from kv_transfer.fake_transport import FakeTransport
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from tests.exactness import assert_greedy_equal
from tests.kv_helpers import Ends, FakeClock, close_all, decode_all, drive, hand_frames, prefill_held, wire


def wire_stream(frames):
    for f in frames:
        yield f.SerializeToString()

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = list(range(10, 50))  # 40 tokens


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return LLM(model=str(tiny_dir), dtype="float32", num_pages=64, page_size=4).generate(PROMPT, GREEDY)[0].token_ids


class Side:
    """A prefill engine, a decode engine with a receiver on a fake transport, and end observers."""

    def __init__(self, tiny_dir, rx_config=None, fault=None, clock=None):
        self.clock = clock or FakeClock()
        self.pre = LLM(model=str(tiny_dir), dtype="float32", num_pages=64, page_size=4, max_num_batched_tokens=16)
        self.dec = LLM(model=str(tiny_dir), dtype="float32", num_pages=64, page_size=8, clock=self.clock)
        self.transport = FakeTransport(fault)
        self.rx_ends, self.tx_ends = Ends(), Ends()
        self.rx = KVReceiver(self.dec, rx_config or ReceiverConfig(), on_end=self.rx_ends)
        self.address = self.rx.serve(self.transport)
        self.tx = None
        self.pages: dict[str, list[int]] = {}  # reservation id -> its pages (to check nothing was written)

    def sender(self, config=None, clock=None) -> KVSender:
        self.tx = KVSender(self.pre, self.transport, config or SenderConfig(chunk_bytes=1024), clock=clock,
                           on_end=self.tx_ends)
        return self.tx

    def held(self, desc):
        """Prefill PROMPT to HELD and build its frames by hand: (request id, frames)."""
        rid, first = prefill_held(self.pre, PROMPT, GREEDY)
        return rid, hand_frames(self.pre, rid, first, desc)

    def reserve(self, lease_s=30.0):
        desc = self.rx.reserve(len(PROMPT), GREEDY, lease_s=lease_s)
        self.pages[desc.reservation_id] = list(self.rx._live[desc.reservation_id].pages)
        return desc

    def written(self, desc, frame) -> bool:
        """Whether any cell of `frame`'s chunk is non-zero in the reservation's pages."""
        c = frame.chunk
        runs = slot_runs(self.pages[desc.reservation_id], self.dec.kv_spec.page_size, c.token_start, c.token_end)
        flat = self.dec.backend.k[c.layer].view(-1, self.dec.kv_spec.num_kv_heads, self.dec.kv_spec.head_dim)
        return any(bool(flat[f:f + n].any()) for f, _, n in runs)

    def close(self):
        if self.pre.scheduler.held:
            for rid in list(self.pre.scheduler.held):
                self.pre.release_held(rid)
        close_all(self.tx, self.rx, self.transport, [self.pre, self.dec])


def test_expired_lease_frees_pages_and_late_chunks_are_never_written(tiny_dir):
    s = Side(tiny_dir)
    desc = s.reserve(lease_s=5.0)
    _, frames = s.held(desc)

    def stream():  # open and one chunk in time; then the lease lapses; then another chunk
        yield from frames[:2]
        s.clock.t += 5.0
        yield frames[2]

    with pytest.raises(FailedPrecondition, match="expired"):
        s.rx.handle_push(wire_stream(stream()), None)
    st = s.rx.status(desc.reservation_id)
    assert st.state == TransferState.FAILED and st.reason == "reservation expired" and st.chunks == 1
    assert s.written(desc, frames[1]) and not s.written(desc, frames[2]), "the late chunk was written"
    s.rx.pump()
    assert s.dec.kv_usage()["pages_in_use"] == 0 and s.dec.kv_usage()["reservations"] == 0
    with pytest.raises(FailedPrecondition, match="already ended: failed"):
        s.rx.handle_push(wire(frames), None)  # a late stream for it
    s.rx_ends.assert_each_once([desc.reservation_id])
    s.close()


def test_lease_lapsing_after_the_push_but_before_the_commit_fails_and_frees(tiny_dir):
    s = Side(tiny_dir)
    desc = s.reserve(lease_s=5.0)
    _, frames = s.held(desc)
    assert s.rx.handle_push(wire(frames), None).state == "done"  # every chunk in the pinned pages
    s.clock.t += 5.0
    s.dec.step()  # the engine's own step expires the lease before the receiver commits
    assert s.dec.kv_usage()["pages_in_use"] > 0  # still pinned by the receiver: nobody else got them
    assert s.rx.pump() == [] and not s.dec.has_unfinished()
    st = s.rx.status(desc.reservation_id)
    assert st.state == TransferState.FAILED and "expired" in st.reason
    assert s.dec.kv_usage()["pages_in_use"] == 0
    s.rx_ends.assert_each_once([desc.reservation_id])
    s.close()


def test_finished_reservation_rejects_late_chunks_and_decoding_is_unaffected(tiny_dir, reference):
    s = Side(tiny_dir)
    desc = s.reserve()
    rid, frames = s.held(desc)
    assert s.rx.handle_push(wire(frames), None).state == "done"
    assert s.rx.pump() == [desc.request_id]
    assert s.rx.status(desc.reservation_id).state == TransferState.DONE
    with pytest.raises(FailedPrecondition, match="already ended: done"):
        s.rx.handle_push(wire(frames), None)  # the same stream again, after the commit
    s.pre.release_held(rid)
    got = decode_all(s.dec, [desc.request_id], [])
    assert_greedy_equal([reference], got)
    s.rx_ends.assert_each_once([desc.reservation_id])
    s.close()


def test_duplicated_chunks_are_idempotent(tiny_dir, reference):
    def twice(i, frame):
        return [frame, frame] if frame.WhichOneof("kind") == "chunk" else [frame]

    s = Side(tiny_dir, fault=twice)
    tx = s.sender()
    desc = s.reserve()
    tx.send(s.pre.add_request(PROMPT, GREEDY, prefill_only=True), desc, s.address)
    got = decode_all(s.dec, [desc.request_id], drive(tx, s.rx))
    st = s.rx.status(desc.reservation_id)
    assert st.state == TransferState.DONE and st.duplicates == st.chunks > 0
    assert_greedy_equal([reference], got)
    s.close()


def test_unknown_reservation_is_not_found_and_the_prefill_is_aborted(tiny_dir):
    s = Side(tiny_dir)
    tx = s.sender()
    desc = s.reserve()
    bogus = dataclasses.replace(desc, reservation_id="feedfacefeedface")
    rid = s.pre.add_request(PROMPT, GREEDY, prefill_only=True)
    tx.send(rid, bogus, s.address)
    drive(tx, _Idle())  # only the sender has work
    st = tx.status(rid)
    assert st.state == TransferState.FAILED and st.code == ErrorCode.NOT_FOUND, st
    assert s.pre.kv_usage()["pages_in_use"] == 0 and not s.pre.has_unfinished()
    rid2, frames = s.held(bogus)
    with pytest.raises(UnknownReservation):
        s.rx.handle_push(wire(frames), None)
    s.pre.release_held(rid2)
    assert s.rx.status(desc.reservation_id).state == TransferState.PENDING  # the real one is untouched
    s.rx.cancel(desc.reservation_id)
    s.tx_ends.assert_each_once([rid])
    s.close()


class _Idle:
    """Stands in for a receiver when only the sender has work."""
    num_live = 0

    def step(self):
        return []

    def wait_for_work(self, timeout_s):
        time.sleep(min(timeout_s, 0.0005))


def test_bad_token_is_unauthenticated_and_leaves_the_transfer_alone(tiny_dir, reference):
    s = Side(tiny_dir, rx_config=ReceiverConfig(auth_token="s3cret"))
    desc = s.reserve()
    rid, frames = s.held(desc)
    for token in (None, "", "s3cre", "s3cret!", "S3CRET"):
        with pytest.raises(Unauthenticated):
            s.rx.handle_push(wire(frames), token)
    assert s.rx.status(desc.reservation_id).state == TransferState.PENDING
    tx = s.sender(SenderConfig(chunk_bytes=1024, auth_token="wrong"))
    rid2 = s.pre.add_request(PROMPT, GREEDY, prefill_only=True)
    tx.send(rid2, desc, s.address)
    drive(tx, _Idle())
    assert tx.status(rid2).code == ErrorCode.UNAUTHENTICATED
    assert s.rx.handle_push(wire(frames), "s3cret").state == "done"  # the right token still gets in
    s.rx.pump()
    s.pre.release_held(rid)
    assert_greedy_equal([reference], decode_all(s.dec, [desc.request_id], []))
    s.close()


@pytest.mark.parametrize("case", ["chunk over cap", "message over cap", "stream over budget"])
def test_oversize_is_resource_exhausted_and_fails_the_transfer(tiny_dir, case):
    rx_config = {"chunk over cap": ReceiverConfig(max_chunk_bytes=1024),
                 "message over cap": ReceiverConfig(max_chunk_bytes=1024, max_message_bytes=2048),
                 "stream over budget": ReceiverConfig(max_chunk_bytes=1024, stream_bytes_factor=1.0)}[case]

    def fault(i, frame):  # every chunk four times: within the cells, over the byte budget
        return [frame] * 4 if frame.WhichOneof("kind") == "chunk" else [frame]

    fault = fault if case == "stream over budget" else None
    s = Side(tiny_dir, rx_config=rx_config, fault=fault)
    chunk = 1024 if case == "stream over budget" else 4096
    tx = s.sender(SenderConfig(chunk_bytes=chunk))
    desc = s.reserve()
    rid = s.pre.add_request(PROMPT, GREEDY, prefill_only=True)
    tx.send(rid, desc, s.address)
    drive(tx, s.rx)
    assert tx.status(rid).code == ErrorCode.RESOURCE_EXHAUSTED, tx.status(rid)
    st = s.rx.status(desc.reservation_id)
    assert st.state == TransferState.FAILED
    assert s.dec.kv_usage()["pages_in_use"] == 0
    s.close()


def test_corruption_fails_that_transfer_only(tiny_dir, reference):
    s = Side(tiny_dir)
    bad, good = s.reserve(), s.reserve()
    rid_bad, frames = s.held(bad)
    payload = bytearray(frames[3].chunk.payload)
    payload[5] ^= 0x40  # one flipped bit in one chunk
    frames[3].chunk.payload = bytes(payload)
    tx = s.sender()
    tx.send(s.pre.add_request(PROMPT, GREEDY, prefill_only=True), good, s.address)
    with pytest.raises(DataLoss, match="checksum"):
        s.rx.handle_push(wire(frames), None)
    got = decode_all(s.dec, [good.request_id], drive(tx, s.rx))
    assert s.rx.status(bad.reservation_id).state == TransferState.FAILED
    assert s.rx.status(bad.reservation_id).code == ErrorCode.DATA_LOSS
    assert s.rx.status(good.reservation_id).state == TransferState.DONE
    assert_greedy_equal([reference], got)
    s.pre.release_held(rid_bad)
    s.rx_ends.assert_each_once([bad.reservation_id, good.reservation_id])
    s.close()


def test_wrong_nonce_is_denied_without_harming_the_owner(tiny_dir):
    s = Side(tiny_dir)
    desc = s.reserve()
    rid, frames = s.held(desc)
    frames[0].open.nonce = "0" * 32
    with pytest.raises(PermissionDenied):
        s.rx.handle_push(wire(frames), None)
    assert s.rx.status(desc.reservation_id).state == TransferState.PENDING
    frames[0].open.nonce = desc.nonce
    frames[0].open.model_fingerprint = "another-model"
    with pytest.raises(FailedPrecondition, match="fingerprint"):  # the owner with the wrong model: fatal
        s.rx.handle_push(wire(frames), None)
    assert s.rx.status(desc.reservation_id).state == TransferState.FAILED
    s.pre.release_held(rid)
    s.close()


def test_sender_refuses_a_descriptor_for_another_model_or_length(tiny_dir):
    s = Side(tiny_dir)
    tx = s.sender()
    desc = s.reserve()
    rid = s.pre.add_request(PROMPT, GREEDY, prefill_only=True)
    with pytest.raises(FailedPrecondition, match="descriptor"):
        tx.send(rid, dataclasses.replace(desc, layout_signature="0" * 16), s.address)
    with pytest.raises(Exception, match="prompt has 40"):
        tx.send(rid, dataclasses.replace(desc, num_tokens=41), s.address)
    s.pre.abort(rid)
    s.rx.cancel(desc.reservation_id)
    assert s.rx.status(desc.reservation_id).code == ErrorCode.CANCELLED
    s.close()


def test_stream_ending_before_finish_fails_the_transfer(tiny_dir):
    s = Side(tiny_dir)
    desc = s.reserve()
    rid, frames = s.held(desc)
    with pytest.raises(Cancelled, match="before its finish"):
        s.rx.handle_push(wire(frames[:-1]), None)
    desc2 = s.reserve()
    opened = frames[0].open
    opened.reservation_id, opened.nonce, opened.request_id = desc2.reservation_id, desc2.nonce, desc2.request_id
    missing = frames[:3] + [frames[-1]]  # open, two chunks, finish
    with pytest.raises(FailedPrecondition, match="finish before all KV arrived"):
        s.rx.handle_push(wire(missing), None)
    s.rx.pump()
    assert s.rx.status(desc.reservation_id).state == s.rx.status(desc2.reservation_id).state == TransferState.FAILED
    s.pre.release_held(rid)
    s.close()


def test_sender_deadline_on_its_clock_fails_and_frees_both_sides(tiny_dir):
    s = Side(tiny_dir)
    clock = FakeClock()
    tx = s.sender(SenderConfig(chunk_bytes=1024, deadline_s=2.0), clock=clock)
    desc = s.reserve()
    rid = s.pre.add_request(PROMPT, GREEDY, prefill_only=True)
    tx.send(rid, desc, s.address)
    tx.step()  # one prefill chunk of 16 tokens
    clock.t += 2.0
    tx.poll()
    st = tx.status(rid)
    assert st.state == TransferState.FAILED and st.code == ErrorCode.DEADLINE_EXCEEDED
    drive(tx, s.rx)  # settles once the push thread let go
    assert not s.pre.has_unfinished() and s.pre.kv_usage()["pages_in_use"] == 0  # the prefill was aborted
    assert s.rx.status(desc.reservation_id).state == TransferState.FAILED  # its stream ended without finish
    s.tx_ends.assert_each_once([rid])
    s.rx_ends.assert_each_once([desc.reservation_id])
    s.close()


def test_aborted_prefill_ends_the_transfer_on_both_sides(tiny_dir):
    s = Side(tiny_dir)
    tx = s.sender()
    desc = s.reserve()
    rid = s.pre.add_request(PROMPT, GREEDY, prefill_only=True)
    tx.send(rid, desc, s.address)
    tx.step()
    s.pre.abort(rid)
    drive(tx, s.rx)
    assert "ended without its KV" in tx.status(rid).reason
    assert s.rx.status(desc.reservation_id).state == TransferState.FAILED
    s.tx_ends.assert_each_once([rid])
    s.rx_ends.assert_each_once([desc.reservation_id])
    s.close()


def test_receiver_close_fails_live_transfers_once(tiny_dir):
    s = Side(tiny_dir)
    descs = [s.reserve() for _ in range(3)]
    s.rx.close()
    assert all(s.rx.status(d.reservation_id).reason == "receiver closed" for d in descs)
    with pytest.raises(Unavailable):  # no server any more
        s.transport.push(s.address, iter([]), SenderConfig())
    s.rx_ends.assert_each_once([d.reservation_id for d in descs])
    s.close()


def test_a_second_stream_after_completion_cannot_finish_it_again(tiny_dir, reference):
    s = Side(tiny_dir)
    desc = s.reserve()
    rid, frames = s.held(desc)
    assert s.rx.handle_push(wire(frames), None).state == "done"
    with pytest.raises(FailedPrecondition, match="already finished"):  # duplicates, then a second finish
        s.rx.handle_push(wire(frames), None)
    st = s.rx.status(desc.reservation_id)
    assert st.state == TransferState.TRANSFERRING and st.duplicates == len(frames) - 2
    assert s.rx.pump() == [desc.request_id]
    s.pre.release_held(rid)
    assert_greedy_equal([reference], decode_all(s.dec, [desc.request_id], []))
    s.rx_ends.assert_each_once([desc.reservation_id])
    s.close()
