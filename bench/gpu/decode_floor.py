"""Decode step vs the memory floor on one GPU, three engine paths side by side in one run (issue 32).

Per model and batch size: B requests are prefilled to --context tokens once, then the same running batch is
stepped --steps times under each mode in turn:
  graphs  the default: CUDA-graph decode (engine/kernels/cuda/graph_decode.py) over Triton paged attention;
  triton  the same kernels launched eagerly (decode_graphs off);
  torch   the path before issue 32: SDPA over gathered pages (PDSERVE_ATTENTION=torch), eager;
  sampled / sampled_cpu  (asked for with --modes) graphs with every row sampled (temperature 0.8, top-p 0.95,
          seeded) on the device (engine/device_sampler.py: only the ids come back) / on the host from a copy of
          the logits (the CPU sampler); each row's `over_greedy` is its step over the greedy graphs step's.
For graphs, the GPU time of each replay (CUDA events around it) is reported too: step - GPU is the host's
part (scheduling, inputs, sampling, detokenizing), which nothing overlaps with the GPU yet.
`--kv int8` adds int8-page rows (a second engine, the first freed): graphs mode, ratio to bf16 graphs.
`--sparse BUDGET` adds Quest rows (sparse attention with that token budget; a second engine: graphs, where the
choice runs on the device, and Triton eager) beside the full-attention rows of the same batch and context
(e.g. 8 x 32k), each row's ratio to them in `over_full`.
The floor: (weight bytes + K/V bytes the step reads) / the device-to-device copy bandwidth measured at the
start of the run (bytes read + written per second), so ratio = step / floor; for an MoE model (random:qwen3-30b-a3b,
random:mixtral-8x7b; random:tiny-moe on CPU) the weight bytes are those of the experts a step of B rows
touches in expectation (`unread_expert_bytes`), each row's `experts_touched` a layer beside it. Steps are whole `LLM.step()`
calls (scheduling, sampling and detokenizing included), synchronised before and after.

Run:  python bench/gpu/decode_floor.py --model random:llama-3-8b --context 2048 --batches 1,16,64,128 --out DIR
      (CPU, tiny: --device cpu --model random:tiny --context 64 --batches 1,4 --steps 3; Triton's interpreter)
Writes DIR/floor_<model>.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.gpu.step_power import RandomWeights, random_model_dir  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402

MODES = ("graphs", "triton", "torch")
GRAPH_MODES = ("graphs", "sampled", "sampled_cpu")  # CUDA-graph decode; the last two sample every row


def copy_bandwidth(device: str, gib: float = 2.0) -> float:
    """Bytes read + written per second by a device-to-device copy of `gib` GiB (median of 10)."""
    if not device.startswith("cuda"):
        return 20e9  # a nominal figure for CPU dry runs
    n = int(gib * (1 << 30)) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    times = []
    for _ in range(13):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * n * 2 / statistics.median(times[3:])


def headroom(max_batch: int, steps: int) -> int:
    """Tokens a row may generate: the timed steps, warm-ups, and the steps early rows decode while later
    prompts are still prefilling (4 prompts a step)."""
    return 2 * steps + max_batch // 2 + 64


# random:tiny-moe: a Qwen3-MoE of tiny widths (8 experts, top-2) for the CPU rehearsal of the MoE rows
TINY_MOE = dict(name="tiny-moe", architecture="Qwen3MoeForCausalLM", layers=2, hidden=64, heads=4, kv_heads=2,
                head_dim=16, ffn=128, vocab=512, max_positions=4096, tied_embeddings=False, experts=8,
                experts_per_token=2, expert_ffn=32)


def unread_expert_bytes(llm: LLM, batch: int) -> tuple[int, float]:
    """(bytes of the experts a decode step of `batch` rows leaves unread, experts touched a layer): with
    uniform routing (random weights route near-uniformly) a layer touches E (1 - (1 - k/E)^batch) distinct
    experts in expectation -- the planner's count (docs/planner.md). (0, 0.0) for a dense model."""
    moe = llm.config.moe
    if moe is None:
        return 0, 0.0
    touched = moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** batch)
    layer = next(lw.moe for lw in llm.model.layers if lw.moe is not None)
    return int((moe.num_experts - touched) * layer.expert_bytes() * len(moe.sparse_layers)), touched


