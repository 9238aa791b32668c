"""`pdserve bench`: the flags, and how they become a workload, targets and a run (registered by cluster/cli.py).

    pdserve bench --spec deploy/local.yaml --workload azure-code --rates 0.5,1,2 --num-requests 40
    pdserve bench --endpoint http://127.0.0.1:8000 --workload random:input=256,output=64 --rate 1
    pdserve bench --compare deploy/local.yaml deploy/colocated.yaml --workload azure-code \\
        --rates 0.5,1,2 --ttft-ms 3x --tpot-ms 3x --set pools.colocated.max_num_batched_tokens=256,512,1024

`_bench` order: parse SLOs and rates -> load the workload -> tokenizer + prompt source -> targets (spec
variants, or the endpoint) -> runner.run_bench -> report.write_report -> print the markdown summary.
`register` stays cheap: everything heavy is imported inside `_bench`.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

from cluster.bench.qoe import EXPECTED_TTFT_S, READING_TDS  # plain constants: a cheap import

EPILOG = """\
SLOs: --ttft-ms/--tpot-ms take ms (2000) or a multiple of the unloaded p90 the tool measures first on the
SLO reference (3x; the reference is the spec/endpoint, or the --slo-from spec of --compare, default the
second one: `--compare NEW BASELINE` prints goodput NEW/BASELINE). Attainment counts failed requests as
missing and judges 1-token requests on TTFT alone. Goodput: the highest rate with attainment >= --attainment,
searched over --rates and then bisected (--bisect steps). Trace lengths are scaled (--input-scale 0.25,
--output-scale 0.5, clipped to --max-input 1024 / --max-output 256) and the time axis is scaled to each rate.
pdserve options (ignore_eos, timeline, token ids) go to --spec/--compare servers; to an --endpoint only
with --pdserve-options (use --extra-body '{"ignore_eos": true}' for vLLM).
QoE (Andes, arXiv 2404.16283): per request, how a reader expecting the first token after --qoe-ttft s and
then --qoe-pace tokens/s experiences the stream (1 = no token read late, a failed request 0); its mean,
percentiles and share >= 0.9 per probe in summary.md/bench.json, and qoe_cdf.png."""


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def add_arguments(b: argparse.ArgumentParser) -> None:
    mode = b.add_mutually_exclusive_group(required=True)
    mode.add_argument("--spec", help="start `pdserve serve SPEC` on a free port, bench it, stop it")
    mode.add_argument("--endpoint", help="bench a running OpenAI-compatible server (http://host:port)")
    mode.add_argument("--compare", nargs=2, metavar=("SPEC_A", "SPEC_B"),
                      help="both specs one after the other, same workload/seeds/SLOs; prints goodput A/B")
    b.add_argument("--workload", default="random:input=256,output=64",
                   help="azure-code | azure-conv | mooncake | a trace path | random:input=N,output=N,"
                        "range=R,dist=uniform|lognormal,sigma=S,burstiness=B (default %(default)s)")
    rates = b.add_mutually_exclusive_group()
    rates.add_argument("--rate", type=float, help="one request rate (req/s); default: a trace's own, else 1")
    rates.add_argument("--rates", type=_floats, help="rates to measure, then bisect for goodput: 0.5,1,2")
    b.add_argument("--num-requests", type=int, default=50, help="requests per rate (default %(default)s)")
    b.add_argument("--min-probe-s", type=float, default=0.0,
                   help="each probe sends at least this many seconds of arrivals (max(--num-requests, rate x S) "
                        "requests); ~3x the TTFT SLO lets a growing queue show before a fast probe ends")
    b.add_argument("--duration", type=float, help="send only requests arriving within this many seconds")
    b.add_argument("--seed", type=int, default=0, help="synthetic workload seed (default %(default)s)")
    b.add_argument("--ttft-ms", default="3x", help="TTFT target: ms, or Nx the unloaded p90 (default %(default)s)")
    b.add_argument("--tpot-ms", default="3x", help="TPOT target: ms, or Nx the unloaded p90 (default %(default)s)")
    b.add_argument("--attainment", type=float, default=0.9, help="goodput attainment target (default 0.9)")
    b.add_argument("--bisect", type=int, default=3, help="bisection steps after --rates (default 3; 0: none)")
    b.add_argument("--slo-from", choices=["a", "b"], default="b", help="--compare: whose unloaded run sets SLOs")
    b.add_argument("--slo-scales", type=_floats, default=[1.5, 2, 3, 4, 5, 6, 8, 10],
                   help="SLO scales of the compare sweep plot (default 1.5..10)")
    b.add_argument("--set", action="append", default=[], metavar="KEY=V1,V2",
                   help="sweep a spec key, e.g. pools.colocated.max_num_batched_tokens=256,512,1024 "
                        "(specs without the key are left alone); repeatable")
    b.add_argument("--out", help="output folder (default bench/out/bench-<time>)")
    b.add_argument("--unloaded-requests", type=int, default=8, help="sequential requests for the unloaded p90")
    b.add_argument("--warmup", type=int, default=2, help="discarded sequential requests per target")
    b.add_argument("--timeout", type=float, default=300.0, help="per-request client timeout, s")
    b.add_argument("--input-scale", type=float, default=0.25, help="trace prompt length factor")
    b.add_argument("--output-scale", type=float, default=0.5, help="trace output length factor")
    b.add_argument("--max-input", type=int, default=1024, help="trace prompt length cap (tokens)")
    b.add_argument("--max-output", type=int, default=256, help="trace output length cap (tokens)")
    b.add_argument("--trace-start", type=int, default=0, help="first trace row to replay")
    b.add_argument("--trace-stride", type=int, default=1,
                   help="replay every k-th trace row (1: a contiguous slice; k thins bursts over a k-times "
                        "longer window)")
    b.add_argument("--tokenizer", default=None, help="model whose tokenizer builds prompts (default: the "
                   "spec's model, else smollm2-135m)")
    b.add_argument("--model", help="--endpoint: model name to request (default: the first /v1/models lists)")
    b.add_argument("--api-key", help="--endpoint: bearer token")
    b.add_argument("--label", help="--endpoint: name in tables and plots (default: the URL)")
    b.add_argument("--prompt-format", choices=["ids", "text"], default="ids",
                   help="send token-id lists (exact lengths) or decoded text")
    b.add_argument("--pdserve-options", action="store_true", help="--endpoint is pdserve: send its options")
    b.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    b.add_argument("--qoe-pace", type=float, default=READING_TDS, metavar="TOKENS_PER_S",
                   help="QoE: the reader's expected token delivery speed (default %(default)s, the Andes "
                        "paper's reading speed; 3.3 is its listening speed)")
    b.add_argument("--qoe-ttft", type=float, default=EXPECTED_TTFT_S, metavar="S",
                   help="QoE: the reader's expected time to first token, s (default %(default)s)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("--no-early-stop", action="store_true",
                   help="run every probe to the end even when it can no longer reach the attainment target")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add this subpackage's subcommands; keep it cheap (no heavy imports here)."""
    b = subparsers.add_parser("bench", help="SLO attainment and goodput over the HTTP API (open loop)",
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(b)
    b.set_defaults(func=_bench)


def _spec_model(path: str) -> str:
    from pathlib import Path

    import yaml

    return (yaml.safe_load(Path(path).read_text()) or {}).get("model", "smollm2-135m")


def _endpoint_model(url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    root = url.rstrip("/").removesuffix("/v1")
    r = httpx.get(f"{root}/v1/models", headers=headers, timeout=30.0)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _targets(args, out_dir):
    from pathlib import Path

    from cluster.bench.loadgen import Target
    from cluster.bench.runner import BenchTarget
    from cluster.bench.server import spec_variants

    if args.endpoint:
        extra = json.loads(args.extra_body)
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
        model = args.model or _endpoint_model(args.endpoint, args.api_key)
        t = Target(args.endpoint, model, args.pdserve_options, args.api_key, extra, args.timeout)
        label = args.label or args.endpoint.split("//")[-1].rstrip("/")
        return [BenchTarget(label, target=t, reference=True, group=label)], None
    paths = [args.spec] if args.spec else list(args.compare)
    tmp = out_dir / "specs"
    tmp.mkdir(parents=True, exist_ok=True)
    per_spec = spec_variants(paths, args.set, tmp)
    ref_index = 0 if args.spec or args.slo_from == "a" else 1
    stems = [Path(p).stem for p in paths]
    same = len(set(stems)) < len(stems)  # the same spec twice: keep the two sides apart
    targets = []
    for i, variants in enumerate(per_spec):
        prefix = f"{'AB'[i]}:" if same else ""
        for j, v in enumerate(variants):
            targets.append(BenchTarget(prefix + v.label, variant=v, reference=(i == ref_index and j == 0),
                                       group=prefix + stems[i]))
    order = list(dict.fromkeys(t.group for t in targets)) if args.compare else None
    return targets, order


def _bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cluster.bench.prompts import PromptSource, load_tokenizer
    from cluster.bench.qoe import QoESetting
    from cluster.bench.report import write_probe, write_report
    from cluster.bench.runner import BenchConfig, SLOSetting, run_bench
    from cluster.bench.server import BenchServerError
    from cluster.bench.workload import TraceScaling, WorkloadError, load_workload

    try:
        ttft, tpot = SLOSetting.parse(args.ttft_ms), SLOSetting.parse(args.tpot_ms)
        scaling = TraceScaling(args.input_scale, args.output_scale, max_input=args.max_input,
                               max_output=args.max_output)
        if args.min_probe_s < 0:
            raise ValueError("--min-probe-s must be >= 0")
        qoe = QoESetting(args.qoe_ttft, args.qoe_pace)
        expand = 2 if args.bisect else 0  # doublings of the top rate the goodput search may probe
        top_rate = max([r for r in (args.rates or [args.rate]) if r] or [1.0]) * 2 ** expand
        n_load = max(args.num_requests, math.ceil(top_rate * args.min_probe_s))  # enough for the top probe
        workload = load_workload(args.workload, n_load, args.seed, scaling, args.trace_start, args.trace_stride)
    except (ValueError, WorkloadError) as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    if any(r <= 0 for r in (args.rates or [])) or (args.rate is not None and args.rate <= 0):
        print("pdserve bench: rates must be > 0", file=sys.stderr)
        return 2
    rates = args.rates or [args.rate if args.rate else (None if workload.native_rate else 1.0)]
    out_dir = Path(args.out or f"bench/out/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = BenchConfig(rates, ttft, tpot, target_attainment=args.attainment, bisect_steps=args.bisect,
                      expand=expand, duration_s=args.duration, warmup=args.warmup,
                      num_requests=args.num_requests, min_probe_s=args.min_probe_s,
                      unloaded_requests=args.unloaded_requests, slo_scales=args.slo_scales,
                      progress=not args.no_progress, early_stop=not args.no_early_stop, timeout_s=args.timeout,
                      out_dir=out_dir, qoe=qoe)
    import httpx

    try:
        targets, order = _targets(args, out_dir)
    except (ValueError, OSError, httpx.HTTPError, KeyError, IndexError) as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 2
    tok_model = args.tokenizer or (_spec_model(args.spec or args.compare[0]) if not args.endpoint else "smollm2-135m")
    source = PromptSource(load_tokenizer(tok_model))
    blocks = workload.block_tokens
    prompt_of = (lambda s: source.prompt(s, blocks)) if args.prompt_format == "ids" else \
        (lambda s: source.tokenizer.decode(source.prompt(s, blocks)))
    try:
        result = run_bench(cfg, workload, prompt_of, targets, lambda t, run: write_probe(out_dir, t, run, qoe))
    except BenchServerError as e:
        print(f"pdserve bench: {e}", file=sys.stderr)
        return 1
    if result.slo is None:
        print("pdserve bench: interrupted before the SLOs were set; nothing to report", file=sys.stderr)
        return 130
    files = write_report(result, out_dir, order, {k: v for k, v in vars(args).items() if k != "func"})
    print(files["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in files.values()))
    return 130 if result.interrupted else 0
