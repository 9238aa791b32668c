"""KV-transfer benchmark: moving a 2,048-token SmolLM2 cache between processes, side by side, as ratios.

The receiver (decode side) is this process; the sender (prefill side) is a spawned child driven over a
pipe (JSON control messages only). Clocks: `time.monotonic()` is system-wide, so a start stamped by the
child and an end stamped here measure one interval. Per dtype (bfloat16, float32):
  socket   plain TCP on loopback: sendall of the cache in chunks / recv_into one buffer
  grpc     bare gRPC with the same chunking: pre-made payloads through `GrpcTransport`, a sink that only
           takes each payload (no checksum, no validation, no pages)
  full     the real path: `KVSender.send()` of a HELD 2,048-token prefill (export from pages, XXH3-64 checksums,
           gRPC) -> `KVReceiver` (validation, checksum, writes into reserved pages, commit)
           targets: full >= 0.5x socket, >= 0.85x grpc (throughput ratios; best of --reps)
  overlap  prefill start -> KV committed on the decode side, sending layer by layer during the prefill,
           over the same prefill alone (best of --reps each)                         target <= 1.05x
  p99      decode step time (pump + LLM.step, batch 8) while a transfer is being received, over idle
           steps interleaved with them; the sender replays a held cache (a burst, the worst case)
           as soon as the previous one committed. Run with the receiver's decode priority
           (`paced_bytes_per_s`, --paced-mb-s) and without                            target <= 1.2x
Runs of different kinds are interleaved (socket, grpc, full, socket, ...; alone, sending, alone, ...) so
load from other processes hits each alike; best-of is reported, medians beside it, and CPU ms per transfer
(every thread, sender + receiver process), which background load barely moves.
Run: .venv/bin/python bench/kv/kv_transfer_bench.py [--reps 3] [--dtypes bfloat16,float32] [--parts throughput,
overlap,p99]; writes bench/out/kv_transfer.json (or --out PATH).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine import LLM, SamplingParams  # noqa: E402
from engine.kv_cache.page_io import export_kv, stored_token_head_bytes  # noqa: E402
from kv_transfer import codec  # noqa: E402
from kv_transfer import kv_transfer_pb2 as pb  # noqa: E402
from kv_transfer.config import ReceiverConfig, SenderConfig  # noqa: E402
from kv_transfer.contract import TransferDescriptor, TransferState, make_transport  # noqa: E402
from kv_transfer.null_sink import NullSink  # noqa: E402
from kv_transfer.receiver import KVReceiver  # noqa: E402
from kv_transfer.sender import KVSender  # noqa: E402

CHUNK = 512 << 10
LEASE_S = 600.0  # a loaded machine can stretch a float32 prefill past the default 30 s lease
ONE = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)  # >1: a prefill must end HELD


def prompt_ids(n: int, salt: int = 0) -> list[int]:
    return [1 + (i * 7919 + salt * 104729) % 40000 for i in range(n)]


# ---- sender side: the child process ------------------------------------------------------------
class Child:
    def __init__(self, conn):
        self.conn, self.transport, self.llm, self.salt = conn, make_transport("grpc"), None, 0

    def serve(self) -> None:
        while True:
            msg = json.loads(self.conn.recv())
            reply = getattr(self, "op_" + msg.pop("op"))(**msg)
            self.conn.send(json.dumps(reply))
            if reply.get("closed"):
                return

    def op_load(self, dtype: str, tokens: int, chunk: int = CHUNK) -> dict:
        global CHUNK
        CHUNK = chunk  # this process's copy of the module-level setting
        self.tokens = tokens
        self.llm = LLM(model="smollm2-135m", dtype=dtype, page_size=16, num_pages=4 * tokens // 16 + 64)
        self.tx = KVSender(self.llm, self.transport, SenderConfig(chunk_bytes=CHUNK))
        return {"fingerprint": self.llm.fingerprint}

    def op_socket(self, port: int, nbytes: int) -> dict:
        data = memoryview(os.urandom(nbytes))
        with socket.create_connection(("127.0.0.1", port)) as s:
            t0, c0 = time.monotonic(), time.process_time()
            for off in range(0, nbytes, CHUNK):
                s.sendall(data[off:off + CHUNK])
        return {"t_start": t0, "cpu_s": time.process_time() - c0}

    def op_bare(self, address: str, nbytes: int) -> dict:
        """Frames made before the clock starts: what is timed is gRPC streaming alone."""
        frames = [pb.Frame(open=pb.Open(reservation_id="bare")).SerializeToString()]
        frames += [pb.Frame(chunk=pb.Chunk(byte_length=min(CHUNK, nbytes - off),
                                           payload=os.urandom(min(CHUNK, nbytes - off)))).SerializeToString()
                   for off in range(0, nbytes, CHUNK)]
        frames.append(pb.Frame(finish=pb.Finish(num_chunks=len(frames) - 1)).SerializeToString())
        t0, c0 = time.monotonic(), time.process_time()
        self.transport.push(address, iter(frames), SenderConfig(chunk_bytes=CHUNK))
        return {"t_start": t0, "cpu_s": time.process_time() - c0}

    def _fresh_pages(self) -> None:
        """Every measured prefill gets ascending consecutive pages: releasing a request's pages reverses
        the free list's order, and the engine's attention is faster on consecutive pages, so without
        this every other run would be slower for reasons unrelated to the transfer."""
        alloc = self.llm.allocator
        pages = alloc.allocate("bench", alloc.num_free)
        alloc.release("bench", sorted(pages, reverse=True))  # pop() hands out the lowest first

    def _prefill(self, rid: str) -> None:
        while self.llm.requests[rid].first_token_time is None:
            self.tx.step()

    def _drain(self) -> None:  # until every transfer ended
        while self.tx.num_live:
            self.tx.poll()
            time.sleep(0.005)

    def op_hold(self) -> dict:
        self.salt += 1
        self._fresh_pages()
        rid = self.llm.add_request(prompt_ids(self.tokens, self.salt), ONE, prefill_only=True)
        self._prefill(rid)
        return {"rid": rid, "first": self.llm.requests[rid].output_token_ids[0]}

    def op_send(self, rid: str, desc: dict, address: str) -> dict:
        t0, c0 = time.monotonic(), time.process_time()
        self.tx.send(rid, TransferDescriptor(**desc), address)
        self._drain()
        return {"t_start": t0, "cpu_s": time.process_time() - c0, "state": self.tx.status(rid).state.value}

    def op_prefill(self, desc: dict | None = None, address: str | None = None) -> dict:
        """Prefill alone (desc None; released at once) or while sending it into `desc`, layer by layer."""
        self.salt += 1
        self._fresh_pages()
        t0 = time.monotonic()
        rid = self.llm.add_request(prompt_ids(self.tokens, self.salt), ONE, prefill_only=True)
        if desc is not None:
            self.tx.send(rid, TransferDescriptor(**desc), address)
        self._prefill(rid)
        t_held = time.monotonic()
        if desc is None:
            self.llm.release_held(rid)
        self._drain()
        return {"t_start": t0, "prefill_s": t_held - t0, "state": self.tx.status(rid).state.value if desc else None}

    def op_replay(self, rid: str, first: int, desc: dict, address: str) -> dict:
        """Push a HELD request's cache again (the engine is idle meanwhile, so reading its pages off the
        engine thread is safe here): sender-side work identical to KVSender's, request kept held."""
        result = self.transport.push(address, replay_frames(self.llm, rid, first, TransferDescriptor(**desc)),
                                     SenderConfig(chunk_bytes=CHUNK))
        return {"state": result.state}

    def op_release(self, rid: str) -> dict:
        self.llm.release_held(rid)
        return {}

    def op_close(self) -> dict:
        self.tx.close()
        self.transport.close()
        return {"closed": True, "usage": self.llm.kv_usage() if self.llm else None}