def build(model: str, device: str, max_batch: int, context: int, steps: int, tmp: Path, kv: str = "raw",
          sparse: dict | None = None) -> LLM:
    ps = 16
    per_row = -(-(context + headroom(max_batch, steps) + 16) // ps)
    kw = dict(dtype="bfloat16", device=device, num_pages=max_batch * per_row + 8, max_num_seqs=max_batch,
              max_num_batched_tokens=8192 if device.startswith("cuda") else 256, num_threads=None, page_size=ps,
              max_model_len=context + headroom(max_batch, steps) + 16, kv_storage=kv, sparse_attention=sparse,
              sampler="device")  # (greedy rows never reach it; the sampled modes choose per mode)
    if not model.startswith("random:"):
        return LLM(model=model, **kw)
    import engine.llm as engine_llm

    name = model.split(":", 1)[1]
    if name == "tiny":
        from tests.tiny_models import write_tiny
        model_dir = write_tiny("llama", tmp / "tiny", num_attention_heads=8, num_key_value_heads=2)
        return LLM(model=str(model_dir), **kw)
    from cluster.planner.calibrate.random_model import model_entry

    # a longer context than the entry's (Quest at 32k): the step's shapes are the same
    entry = TINY_MOE if name == "tiny-moe" else model_entry(name)
    entry = dict(entry, max_positions=max(entry["max_positions"], kw["max_model_len"]))
    model_dir, shapes = random_model_dir(entry, tmp / "model")
    real = engine_llm.load_weights
    engine_llm.load_weights = lambda _dir: RandomWeights(shapes, device, torch.bfloat16)
    try:
        return LLM(model=str(model_dir), **kw)
    finally:
        engine_llm.load_weights = real


def set_mode(llm: LLM, mode: str, graphs) -> None:
    llm.runner.graphs = graphs if mode in GRAPH_MODES else None
    llm.backend.triton_paged = mode != "torch"
    llm.backend._dense = None  # the torch path's dense copies start afresh
    llm.runner.sampler = "cpu" if mode == "sampled_cpu" else "device"
    if graphs is not None:
        graphs.sampler = llm.runner.sampler
    sampled = mode in ("sampled", "sampled_cpu")  # every running row sampled, or every row greedy
    for req in llm.requests.values():
        req.params = replace(req.params, temperature=0.8 if sampled else 0.0, top_p=0.95 if sampled else 1.0)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_steps(llm: LLM, device: str, steps: int) -> list[float]:
    out = []
    for i in range(steps + 3):
        sync(device)
        t = time.perf_counter()
        llm.step()
        sync(device)
        if i >= 3:  # warm-up: a mode's first steps compile or refill
            out.append(time.perf_counter() - t)
    return out


def kv_bytes_per_token(llm: LLM) -> int:
    return llm.kv_spec.bytes_per_page() // llm.kv_spec.page_size  # K and V over all layers, as stored


class TimedGraph:
    """A bucket's CUDA graph with CUDA events around each replay (the GPU's share of a step)."""

    def __init__(self, graph, times: list):
        self.graph, self.times = graph, times

    def replay(self) -> None:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        self.graph.replay()
        e.record()
        self.times.append((s, e))


def time_graphs(graphs) -> list:
    times: list = []
    for bk in graphs.buckets.values():
        if bk.graph is not None:
            bk.graph = TimedGraph(getattr(bk.graph, "graph", bk.graph), times)
    return times


def verify_ratio(llm: LLM, device: str, rids: list[str], k: int, steps: int) -> dict:
    """A static verify step of 1 + k tokens a row vs a static plain decode step, same rows, both CUDA graphs
    (their own GraphDecode, verify buckets captured): the verify-step cost the issue bounds. The rows'
    last k + 1 written slots are re-run (their KV rewritten in place; the requests are aborted after)."""
    from engine.batch import SeqStep, StepBatch
    from engine.kernels.cuda.graph_decode import GraphDecode

    set_mode(llm, "triton", None)  # the Triton path (the last mode timed may have been torch's)
    g = GraphDecode(llm.model, llm.backend, llm.kv_spec.page_size, len(rids), llm.max_model_len,
                    use_graphs=device.startswith("cuda"), verify_len=k + 1)
    capture = g.capture()

    def batch_of(q: int) -> StepBatch:
        seqs = []
        for r in rids:
            req, table = llm.requests[r], llm.tables.get(r)
            n = table.num_slots - q
            seqs.append(SeqStep(r, req.token_ids[n:n + q], n, n, list(table.pages), list(range(q))))
        return StepBatch(seqs, return_logits=True)

    out = {}
    for name, q in (("plain", 1), ("verify", k + 1)):
        b = batch_of(q)
        times = []
        for i in range(steps + 3):
            sync(device)
            t = time.perf_counter()
            g.execute(b)
            sync(device)
            if i >= 3:
                times.append(time.perf_counter() - t)
        out[name] = statistics.median(times)
    row = {"mode": "verify", "batch": len(rids), "k": k, "plain_ms": round(out["plain"] * 1e3, 3),
           "verify_ms": round(out["verify"] * 1e3, 3), "verify_over_plain": round(out["verify"] / out["plain"], 2),
           "capture_s": round(capture, 2)}
    print(json.dumps(row), flush=True)
    return row


def run_batch(llm: LLM, device: str, batch: int, context: int, steps: int, modes, graphs, bw: float,
              verify_k: int = 0) -> list[dict]:
    vocab = llm.config.vocab_size
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=headroom(batch, (steps + 3) * len(modes)), temperature=0.0, ignore_eos=True)
    rids = [llm.add_request(torch.randint(3, vocab, (context,), generator=g).tolist(), params) for _ in range(batch)]
    set_mode(llm, "triton", graphs)
    while any(llm.requests[r].num_computed < context for r in rids):
        llm.step()  # every prompt prefilled; decoding starts below
    unread, touched = unread_expert_bytes(llm, batch)
    rows, weights = [], llm.model.weight_bytes() - unread  # MoE: the floor reads only the touched experts
    for mode in modes:
        set_mode(llm, mode, graphs)
        ctx0 = statistics.mean(llm.requests[r].num_computed for r in rids)
        replays = time_graphs(graphs) if mode in GRAPH_MODES and graphs is not None and graphs.use_graphs else None
        times = time_steps(llm, device, steps)
        ctx1 = statistics.mean(llm.requests[r].num_computed for r in rids)
        floor = (weights + batch * (ctx0 + ctx1) / 2 * kv_bytes_per_token(llm)) / bw
        med = statistics.median(times)
        rows.append({"batch": batch, "mode": mode, "context": round((ctx0 + ctx1) / 2), "steps": len(times),
                     "median_ms": round(med * 1e3, 3), "p90_ms": round(sorted(times)[int(0.9 * len(times))] * 1e3, 3),
                     "floor_ms": round(floor * 1e3, 3), "ratio": round(med / floor, 2),
                     "kv": llm.kv_spec.storage_format})
        if touched:
            rows[-1]["experts_touched"] = round(touched, 1)
        if replays:
            gpu = statistics.median(s.elapsed_time(e) for s, e in replays[-steps:])
            rows[-1].update(gpu_ms=round(gpu, 3), host_ms=round(med * 1e3 - gpu, 3))
    greedy = [r["median_ms"] for r in rows if r["mode"] == "graphs"]
    for r in rows:
        if r["mode"] in GRAPH_MODES[1:] and greedy:
            r["over_greedy"] = round(r["median_ms"] / greedy[0], 3)
    if verify_k:
        rows.append(verify_ratio(llm, device, rids, verify_k, steps))
        print(json.dumps(rows[-1]), flush=True)
    for r in rids:
        llm.abort(r)
    set_mode(llm, "graphs", graphs)
    return rows


