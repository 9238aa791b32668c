"""Bad KV transfer frames against the real gRPC receiver over loopback, each row a test (issue 8, section 3):
layout, dtype and shape mismatches, wrong byte counts, bad checksums, unknown, foreign or finished
reservations, replays, forged nonces, out-of-range token / head / layer ranges, absurd sizes, garbage and
out-of-order frames, out-of-vocabulary token ids. Tiny random Llama, float32, token auth on.

Each row pushes one victim transfer's frames, changed as the row says, and checks: the sender gets the typed
error of the row; the victim reservation either failed (the row broke its own stream) or was not touched
(the row only pretended to be it -- then the real frames still land and decode greedy-equal); afterwards
no page, reservation or transfer is left. One test sends every row while another transfer's stream is
held open mid-way, then finishes that one: it decodes greedy-equal (bad frames harm only their request).
"""
from __future__ import annotations

import threading
import time

import pytest

from engine import SamplingParams
from engine.llm import LLM
from kv_transfer import kv_transfer_pb2 as pb
from kv_transfer.config import ReceiverConfig, SenderConfig
from kv_transfer.contract import (Cancelled, DataLoss, FailedPrecondition, InvalidFrame, PermissionDenied,
                                  ResourceExhausted, TransferError, TransferState, Unauthenticated,
                                  UnknownReservation, make_transport)
from kv_transfer.receiver import KVReceiver
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.kv_helpers import close_all, decode_all, hand_frames, prefill_held, wire

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT, OTHER = list(range(10, 30)), [60, 61, 62, 63, 64, 65, 66]
TOKEN = "frames-token"
U32 = (1 << 32) - 1


@pytest.fixture(scope="module")
def rig(tiny_dir):
    d = tiny_dir
    alone = LLM(model=str(d), dtype="float32", num_pages=64)
    ref = [o.token_ids for o in alone.generate([PROMPT, OTHER], GREEDY)]
    pre = LLM(model=str(d), dtype="float32", num_pages=64, page_size=4, max_num_batched_tokens=32)
    dec = LLM(model=str(d), dtype="float32", num_pages=64, page_size=8)
    rx = KVReceiver(dec, ReceiverConfig(auth_token=TOKEN, max_chunk_bytes=4096))
    address = rx.serve(make_transport("grpc"))
    client = make_transport("grpc")
    yield pre, dec, rx, address, client, ref
    client.close()
    close_all(rx=rx, llms=[pre, dec])


def _push(rig, blobs, token=TOKEN):
    _, _, _, address, client, _ = rig
    return client.push(address, iter(blobs), SenderConfig(auth_token=token, chunk_bytes=1024))


def _victim(rig, prompt=PROMPT):
    pre, _, rx, *_ = rig
    desc = rx.reserve(len(prompt), GREEDY)
    rid, first = prefill_held(pre, prompt, GREEDY)
    frames = hand_frames(pre, rid, first, desc, chunk_bytes=1024)
    pre.release_held(rid)  # the frames carry the KV now
    return desc, frames


def _edit(frame, kind: str, **fields):
    f = pb.Frame.FromString(frame.SerializeToString())
    for k, v in fields.items():
        msg = getattr(f, kind)
        if isinstance(v, list):  # protobuf repeated fields are replaced, not assigned
            msg.ClearField(k)
            getattr(msg, k).extend(v)
        else:
            setattr(msg, k, v)
    return f


def _chunk(frames, i=1, **fields):
    return wire(frames[:i] + [_edit(frames[i], "chunk", **fields)] + frames[i + 1:])


def _open(frames, **fields):
    return wire([_edit(frames[0], "open", **fields)] + frames[1:])


def _finish(frames, **fields):
    return wire(frames[:-1] + [_edit(frames[-1], "finish", **fields)])


def _flip_payload(frames):
    f = pb.Frame.FromString(frames[1].SerializeToString())
    p = bytearray(f.chunk.payload)
    p[0] ^= 0x40
    f.chunk.payload = bytes(p)
    return wire(frames[:1] + [f] + frames[2:])


def _short_payload(frames):
    f = pb.Frame.FromString(frames[1].SerializeToString())
    f.chunk.payload = f.chunk.payload[:-8]
    return wire(frames[:1] + [f] + frames[2:])