def replay_frames(llm, rid: str, first: int, desc: TransferDescriptor):
    spec = llm.kv_spec
    layout = codec.TransferLayout.from_spec(spec, stored_token_head_bytes(spec))
    pages, n = llm.held_pages(rid)
    yield codec.encode(codec.open_frame(desc, layout, llm.requests[rid].prompt_token_ids, spec.num_kv_heads))
    row, count = layout.payload_bytes(1, layout.num_heads) // 2, 0
    for layer in spec.local_layers:
        k, v = export_kv(llm.backend, layer, pages, 0, n, copy=False)  # HELD: as KVSender reads it
        for a, b in codec.plan_token_ranges(0, n, layout, CHUNK):
            count += 1
            yield codec.chunk_wire(layout, layer, a, b, k[a * row:b * row], v[a * row:b * row])
    yield codec.encode(codec.finish_frame(first, count))


def child_main(conn) -> None:
    Child(conn).serve()


# ---- receiver side: this process ---------------------------------------------------------------
class Remote:
    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=child_main, args=(child,), daemon=True)
        self.proc.start()

    def start(self, op: str, **kw) -> None:
        self.conn.send(json.dumps({"op": op, **kw}))

    def result(self) -> dict:
        return json.loads(self.conn.recv())

    def call(self, op: str, **kw) -> dict:
        self.start(op, **kw)
        return self.result()


