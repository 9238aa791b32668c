"""The disaggregated handoff on one device, without Ray: prefill engine -> gRPC -> decode engine (issue 32).

In one process, on `--device`, a `PrefillWorker` and a `DecodeWorker` (the workers' own classes, as the
in-process tests run them), two engines. First the prefill engine alone generates N prompts x M tokens
greedy (the colocated reference; `--ref-graphs`, eager by default); then the same prompts are handed over
pdserve's real gRPC KV plane on loopback (device pages -> pinned host -> wire -> pinned host -> device pages;
engine/kv_cache/page_io.py), twice:
  layer-wise  `PrefillWorker.submit`: each layer's KV leaves while the prefill computes
  held        prompts prefilled to HELD first, then `KVSender.send` of all at once: the transfer alone
Both commit every request before the first decode step (the reference's batch shape), then decode with
`--graphs` (the decode engine's `decode_graphs`); their tokens are compared with the reference's: float32
through tests/exactness.assert_greedy_equal; bf16 reports, per prompt, the first divergence and the
reference's top-2 logit gap there (a near-tie, or a bug). The reference's prefill runs under a no-op layer
hook, as the sender hooks every layer of the prefill engine (on CUDA that path skips the fused forward), so
the reference decodes from the very KV that travels.
Throughput: KV payload bytes / wall time from the first reserve to the last commit, beside a bare gRPC push
of the held handoff's chunks (same sizes and streams, frames made before the clock, a sink that only takes
them: kv_transfer/null_sink.py) in the same run, best of two.

Models: `tiny` (tests/tiny_models), any name `LLM` takes (`smollm2-135m`: real weights), or
`random:<deploy/models name>` (random weights made on the device). Comma-separate several.
Run (GPU):  python bench/gpu/disagg_check.py --device cuda --model random:smollm2-135m,random:llama-3-8b \
                --prompt-len 512 --out DIR   [--graphs off: eager decode, for the bit-exact transfer check]
     (CPU):  .venv/bin/python bench/gpu/disagg_check.py --model tiny --dtype float32 --prompt-len 24 --tokens 16
Prints a markdown table per model; writes DIR/gpu_disagg_<model>.json. Exit 1 if a check failed.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kv_transfer.null_sink import NullSink  # noqa: E402
from decode_worker.worker import DecodeWorker  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from kv_transfer import codec, kv_transfer_pb2 as pb  # noqa: E402
from kv_transfer.config import ReceiverConfig, SenderConfig  # noqa: E402
from kv_transfer.contract import TransferState, make_transport  # noqa: E402
from prefill_worker.worker import PrefillWorker  # noqa: E402
from tests.exactness import assert_greedy_equal  # noqa: E402


@dataclass(frozen=True)
class Check:
    model: str = "tiny"
    device: str = "cpu"
    dtype: str = "bfloat16"
    prompts: int = 8
    prompt_len: int = 32
    tokens: int = 64
    graphs: str = "auto"  # the decode engine's decode_graphs
    ref_graphs: str = "off"  # the colocated reference's
    page_size: int = 16
    chunk_bytes: int = 512 << 10


def make_llm(c: Check, tmp: Path, graphs: str) -> LLM:
    per_row = -(-(c.prompt_len + c.tokens + 1) // c.page_size)
    kw = dict(dtype=c.dtype, device=c.device, page_size=c.page_size, num_pages=c.prompts * per_row + 4,
              max_num_seqs=c.prompts, max_num_batched_tokens=max(c.prompts * c.prompt_len, 64),  # one prefill step
              max_model_len=per_row * c.page_size, num_threads=None if c.device.startswith("cuda") else 1,
              decode_graphs=graphs)
    if c.model == "tiny":
        from tests.tiny_models import write_tiny

        d = tmp / "tiny"
        if not (d / "config.json").exists():
            write_tiny("llama", d, initializer_range=0.1)
        return LLM(model=str(d), **kw)
    if not c.model.startswith("random:"):
        return LLM(model=c.model, **kw)
    import engine.llm as engine_llm
    from bench.gpu.step_power import RandomWeights, random_model_dir

    model_dir, shapes = random_model_dir(c.model.split(":", 1)[1], tmp / "model")
    real = engine_llm.load_weights  # (as bench/gpu/decode_floor.py: the engine has no weights hook)
    engine_llm.load_weights = lambda _d: RandomWeights(shapes, c.device, getattr(torch, c.dtype))  # seeded: alike
    try:
        return LLM(model=str(model_dir), **kw)
    finally:
        engine_llm.load_weights = real


def greedy(c: Check) -> SamplingParams:
    return SamplingParams(max_tokens=c.tokens, temperature=0.0, ignore_eos=True)


def sync(c: Check) -> None:
    if c.device.startswith("cuda"):
        torch.cuda.synchronize()


def reference(llm: LLM, c: Check) -> tuple[list[list[int]], list[list[int]], list[torch.Tensor]]:
    """Random prompts; their tokens on `llm` alone (colocated) and, per position, the top-2 logits that chose
    them ([M, 2] each). Its prefill runs under a no-op layer hook: the kernels the sender's hook leaves it."""
    g = torch.Generator().manual_seed(c.prompt_len)
    prompts = [torch.randint(3, llm.config.vocab_size, (c.prompt_len,), generator=g).tolist() for _ in range(c.prompts)]
    llm.keep_logits = True
    rids = [llm.add_request(p, greedy(c)) for p in prompts]
    noop = lambda layer, batch: None  # noqa: E731
    llm.runner.add_layer_hook(noop)
    outs = []
    while any(r in llm.requests and llm.requests[r].first_token_time is None for r in rids):
        outs += llm.step()
    llm.runner.remove_layer_hook(noop)
    final = {o.request_id: o for o in outs + llm.generate_until_idle() if o.finished}
    llm.keep_logits = False
    top2 = [torch.topk(torch.cat([x.reshape(1, -1) for x in final[r].logits]).float(), 2).values.cpu() for r in rids]
    return prompts, [list(final[r].token_ids) for r in rids], top2