def static_step(llm: LLM, max_batch: int):
    """CPU dry runs: the graphs' static step, run eagerly."""
    from engine.kernels.cuda.graph_decode import GraphDecode

    return GraphDecode(llm.model, llm.backend, llm.kv_spec.page_size, max_batch, llm.max_model_len, use_graphs=False,
                       sampler=llm.runner.sampler)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama-3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batches", default="1,16,64,128")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--verify", type=int, default=0, metavar="K",
                    help="also a static verify step of 1 + K tokens a row vs a plain one, at batch 16")
    ap.add_argument("--kv", default="", help="int8: also int8-page rows at the largest batch (graphs mode)")
    ap.add_argument("--sparse", type=int, default=0, metavar="BUDGET",
                    help="also Quest rows (token budget BUDGET) at the largest batch, beside full attention")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in a.batches.split(",")]
    modes = [m for m in a.modes.split(",") if m]
    bw = copy_bandwidth(a.device)
    result = {"model": a.model, "device": a.device, "torch": torch.__version__, "copy_bytes_per_s": bw,
              "gpu": torch.cuda.get_device_name() if a.device.startswith("cuda") else None, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        t = time.monotonic()
        llm = build(a.model, a.device, max(batches), a.context, (a.steps + 3) * len(modes), Path(tmp))
        result["load_s"] = round(time.monotonic() - t, 1)
        graphs = llm.decode_graphs
        result["capture_s"] = round(graphs.capture_s, 2) if graphs else None
        result["sampler_error"] = graphs.sampler_error if graphs else None  # sampling graphs not captured
        if graphs is None and set(modes) & set(GRAPH_MODES):
            graphs = static_step(llm, max(batches))
        print(f"copy bandwidth {bw / 1e12:.2f} TB/s; load {result['load_s']} s; capture {result['capture_s']} s",
              flush=True)
        for b in batches:
            result["rows"].extend(run_batch(llm, a.device, b, a.context, a.steps, modes, graphs, bw,
                                            a.verify if b == 16 else 0))
        if a.kv:
            del llm, graphs
            if a.device.startswith("cuda"):
                torch.cuda.empty_cache()
            llm = build(a.model, a.device, max(batches), a.context, (a.steps + 3) * len(modes), Path(tmp), a.kv)
            result["rows"].extend(run_batch(llm, a.device, max(batches), a.context, a.steps, ["graphs"],
                                            llm.decode_graphs, bw))
        if a.sparse:
            del llm, graphs
            if a.device.startswith("cuda"):
                torch.cuda.empty_cache()
            cfg = {"method": "quest", "budget": a.sparse}
            llm = build(a.model, a.device, max(batches), a.context, (a.steps + 3) * len(modes), Path(tmp),
                        sparse=cfg)
            quest_modes = [m for m in ("graphs", "triton") if m in modes]  # graphs: the choice on the device
            rows = run_batch(llm, a.device, max(batches), a.context, a.steps, quest_modes,
                             llm.decode_graphs or static_step(llm, max(batches)), bw)
            full = [r for r in result["rows"] if r["batch"] == max(batches) and r["mode"] in ("graphs", "triton")]
            for r in rows:
                r["kv"] = f"quest{a.sparse}"
                r["over_full"] = {f["mode"]: round(r["median_ms"] / f["median_ms"], 3) for f in full}
                print(json.dumps(r), flush=True)
            result["rows"].extend(rows)
    tag = a.model.replace(":", "_").replace("/", "_")
    (a.out / f"floor_{tag}.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


def table(result: dict) -> str:
    where = result['gpu'] or result['device']
    lines = [f"{result['model']} on {where}, copy {result['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
             f"graph capture {result['capture_s']} s",
             "| batch | context | KV | mode | step ms | GPU ms | host ms | floor ms | step / floor |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["mode"] == "verify":
            lines.append(f"| {r['batch']} | | | verify k={r['k']} | {r['verify_ms']} | | | plain {r['plain_ms']} | "
                         f"{r['verify_over_plain']} (verify / plain) |")
            continue
        mode = r["mode"] + (f" ({r['over_greedy']}x greedy)" if "over_greedy" in r else "")
        lines.append(f"| {r['batch']} | {r['context']} | {r['kv']} | {mode} | {r['median_ms']} | "
                     f"{r.get('gpu_ms', '')} | {r.get('host_ms', '')} | {r['floor_ms']} | {r['ratio']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