# time_*: (seconds, sender CPU seconds, receiver CPU seconds) of one transfer. CPU time (every thread of
# each process) is what the transfer costs whatever else runs: far less noisy than wall time on a busy machine.
def time_socket(remote: Remote, nbytes: int) -> tuple[float, float, float]:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        remote.start("socket", port=srv.getsockname()[1], nbytes=nbytes)
        conn, _ = srv.accept()
        c0, buf, got = time.process_time(), memoryview(bytearray(nbytes)), 0
        with conn:
            while got < nbytes:
                got += conn.recv_into(buf[got:], min(CHUNK, nbytes - got))
        t_end, cpu = time.monotonic(), time.process_time() - c0
    reply = remote.result()
    return t_end - reply["t_start"], reply["cpu_s"], cpu


def time_bare(remote: Remote, nbytes: int) -> tuple[float, float, float]:
    sink, transport = NullSink(), make_transport("grpc")
    server = transport.serve(sink, ReceiverConfig())
    try:
        c0 = time.process_time()
        reply = remote.call("bare", address=server.address, nbytes=nbytes)
        cpu = time.process_time() - c0
    finally:
        server.stop()
    return sink.t_end - reply["t_start"], reply["cpu_s"], cpu


def until_committed(rx: KVReceiver, desc) -> float:
    """Pump (blocking on work when idle) until `desc` is committed; commit time. The request is aborted."""
    while True:
        committed = rx.pump()
        if desc.request_id in committed:
            t = time.monotonic()
            rx.llm.abort(desc.request_id)
            return t
        assert not rx.status(desc.reservation_id).state.terminal, rx.status(desc.reservation_id)
        rx.wait_for_work(0.05)


def time_full(remote: Remote, rx: KVReceiver, address: str, tokens: int) -> tuple[float, float, float]:
    held = remote.call("hold")
    desc = rx.reserve(tokens, ONE, lease_s=LEASE_S)
    c0 = time.process_time()
    remote.start("send", rid=held["rid"], desc=desc.__dict__, address=address)
    t_end, cpu = until_committed(rx, desc), time.process_time() - c0  # left to right: CPU until the commit
    reply = remote.result()
    assert reply["state"] == "done", reply
    return t_end - reply["t_start"], reply["cpu_s"], cpu