def handoff(pre: PrefillWorker, dec: DecodeWorker, prompts: list[list[int]], c: Check, held: bool,
            timeout_s: float = 600.0) -> dict:
    """One disaggregated run of every prompt; tokens, KV bytes and the wall time of the handoff."""
    params, ids = greedy(c), [f"{'held' if held else 'layer'}-{i}" for i in range(len(prompts))]
    if held:
        for rid, p in zip(ids, prompts):
            pre.llm.add_request(p, params, request_id=rid, prefill_only=True)
        while len(pre.llm.scheduler.held) < len(ids):
            pre.llm.step()
    sync(c)
    t0, end = time.perf_counter(), time.monotonic() + timeout_s
    descs = [dec.reserve(rid, p, params, lease_s=timeout_s) for rid, p in zip(ids, prompts)]
    assert all(descs), "the decode engine has no pages for every prompt"
    for rid, p, d in zip(ids, prompts, descs):
        pre.sender.send(rid, d, dec.address) if held else pre.submit(rid, p, params, d, dec.address)
    committed: set[str] = set()
    while len(committed) < len(ids):  # every request joins before the first decode step: the reference's batch
        for ev in pre.step():
            assert ev.kind not in ("finished", "transfer_failed"), ev
        committed.update(dec.receiver.pump())
        failed = [dec.receiver.status(d.reservation_id) for d in descs if d.request_id not in committed]
        assert not any(s.state == TransferState.FAILED for s in failed), failed
        assert time.monotonic() < end, f"{len(committed)} of {len(ids)} transfers committed in {timeout_s}s"
    seconds = time.perf_counter() - t0
    nbytes = sum(dec.receiver.status(d.reservation_id).bytes for d in descs)
    got: dict[str, list[int]] = {rid: [] for rid in ids}  # (the first delta brings the prefill's token)
    done: set[str] = set()
    while len(done) < len(ids) or pre.sender.num_live:
        for d in dec.step():
            got[d.request_id] += d.new_token_ids
            done.update([d.request_id] if d.finished else [])
        pre.step()  # the sender releases each held prefill once its push has ended
        assert time.monotonic() < end, "decoding did not finish"
    return {"tokens": [got[r] for r in ids], "bytes": nbytes, "seconds": seconds}


def bare_grpc(layout: codec.TransferLayout, prompts: list[list[int]], chunk: int) -> float:
    """Wall seconds to push the held handoff's chunks (same sizes: codec's plan per layer; one stream per prompt,
    all at once) as frames made before the clock, to a sink that only takes them."""
    sink, transport, made = NullSink(), make_transport("grpc"), {}
    server = transport.serve(sink, ReceiverConfig(max_streams=max(8, len(prompts))))
    wire = lambda **kw: pb.Frame(**kw).SerializeToString()  # noqa: E731
    frame = lambda n: made.setdefault(n, wire(chunk=pb.Chunk(byte_length=n, payload=bytes(n))))  # noqa: E731
    ends = [wire(open=pb.Open(reservation_id="bare")), wire(finish=pb.Finish())]
    streams = [ends[:1] + [frame(layout.payload_bytes(b - a, layout.num_heads))
                           for a, b in codec.plan_token_ranges(0, len(p), layout, chunk)] * layout.num_local_layers
               + ends[1:] for p in prompts]
    with ThreadPoolExecutor(len(streams)) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda f: transport.push(server.address, iter(f), SenderConfig(chunk_bytes=chunk)), streams))
        seconds = time.perf_counter() - t0
    transport.close()  # (the client first: a server stopping under an open channel logs a GOAWAY)
    server.stop()
    return seconds


