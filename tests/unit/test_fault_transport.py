"""`kv_transfer.fault_transport.FaultyTransport` over the in-process fake transport: each fault of the plan
does what it says to chunk frames (never to open / finish frames), the same seed gives the same faults, a
copy carries only the plan (a fresh inner transport and RNG), and a bad plan is a typed error."""
from __future__ import annotations

import copy

import pytest

from kv_transfer import codec
from kv_transfer import kv_transfer_pb2 as pb
from kv_transfer.config import ReceiverConfig, SenderConfig
from kv_transfer.contract import PushResult, TransferConfigError
from kv_transfer.fault_transport import FaultyTransport


class Sink:
    """Records what arrives (parsed frames)."""

    def __init__(self):
        self.frames = []

    def handle_push(self, frames, token):
        self.frames = [codec.parse_frame(bytes(f)) for f in frames]
        return PushResult("done", "", 0, 0, 0)


def stream(n_chunks: int = 20, request_id: str = "") -> list[bytes]:
    chunks = [pb.Frame(chunk=pb.Chunk(layer=i, payload=bytes([i + 1]) * 8, byte_length=8)) for i in range(n_chunks)]
    frames = [pb.Frame(open=pb.Open(request_id=request_id, reservation_id="r"))] + chunks + [pb.Frame(finish=pb.Finish(num_chunks=20))]
    return [f.SerializeToString() for f in frames]


def push(plan: dict, request_id: str = "", t: FaultyTransport | None = None) -> tuple[list, FaultyTransport]:
    t, sink = t or FaultyTransport(plan, inner="fake"), Sink()
    address = t.serve(sink, ReceiverConfig()).address
    t.push(address, iter(stream(request_id=request_id)), SenderConfig())
    return sink.frames, t


def kinds(frames) -> list[str]:
    return [f.WhichOneof("kind") for f in frames]


def test_each_fault_touches_only_chunks():
    frames, t = push({"drop": 1.0})
    assert kinds(frames) == ["open", "finish"] and t.injected["drop"] == 20
    frames, _ = push({"corrupt": 1.0})
    assert all(f.chunk.payload == bytes(8) for f in frames[1:-1]) and len(frames) == 22
    frames, _ = push({"duplicate": 1.0})
    assert kinds(frames) == ["open"] + ["chunk"] * 40 + ["finish"]
    assert [f.chunk.layer for f in frames[1:5]] == [0, 0, 1, 1]
    frames, t = push({"delay": 1.0, "delay_s": 0.001})
    assert len(frames) == 22 and t.injected["delay"] == 20
    frames, t = push({})
    assert [f.SerializeToString() for f in frames] == stream() and not t.injected


def test_same_seed_same_faults_and_a_copy_carries_only_the_plan():
    plan = {"seed": 3, "drop": 0.2, "corrupt": 0.2, "duplicate": 0.2}
    a, ta = push(plan)
    b, tb = push(plan)
    assert [f.SerializeToString() for f in a] == [f.SerializeToString() for f in b] and ta.injected == tb.injected
    assert sum(ta.injected.values()) > 0
    twin = copy.deepcopy(ta)  # what crossing to a Ray actor keeps
    assert twin.plan == plan and twin._inner is None and not twin.injected


def test_an_aimed_fault_hits_one_chunk_of_its_request_s_first_transfer_only():
    plan = {"requests": {"a": "drop", "b": "corrupt"}, "at_chunk": 3}
    frames, t = push(plan, "a#1")
    assert kinds(frames) == ["open"] + ["chunk"] * 19 + ["finish"] and 3 not in [f.chunk.layer for f in frames]
    frames, t = push(plan, "a#7", t)  # the re-prefill after a recovery: clean
    assert len(frames) == 22
    frames, t = push(plan, "b#2", t)
    assert [f.chunk.layer for f in frames[1:-1] if f.chunk.payload == bytes(8)] == [3]
    frames, t = push(plan, "c#3", t)  # not aimed, no probabilities: untouched
    assert [f.SerializeToString() for f in frames] == stream(request_id="c#3")
    assert dict(t.injected) == {"drop": 1, "corrupt": 1}


@pytest.mark.parametrize("plan", [{"drop": 1.5}, {"corrupt": -0.1}, {"explode": 0.1}, {"requests": {"a": "melt"}}])
def test_bad_plan_is_a_typed_error(plan):
    with pytest.raises(TransferConfigError, match="plan"):
        FaultyTransport(plan)