# row: (blobs from (desc, frames), the sender's typed error, the victim's fate: "failed" | "untouched")
ROWS = {
    # layout / shape / dtype of the open frame
    "open dtype mismatch": (lambda d, f: _open(f, dtype="float16"), FailedPrecondition, "failed"),
    "open dtype not allow-listed": (lambda d, f: _open(f, dtype="object"), InvalidFrame, "failed"),
    "open storage not allow-listed": (lambda d, f: _open(f, storage_format="pickle"), InvalidFrame, "failed"),
    "open head_dim mismatch": (lambda d, f: _open(f, head_dim=999), FailedPrecondition, "failed"),
    "open absurd layer count": (lambda d, f: _open(f, num_layers=U32), FailedPrecondition, "failed"),
    "open KV heads mismatch": (lambda d, f: _open(f, num_kv_heads=7), FailedPrecondition, "failed"),
    "open other tp shard": (lambda d, f: _open(f, tp_rank=1, tp_size=2), FailedPrecondition, "failed"),
    "wrong model fingerprint": (lambda d, f: _open(f, model_fingerprint="f" * 16), FailedPrecondition, "failed"),
    "wrong layout signature": (lambda d, f: _open(f, layout_signature="0" * 16), FailedPrecondition, "failed"),
    "prompt longer than reserved": (lambda d, f: _open(f, prompt_token_ids=PROMPT + [5]), InvalidFrame, "failed"),
    # chunks: dtype, counts, sizes, checksums
    "chunk dtype mismatch": (lambda d, f: _chunk(f, dtype="float16"), InvalidFrame, "failed"),
    "chunk storage mismatch": (lambda d, f: _chunk(f, storage_format="int8"), InvalidFrame, "failed"),
    "chunk byte_length off by 2": (lambda d, f: _chunk(f, byte_length=f[1].chunk.byte_length + 2), InvalidFrame,
                                   "failed"),
    "payload shorter than its header": (lambda d, f: _short_payload(f), DataLoss, "failed"),
    "bad checksum": (lambda d, f: _chunk(f, checksum=f[1].chunk.checksum ^ 1), DataLoss, "failed"),
    "payload bit flipped": (lambda d, f: _flip_payload(f), DataLoss, "failed"),
    "absurd byte_length": (lambda d, f: _chunk(f, byte_length=1 << 60), ResourceExhausted, "failed"),
    # ranges
    "token range past the prompt": (lambda d, f: _chunk(f, token_end=len(PROMPT) + 4), InvalidFrame, "failed"),
    "empty token range": (lambda d, f: _chunk(f, token_end=f[1].chunk.token_start), InvalidFrame, "failed"),
    "absurd token range": (lambda d, f: _chunk(f, token_start=U32 - 1, token_end=U32), InvalidFrame, "failed"),
    "head range past the shard": (lambda d, f: _chunk(f, head_end=99), InvalidFrame, "failed"),
    "inverted head range": (lambda d, f: _chunk(f, head_start=1, head_end=0), InvalidFrame, "failed"),
    "layer out of range": (lambda d, f: _chunk(f, layer=99), InvalidFrame, "failed"),
    "chunk from another tp rank": (lambda d, f: _chunk(f, tp_rank=1, tp_size=2), InvalidFrame, "failed"),
    # stream structure
    "finish counts too many chunks": (lambda d, f: _finish(f, num_chunks=f[-1].finish.num_chunks + 1), DataLoss,
                                      "failed"),
    "finish before all KV": (lambda d, f: wire(f[:1] + f[2:]), FailedPrecondition, "failed"),
    "finish kept slots past the prompt": (lambda d, f: _finish(f, num_slots=len(PROMPT) + 9), InvalidFrame,
                                          "failed"),
    "stream ends without finish": (lambda d, f: wire(f[:-1]), Cancelled, "failed"),
    "second open frame": (lambda d, f: wire(f[:2] + f[:1] + f[2:]), InvalidFrame, "failed"),
    "garbage after the open": (lambda d, f: wire(f[:1]) + [b"\xff\x00garbage"] + wire(f[1:]), InvalidFrame,
                               "failed"),
    # frames that only pretend to be the victim's: it must not notice
    "chunk before any open": (lambda d, f: wire(f[1:]), InvalidFrame, "untouched"),
    "garbage first frame": (lambda d, f: [b"\x0a\xff\xff\xff\xff\x0f"] + wire(f[1:]), InvalidFrame, "untouched"),
    "unknown reservation": (lambda d, f: _open(f, reservation_id="0" * 16), UnknownReservation, "untouched"),
    "forged nonce": (lambda d, f: _open(f, nonce="1" * len(d.nonce)), PermissionDenied, "untouched"),
    "empty nonce": (lambda d, f: _open(f, nonce=""), PermissionDenied, "untouched"),
    "another request's id": (lambda d, f: _open(f, request_id="someone-else"), PermissionDenied, "untouched"),
}