def compare(c: Check, ref: list[list[int]], top2: list[torch.Tensor], got: list[list[int]]) -> dict:
    """Equal tokens? float32: assert_greedy_equal (near-ties only); bf16: the first divergence, reported."""
    if c.dtype == "float32":
        try:  # fails unless every divergence is a near-tie (reported, then the table and the JSON are written)
            rep = assert_greedy_equal(ref, got, top2)
        except AssertionError as e:
            return {"equal": False, "compared": sum(map(len, ref)), "first_divergence": str(e), "divergences": [str(e)]}
        return {"equal": True, "compared": rep.compared, "divergences": rep.divergences}
    firsts = []  # per prompt, where its tokens first differ and how close the reference's choice was there
    for case, (a, b) in enumerate(zip(ref, got)):
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
        if i is not None:
            gap = float(top2[case][i, 0] - top2[case][i, 1]) if i < len(top2[case]) else None
            firsts.append({"prompt": case, "position": i, "top2_gap": gap})
    out = {"equal": not firsts, "compared": sum(map(len, ref))}
    return out | ({"first_divergence": firsts[0], "divergences": firsts} if firsts else {})


def check(c: Check, tmp: Path, idle_check=None) -> dict:
    """The whole check for one model; `idle_check(llm)` runs on both engines before they close."""
    t_start, pre, dec = time.perf_counter(), None, None
    try:  # the prefill engine is the colocated reference first (before its sender hooks its layers)
        pre = PrefillWorker({}, SenderConfig(chunk_bytes=c.chunk_bytes), "grpc", llm=make_llm(c, tmp, c.ref_graphs))
        prompts, ref_tokens, top2 = reference(pre.llm, c)
        dec = DecodeWorker({}, ReceiverConfig(max_streams=max(8, c.prompts)), "grpc", llm=make_llm(c, tmp, c.graphs))
        runs = {name: handoff(pre, dec, prompts, c, held=name == "held") for name in ("layer-wise", "held")}
        bare = min(bare_grpc(pre.sender.layout, prompts, c.chunk_bytes) for _ in range(2))
        for llm in (pre.llm, dec.llm):
            (idle_check or assert_idle)(llm)
        capture = getattr(dec.llm.decode_graphs, "capture_s", None)
    finally:
        for w in (pre, dec):
            if w is not None:
                w.close()
    out = {"config": asdict(c), "device_name": device_name(c), "graphs_capture_s": capture,
           "bare_grpc": {"bytes": runs["held"]["bytes"], "seconds": bare}}
    for name, r in runs.items():
        out[name] = {"bytes": r["bytes"], "seconds": r["seconds"], **compare(c, ref_tokens, top2, r["tokens"])}
    for r in (out["layer-wise"], out["held"], out["bare_grpc"]):
        r["gb_s"] = r["bytes"] / r["seconds"] / 1e9
    out["held_vs_bare"] = out["held"]["gb_s"] / out["bare_grpc"]["gb_s"]
    out["ok"] = out["layer-wise"]["equal"] and out["held"]["equal"]
    out["seconds_total"] = time.perf_counter() - t_start
    return out


def assert_idle(llm: LLM) -> None:
    u = llm.kv_usage()
    assert u["pages_in_use"] == 0 and u["reservations"] == 0 and not llm.has_unfinished() and not llm.scheduler.held, u


def device_name(c: Check) -> str:
    return torch.cuda.get_device_name() if c.device.startswith("cuda") else "cpu"


def table(r: dict) -> str:
    c, bare = r["config"], r["bare_grpc"]["gb_s"]
    rows = [f"### {c['model']} on {r['device_name']}, {c['dtype']}: {c['prompts']} prompts x {c['prompt_len']} tokens, "
            f"{c['tokens']} greedy; decode graphs {c['graphs']} (capture {r['graphs_capture_s'] or 0:.2f} s) vs a "
            f"colocated reference, graphs {c['ref_graphs']}; whole check {r['seconds_total']:.1f} s", "",
            "| path | tokens equal the reference | KV MB | wall ms | GB/s | vs bare gRPC |", "|---" * 6 + "|"]
    for name, label in (("layer-wise", "layer-wise handoff (prefill + transfer)"), ("held", "held handoff (transfer)"),
                        ("bare_grpc", "bare gRPC, same bytes and streams")):
        x = r[name]
        eq = "-" if "equal" not in x else f"yes ({x['compared']})" if x["equal"] else f"NO, {len(x['divergences'])} prompts; first {x['first_divergence']}"
        rows.append(f"| {label} | {eq} | {x['bytes'] / 1e6:.2f} | {x['seconds'] * 1e3:.1f} | {x['gb_s']:.3f} | "
                    f"{x['gb_s'] / bare:.2f}x |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="comma-separated: tiny, smollm2-135m, random:<name>, ...")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--graphs", default="auto", help="the decode engine's decode_graphs: auto|static|off")
    ap.add_argument("--ref-graphs", default="off", help="the colocated reference's decode_graphs")
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    a = ap.parse_args()
    out, ok = Path(a.out), True
    out.mkdir(parents=True, exist_ok=True)
    for model in a.model.split(","):
        c = Check(model, a.device, a.dtype, a.prompts, a.prompt_len, a.tokens, a.graphs, a.ref_graphs)
        with tempfile.TemporaryDirectory() as tmp:
            r = check(c, Path(tmp))
        print(table(r), flush=True)
        (out / f"gpu_disagg_{model.replace(':', '_').replace('/', '_')}.json").write_text(json.dumps(r, indent=1))
        ok &= r["ok"]
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
