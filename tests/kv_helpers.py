"""Helpers for KV-transfer tests: a fake clock, end-observers, a drive loop, and frames built by hand.

`drive()` runs a prefill engine's `KVSender` and a decode engine's `KVReceiver` in one thread (the push
threads of the transport run beside it) until both have settled every transfer. `hand_frames()` builds
the frames of one finished prefill directly with the codec, so failure tests can feed `handle_push`
exactly the stream they want.
"""
from __future__ import annotations

import time
from collections import Counter

from engine.kv_cache.page_io import export_kv, stored_token_head_bytes
from kv_transfer import codec
from tests.conftest import assert_engine_empty


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Ends:
    """An `on_end` observer: counts how often each transfer ended and keeps its final status."""

    def __init__(self):
        self.count: Counter = Counter()
        self.last = {}

    def __call__(self, key, status) -> None:
        self.count[key] += 1
        self.last[key] = status

    def assert_each_once(self, keys) -> None:
        keys = list(keys)
        assert sorted(self.count) == sorted(keys), (dict(self.count), keys)
        assert all(self.count[k] == 1 for k in keys), dict(self.count)


def drive(tx, rx, timeout_s: float = 60.0) -> list:
    """Step both sides until no transfer is live on either; returns the decode side's outputs."""
    outs, end = [], time.monotonic() + timeout_s
    while tx.num_live or rx.num_live:
        if tx.llm.has_unfinished():
            tx.step()
        else:
            tx.poll()
            rx.wait_for_work(0.002)  # waiting on a push thread, not on a deadline
        outs += rx.step()
        assert time.monotonic() < end, f"transfers did not settle: {tx.num_live} sending, {rx.num_live} receiving"
    return outs


def decode_all(llm, request_ids, outs) -> list[list[int]]:
    """Finish decoding; the final token ids of each request, in order."""
    outs = outs + llm.generate_until_idle()
    final = {o.request_id: o.token_ids for o in outs}
    return [final[r] for r in request_ids]


def prefill_held(llm, prompt, params) -> tuple[str, int]:
    """Run a prefill-only request to HELD; (request id, first token)."""
    rid = llm.add_request(prompt, params, prefill_only=True)
    first = [o for o in llm.generate_until_idle() if o.request_id == rid][0]
    return rid, first.token_ids[0]


def wire(frames) -> list[bytes]:
    """Frames as a transport carries them."""
    return [f.SerializeToString() for f in frames]


def hand_frames(llm, request_id: str, first_token: int, desc, chunk_bytes: int = 1024) -> list:
    """[open, chunks (every layer, in order), finish] of a HELD request as `pb.Frame`s (mutable, for
    failure tests; `wire()` them for `handle_push`), built with the codec."""
    spec = llm.kv_spec
    layout = codec.TransferLayout.from_spec(spec, stored_token_head_bytes(spec))
    pages, n = llm.held_pages(request_id)
    prompt = llm.requests[request_id].prompt_token_ids
    frames = [codec.open_frame(desc, layout, list(prompt), spec.num_kv_heads)]
    row = layout.payload_bytes(1, layout.num_heads) // 2
    for layer in spec.local_layers:
        k, v = export_kv(llm.backend, layer, pages, 0, n)
        for a, b in codec.plan_token_ranges(0, n, layout, chunk_bytes):
            frames.append(codec.parse_frame(codec.chunk_wire(layout, layer, a, b, k[a * row:b * row],
                                                              v[a * row:b * row])))
    frames.append(codec.finish_frame(first_token, len(frames) - 1))
    return frames


def close_all(tx=None, rx=None, transport=None, llms=()) -> None:
    """Shut the endpoints down and check that nothing leaked: no pages, reservations, requests, transfers."""
    if tx is not None:
        tx.close()
        assert tx.num_live == 0 and not [t for t in tx._threads if t.is_alive()], "push threads left"
    if rx is not None:
        rx.close()
        assert rx.num_live == 0, "receiver kept transfers"
    if transport is not None:
        transport.close()
    for llm in llms:
        assert_engine_empty(llm)


def prefill_child_main(conn, model: str, dtype: str, page_size: int, chunk_bytes: int) -> None:
    """A prefill engine with a gRPC `KVSender` in a child process (spawn). JSON over the pipe (control only):
    in  {"op": "prefill", "jobs": [{"prompt", "max_tokens", "desc", "address"}]} -> {"statuses": [[state, reason]]}
    in  {"op": "close"} -> {"usage": kv_usage, "unfinished": bool}, then the child exits."""
    import json

    from engine import SamplingParams
    from engine.llm import LLM
    from kv_transfer.config import SenderConfig
    from kv_transfer.contract import TransferDescriptor, make_transport
    from kv_transfer.sender import KVSender

    llm = LLM(model=model, dtype=dtype, page_size=page_size, num_pages=-(-8192 // page_size))
    transport = make_transport("grpc")
    tx = KVSender(llm, transport, SenderConfig(chunk_bytes=chunk_bytes))
    conn.send(json.dumps({"ready": True, "fingerprint": llm.fingerprint}))
    while True:
        msg = json.loads(conn.recv())
        if msg["op"] == "close":
            tx.close()
            transport.close()
            unfinished = llm.has_unfinished() or bool(llm.scheduler.held)
            conn.send(json.dumps({"usage": llm.kv_usage(), "unfinished": unfinished}))
            return
        rids = []
        for job in msg["jobs"]:
            params = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True)
            rids.append(llm.add_request(job["prompt"], params, prefill_only=True))
            tx.send(rids[-1], TransferDescriptor(**job["desc"]), job["address"])
        while tx.num_live:
            if llm.has_unfinished():
                tx.step()
            else:
                tx.poll()
                time.sleep(0.001)
        conn.send(json.dumps({"statuses": [[tx.status(r).state.value, tx.status(r).reason] for r in rids]}))


def ship_all(pre, dec, prompts, params, transport=None, chunk_bytes: int = 1024, timeout_s: float = 60.0):
    """Reserve on `dec`, prefill on `pre` and ship every prompt's KV at once, then decode to the end.
    Returns (token ids per prompt, descriptors, (tx, rx, transport)) -- pass the last to `close_all`."""
    from kv_transfer.config import ReceiverConfig, SenderConfig
    from kv_transfer.fake_transport import FakeTransport
    from kv_transfer.receiver import KVReceiver
    from kv_transfer.sender import KVSender

    transport = transport or FakeTransport()
    rx = KVReceiver(dec, ReceiverConfig())
    address = rx.serve(transport)
    tx = KVSender(pre, transport, SenderConfig(chunk_bytes=chunk_bytes))
    descs = []
    for p in prompts:
        descs.append(rx.reserve(len(p), params))
        tx.send(pre.add_request(p, params, prefill_only=True), descs[-1], address)
    got = decode_all(dec, [d.request_id for d in descs], drive(tx, rx, timeout_s))
    return got, descs, (tx, rx, transport)


def page_order(kind: str, count: int, offset: int, rng) -> list[int]:
    """`count` page ids from `offset`: "consecutive", "reversed" or "shuffled" (by `rng`, a random.Random)."""
    pages = list(range(offset, offset + count))
    if kind == "reversed":
        pages.reverse()
    elif kind == "shuffled":
        rng.shuffle(pages)
    return pages