def _settle(rx, desc, fate: str, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    if fate == "failed":
        while rx.status(desc.reservation_id).state != TransferState.FAILED:
            assert time.monotonic() < end, rx.status(desc.reservation_id)
            time.sleep(0.01)
    else:
        assert rx.status(desc.reservation_id).state == TransferState.PENDING


def _land(rig, desc, frames) -> list[int]:
    """Push the real frames, commit, decode to the end: the victim's tokens."""
    _, dec, rx, *_ = rig
    assert _push(rig, wire(frames)).state == "done"
    assert rx.pump() == [desc.request_id]
    return decode_all(dec, [desc.request_id], [])[0]


def _assert_empty(rig) -> None:
    pre, dec, rx, *_ = rig
    rx.pump()
    assert rx.num_live == 0, "a transfer is still live on the receiver"
    for llm in (pre, dec):
        assert_engine_empty(llm)


@pytest.mark.parametrize("name", list(ROWS))
def test_bad_frames_row(rig, name):
    make, error, fate = ROWS[name]
    _, _, rx, *_ = rig
    desc, frames = _victim(rig)
    with pytest.raises(error):
        _push(rig, make(desc, frames))
    _settle(rx, desc, fate)
    if fate == "failed":
        rx.pump()
        assert rx.status(desc.reservation_id).state == TransferState.FAILED
        with pytest.raises(FailedPrecondition, match="already ended"):  # late real frames cannot land
            _push(rig, wire(frames))
    else:
        assert_greedy_equal([rig[5][0]], [_land(rig, desc, frames)])
    _assert_empty(rig)


def test_bad_token_and_missing_token_leave_the_owner_alone(rig):
    _, _, rx, *_ = rig
    desc, frames = _victim(rig)
    for token in ("wrong-token", ""):
        with pytest.raises(Unauthenticated):
            _push(rig, wire(frames), token=token)
    _settle(rx, desc, "untouched")
    assert_greedy_equal([rig[5][0]], [_land(rig, desc, frames)])
    _assert_empty(rig)


def test_replay_and_push_to_a_finished_reservation(rig):
    _, _, rx, *_ = rig
    desc, frames = _victim(rig)
    assert _push(rig, wire(frames)).state == "done"
    with pytest.raises(FailedPrecondition, match="already finished"):  # replay before the commit
        _push(rig, wire(frames))
    assert rx.pump() == [desc.request_id]  # the replay did not spoil the transfer
    with pytest.raises(FailedPrecondition, match="already ended"):  # replay after it: a finished reservation
        _push(rig, wire(frames))
    assert_greedy_equal([rig[5][0]], decode_all(rig[1], [desc.request_id], []))
    _assert_empty(rig)


@pytest.mark.parametrize("where", ["prompt", "first token"])
def test_out_of_vocab_token_ids_are_refused_at_commit(rig, where):
    _, _, rx, *_ = rig
    desc, frames = _victim(rig)
    blobs = _open(frames, prompt_token_ids=[10**9] + PROMPT[1:]) if where == "prompt" else \
        _finish(frames, first_token_id=-1)
    assert _push(rig, blobs).state == "done"  # the bytes were fine; the ids are the engine's to judge
    assert rx.pump() == []
    status = rx.status(desc.reservation_id)
    assert status.state == TransferState.FAILED and "commit refused" in status.reason, status
    _assert_empty(rig)


def test_every_row_while_another_stream_is_open_leaves_it_unharmed(rig):
    _, dec, rx, *_ = rig
    desc, frames = _victim(rig, OTHER)
    held, outcome = threading.Event(), {}

    def bystander():
        def gen():
            yield from wire(frames[:2])
            held.wait(60)  # mid-stream while every bad row is tried
            yield from wire(frames[2:])
        try:
            outcome["result"] = _push(rig, gen())
        except TransferError as e:
            outcome["error"] = e

    t = threading.Thread(target=bystander)
    t.start()
    for name, (make, error, fate) in ROWS.items():
        d, f = _victim(rig)
        with pytest.raises(error):
            _push(rig, make(d, f))
        if fate == "untouched":
            rx.cancel(d.reservation_id, "row done")
        _settle(rx, d, "failed")
        rx.pump()
    assert rx.status(desc.reservation_id).state == TransferState.TRANSFERRING
    held.set()
    t.join(60)
    assert outcome.get("result") is not None and outcome["result"].state == "done", outcome
    assert rx.pump() == [desc.request_id]
    assert_greedy_equal([rig[5][1]], decode_all(dec, [desc.request_id], []))
    _assert_empty(rig)