def bench_overlap(remote: Remote, rx: KVReceiver, address: str, tokens: int, reps: int) -> dict:
    """Prefill alone and prefill while sending, interleaved (background load hits both alike)."""
    alone, shipped, prefill_while_sending = [], [], []
    for _ in range(reps):
        alone.append(remote.call("prefill")["prefill_s"])
        desc = rx.reserve(tokens, ONE, lease_s=LEASE_S)
        remote.start("prefill", desc=desc.__dict__, address=address)
        t_end = until_committed(rx, desc)
        reply = remote.result()
        shipped.append(t_end - reply["t_start"])
        prefill_while_sending.append(reply["prefill_s"])
    return {"prefill_alone_s": min(alone), "start_to_committed_s": min(shipped),
            "prefill_while_sending_s": min(prefill_while_sending), "ratio": min(shipped) / min(alone),
            "median_ratio": statistics.median(shipped) / statistics.median(alone)}


def timed_step(rx: KVReceiver) -> float:
    t0 = time.monotonic()
    for rid in rx.pump():
        rx.llm.abort(rid)  # replayed caches are not decoded: the batch stays the same size
    with rx.decoding():
        rx.llm.step()
    return time.monotonic() - t0


def bench_p99(remote: Remote, rx: KVReceiver, address: str, tokens: int, transfers: int, paced: int | None) -> dict:
    """Decode steps (batch 8) idle and while a replayed cache is received, interleaved."""
    dec = rx.llm
    rx.config = dataclasses.replace(rx.config, paced_bytes_per_s=paced)
    for i in range(8):
        dec.add_request(prompt_ids(256, 100 + i), SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    for _ in range(12):  # prefill the batch, settle into decode
        dec.step()
    held = remote.call("hold")
    idle, loaded = [], []
    for _ in range(transfers):
        idle += [timed_step(rx) for _ in range(6)]
        desc = rx.reserve(tokens, ONE, lease_s=LEASE_S)
        remote.start("replay", rid=held["rid"], first=held["first"], desc=desc.__dict__, address=address)
        while rx.status(desc.reservation_id).state not in (TransferState.DONE, TransferState.FAILED):
            loaded.append(timed_step(rx))
        assert remote.result()["state"] == "done"
    remote.call("release", rid=held["rid"])
    for rid in list(dec.requests):
        dec.abort(rid)

    def p99(xs):
        return statistics.quantiles(xs, n=100, method="inclusive")[98] if len(xs) > 1 else xs[0]

    rx.config = dataclasses.replace(rx.config, paced_bytes_per_s=None)
    return {"paced_mb_s": paced / 1e6 if paced else None,
            "idle_p50_ms": 1e3 * statistics.median(idle), "idle_p99_ms": 1e3 * p99(idle),
            "loaded_p50_ms": 1e3 * statistics.median(loaded), "loaded_p99_ms": 1e3 * p99(loaded),
            "loaded_steps": len(loaded), "idle_steps": len(idle), "ratio": p99(loaded) / p99(idle)}


def bench_throughput(remote: Remote, rx: KVReceiver, address: str, tokens: int, nbytes: int, reps: int) -> dict:
    """Socket, bare gRPC and the full path, interleaved (background load hits all three alike)."""
    runs = {"socket": lambda: time_socket(remote, nbytes), "grpc": lambda: time_bare(remote, nbytes),
            "full": lambda: time_full(remote, rx, address, tokens)}
    times, out = {name: [] for name in runs}, {}
    for _ in range(reps):
        for name, fn in runs.items():
            times[name].append(fn())
    for name, runs_of in times.items():
        ts, tx, rx_ = zip(*runs_of)
        out[name] = {"best_s": min(ts), "median_s": statistics.median(ts), "gb_per_s": nbytes / min(ts) / 1e9,
                     "all_s": ts, "sender_cpu_s": statistics.median(tx), "receiver_cpu_s": statistics.median(rx_)}
    out["full_vs_socket"] = out["full"]["gb_per_s"] / out["socket"]["gb_per_s"]
    out["full_vs_grpc"] = out["full"]["gb_per_s"] / out["grpc"]["gb_per_s"]
    return out


def bench_dtype(dtype: str, args) -> dict:
    remote = Remote()
    remote.call("load", dtype=dtype, tokens=args.tokens)
    dec = LLM(model="smollm2-135m", dtype=dtype, page_size=32, num_pages=(8 * 700 + 2 * args.tokens) // 32 + 64)
    nbytes = args.tokens * dec.kv_spec.bytes_per_token_layer() * dec.config.num_layers
    transport, rx = make_transport("grpc"), KVReceiver(dec, ReceiverConfig())
    address = rx.serve(transport)
    out = {"dtype": dtype, "tokens": args.tokens, "mb": nbytes / 1e6, "chunk_kib": CHUNK >> 10}
    parts = args.parts.split(",")
    if "throughput" in parts:
        out.update(bench_throughput(remote, rx, address, args.tokens, nbytes, args.reps))
    if "overlap" in parts:
        out["overlap"] = bench_overlap(remote, rx, address, args.tokens, args.reps)
    if "p99" in parts:
        paced = int(args.paced_mb_s * 1e6) if args.paced_mb_s else None
        out["p99"] = bench_p99(remote, rx, address, args.tokens, args.transfers, paced)
        out["p99_unpaced"] = bench_p99(remote, rx, address, args.tokens, args.transfers, None)
    out["receiver_leaks"], out["sender_leaks"] = dec.kv_usage(), remote.call("close")["usage"]
    rx.close()
    transport.close()
    remote.proc.join(30)
    return out


def table(results: list[dict]) -> str:
    rows = ["| dtype | MB | socket GB/s | bare gRPC GB/s | full GB/s | full/socket (>=0.5) | full/gRPC (>=0.85) "
            "| overlap (<=1.05) | decode P99 loaded/idle (<=1.2) |", "|" + "---|" * 9]
    for r in results:
        cells = [r["dtype"], f"{r['mb']:.1f}"] + ["-"] * 7
        if "full" in r:
            cells[2:7] = [f"{r['socket']['gb_per_s']:.2f}", f"{r['grpc']['gb_per_s']:.2f}",
                          f"{r['full']['gb_per_s']:.2f}", f"{r['full_vs_socket']:.2f}x",
                          f"{r['full_vs_grpc']:.2f}x (medians {r['grpc']['median_s'] / r['full']['median_s']:.2f}x; CPU ms sender+receiver "
                          + ", ".join(f"{k} {1e3 * r[k]['sender_cpu_s']:.0f}+{1e3 * r[k]['receiver_cpu_s']:.0f}"
                                      for k in ("grpc", "full")) + ")"]
        if "overlap" in r:
            o = r["overlap"]
            cells[7] = (f"{o['ratio']:.3f}x ({o['start_to_committed_s']:.2f} s / {o['prefill_alone_s']:.2f} s; "
                        f"medians {o['median_ratio']:.3f}x)")
        if "p99" in r:
            p, u = r["p99"], r["p99_unpaced"]
            paced = f"paced {p['paced_mb_s']:.0f} MB/s" if p["paced_mb_s"] else "unpaced"
            cells[8] = (f"{p['ratio']:.2f}x {paced} ({p['loaded_p99_ms']:.0f} / {p['idle_p99_ms']:.0f} ms); "
                        f"{u['ratio']:.2f}x unpaced")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--transfers", type=int, default=12, help="transfers received during the P99 run")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--paced-mb-s", type=float, default=100.0,
                    help="receiver decode priority during the P99 run: MB/s taken while stepping (0: off)")
    ap.add_argument("--parts", default="throughput,overlap,p99", help="measurements to run (comma-separated)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out" / "kv_transfer.json"))
    args = ap.parse_args()
    results = [bench_dtype(d, args) for d in args.dtypes.split(",")]
    print(table(results))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
