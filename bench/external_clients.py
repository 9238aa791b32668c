"""Real clients agree: GuideLLM and AIPerf against `pdserve serve`, beside `pdserve bench`'s own load
generator, at the same rates on the same synthetic workload (issue 22).

    python bench/external_clients.py                       # deploy/local.yaml, 0.5 and 1 req/s, 20 requests
    python bench/external_clients.py --rates 0.5,1 --num-requests 30 --input 256 --output 64 --out DIR
    python bench/external_clients.py --parse-only DIR      # the table again from a finished run's files
    python bench/external_clients.py --install-only        # just build the clients' venvs

Order:
  1. one throwaway venv per client (default ~/.cache/pdserve/external-clients/<client>, `python -m venv`,
     never the project's): the pinned client, plus for GuideLLM the project's own torch version (no CUDA
     build on a CPU machine); reused while its stamp (the requirements) matches.
  2. `pdserve serve SPEC` (with any `--set KEY=VALUE`) on a free port (cluster/bench/server.py); warm-up.
  3. per rate, one after the other on the same server, each sending --num-requests requests at a
     constant rate with --input prompt tokens and exactly --output output tokens (ignore_eos):
       pdserve   cluster/bench/loadgen.py (token-id prompts of exact length; options under `pdserve`)
       guidellm  `guidellm run --scenario` (constant profile, synthetic_text, max_requests; it always sends
                 top-level `ignore_eos: true`, `stop: null`, stream_options.continuous_usage_stats; text prompts)
       aiperf    `aiperf profile` (constant arrival pattern, synthetic text prompts with stddev 0,
                 `--extra-inputs ignore_eos:true` at the top level, server token counts)
  4. each client's JSON (GuideLLM's benchmarks.json, AIPerf's profile_export_aiperf.json) is parsed and a
     table printed: client x rate x {TTFT p50/p90, ITL p50/p90, completed/sent}, each ratio against
     pdserve bench at the same rate; also written to DIR/summary.md and DIR/results.json.
Acceptance (issue 22): every client completes every request at both rates, and its TTFT and ITL p50 are
within 10% of pdserve bench's.

Each number is the tool's own. ITL: pdserve bench's TPOT, (last token - first) / (tokens - 1) per request,
linear-interpolated percentiles; GuideLLM's inter_token_latency_ms, the same per request, its distribution
weighted by tokens - 1 (equal weights at a fixed output length), nearest-rank percentiles; AIPerf's
inter_token_latency, (request latency - TTFT) / (tokens - 1). TTFT: first token-carrying chunk minus send,
for all three. The clients run on the same cores as the server: AIPerf with one worker and one record
processor to keep its footprint near the others'.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

CLIENTS = {"guidellm": "guidellm==0.8.1", "aiperf": "aiperf==0.13.0"}
NEEDS_TORCH = {"guidellm"}  # its data loader imports torch
ACCEPT_P50 = 0.10  # the issue's bound on |client p50 / pdserve p50 - 1|


@dataclass
class ClientResult:
    client: str
    rate: float
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p90_ms: float | None = None
    completed: int = 0
    sent: int = 0  # requests asked for
    error: str | None = None  # the run or its parse failed
    source: str | None = None  # the file the numbers came from


# ---- parsers (pure: a loaded JSON document in, a ClientResult out) --------------------------------
def _num(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def parse_guidellm(doc: dict, rate: float, sent: int) -> ClientResult:
    """GuideLLM 0.8 `benchmarks.json` (GenerativeBenchmarksReport) with one benchmark (one rate)."""
    benches = doc.get("benchmarks") or []
    if len(benches) != 1:
        return ClientResult("guidellm", rate, sent=sent, error=f"expected 1 benchmark, found {len(benches)}")
    m = benches[0]["metrics"]

    def pct(key: str, p: str) -> float | None:
        ok = (m.get(key) or {}).get("successful") or {}
        return _num((ok.get("percentiles") or {}).get(p)) if ok.get("count") else None

    totals = m.get("request_totals") or {}
    return ClientResult("guidellm", rate, pct("time_to_first_token_ms", "p50"), pct("time_to_first_token_ms", "p90"),
                        pct("inter_token_latency_ms", "p50"), pct("inter_token_latency_ms", "p90"),
                        int(totals.get("successful") or 0), max(sent, int(totals.get("total") or 0)))


def parse_aiperf(doc: dict, rate: float, sent: int) -> ClientResult:
    """AIPerf 0.13 `profile_export_aiperf.json`: one object per metric tag, values in its `unit` (ms for
    the latencies), `request_count` = successful requests, `error_request_count` = failed ones."""
    def stat(tag: str, key: str) -> float | None:
        m = doc.get(tag) or {}
        scale = {"ms": 1.0, "s": 1000.0, "us": 1e-3, "ns": 1e-6, "requests": 1.0}.get(m.get("unit", "ms"))
        if scale is None:
            raise ValueError(f"aiperf {tag}: unknown unit {m.get('unit')!r}")
        return None if (v := _num(m.get(key))) is None else v * scale

    ok = int(stat("request_count", "avg") or 0)
    failed = int(_num((doc.get("error_request_count") or {}).get("avg")) or 0)
    return ClientResult("aiperf", rate, stat("time_to_first_token", "p50"), stat("time_to_first_token", "p90"),
                        stat("inter_token_latency", "p50"), stat("inter_token_latency", "p90"), ok,
                        max(sent, ok + failed))


def pdserve_result(records: list, rate: float) -> ClientResult:
    from cluster.bench.metrics import summarize

    s = summarize(records, math.inf, math.inf)
    return ClientResult("pdserve", rate, _num(s.ttft_ms["p50"]), _num(s.ttft_ms["p90"]), _num(s.tpot_ms["p50"]),
                        _num(s.tpot_ms["p90"]), s.completed, s.requests)


# ---- the table --------------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def verdict(r: ClientResult, base: ClientResult | None) -> str:
    """'ok' when the issue's acceptance holds for this row, else what fails."""
    if r.error:
        return r.error.splitlines()[0][:80].replace("|", "/")
    bad = [] if r.completed == r.sent else [f"{r.sent - r.completed} failed"]
    for name, key in (("TTFT", "ttft_p50_ms"), ("ITL", "itl_p50_ms")):
        q = _ratio(getattr(r, key), getattr(base, key) if base else None)
        if r.client != "pdserve" and (q is None or abs(q - 1.0) > ACCEPT_P50):
            bad.append(f"{name} p50 x{_f(q, '.2f')}")
    return "ok" if not bad else ", ".join(bad)


def table(results: list[ClientResult]) -> str:
    base = {r.rate: r for r in results if r.client == "pdserve" and not r.error}
    lines = ["| client | rate (req/s) | TTFT p50 / p90 (ms) | ITL p50 / p90 (ms) | completed/sent "
             "| TTFT p50, p90 vs pdserve | ITL p50, p90 vs pdserve | acceptance |", "|---|---|---|---|---|---|---|---|"]
    order = ["pdserve", *CLIENTS]
    for r in sorted(results, key=lambda r: (r.rate, order.index(r.client))):
        b = base.get(r.rate)
        rt = lambda k: _f(_ratio(getattr(r, k), getattr(b, k) if b else None), ".2f")  # noqa: E731
        lines.append(f"| {r.client} | {r.rate:g} | {_f(r.ttft_p50_ms, '.0f')} / {_f(r.ttft_p90_ms, '.0f')} "
                     f"| {_f(r.itl_p50_ms, '.1f')} / {_f(r.itl_p90_ms, '.1f')} | {r.completed}/{r.sent} "
                     f"| {rt('ttft_p50_ms')}, {rt('ttft_p90_ms')} | {rt('itl_p50_ms')}, {rt('itl_p90_ms')} "
                     f"| {verdict(r, b)} |")
    return "\n".join(lines)


# ---- the clients' commands ---------------------------------------------------------------------------
def guidellm_scenario(url: str, model: str, tokenizer: str, rate: float, n: int, n_in: int, n_out: int,
                      out: Path, timeout_s: float, seed: int = 0) -> dict:
    return {"spec": {
        "backend": {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/completions",
                    "http2": False, "timeout": timeout_s},
        "profile": {"kind": "constant", "rate": [rate]},
        "constraints": [{"kind": "max_requests", "count": n}],
        "tokenizer": {"kind": "huggingface_auto", "model": tokenizer},
        "data": [{"kind": "synthetic_text", "prompt_tokens": n_in, "output_tokens": n_out}],
        "seed": {"kind": "static", "value": seed},
        "outputs": [{"kind": "json", "path": str(out)}]}}


def aiperf_argv(url: str, model: str, tokenizer: str, rate: float, n: int, n_in: int, n_out: int,
                out_dir: Path, timeout_s: float, seed: int = 0) -> list[str]:
    return ["profile", "--model", model, "--url", url, "--endpoint-type", "completions", "--streaming",
            "--tokenizer", tokenizer, "--synthetic-input-tokens-mean", str(n_in),
            "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(n_out),
            "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
            "--request-rate", f"{rate:g}", "--arrival-pattern", "constant", "--request-count", str(n),
            "--request-timeout-seconds", f"{timeout_s:g}", "--random-seed", str(seed),
            "--artifact-dir", str(out_dir), "--ui", "none", "--workers-max", "1", "--record-processors", "1",
            "--no-server-metrics", "--no-auto-plot"]


def client_env(hub_offline: bool = True) -> dict[str, str]:
    """No hub (the tokenizer is a local directory), one thread and one worker process (the clients share the
    cores with the server), none of the project's paths."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", GUIDELLM__MAX_WORKER_PROCESSES="1")  # not 10
    if hub_offline:  # AIPerf's offline mode looks a tokenizer up in the hub cache only, never at a local path
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return env


def requirements(client: str) -> list[str]:
    from importlib.metadata import version

    # GuideLLM needs torch: the project's own version, so a CPU machine gets no CUDA build
    return [CLIENTS[client]] + ([f"torch=={version('torch')}"] if client in NEEDS_TORCH else [])


def ensure_venv(client: str, root: Path) -> Path:
    """The client's venv (created and installed if its stamp is missing or stale); returns its bin dir."""
    venv, reqs = root / client, requirements(client)
    stamp, want = venv / ".external-client", json.dumps(reqs)
    if stamp.exists() and stamp.read_text() == want:
        return venv / "bin"
    print(f"[clients] installing {' '.join(reqs)} into {venv} (a few minutes, once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *reqs], check=True,
                   env=client_env())
    stamp.write_text(want)
    return venv / "bin"


def _run(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> str | None:
    """Run a client to completion; None if it exited 0, else why not (with the log's tail). The client
    gets its own process group, so a timeout or Ctrl-C stops it and what it started (AIPerf's services)."""
    with log.open("w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=env or client_env(), start_new_session=True)
        try:
            rc = p.wait(timeout_s)
        except BaseException as e:  # the timeout, or Ctrl-C (its own group does not see the terminal's)
            for sig, wait_s in ((signal.SIGINT, 30.0), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(p.pid, sig)  # the group this call started, nothing else
                    p.wait(wait_s)
                    break
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    continue
            if not isinstance(e, subprocess.TimeoutExpired):
                raise
            rc = f"timeout after {timeout_s:g} s"
    if rc == 0:
        return None
    tail = log.read_text(errors="replace")[-600:].strip().replace("\n", " / ")
    return f"exit {rc} ({log}): {tail}"


def run_guidellm(bin_dir: Path, ctx: dict, rate: float, out: Path) -> ClientResult:
    path = out / f"guidellm@{rate:g}.json"
    scenario = out / f"guidellm@{rate:g}.scenario.json"
    scenario.write_text(json.dumps(guidellm_scenario(ctx["url"], ctx["model"], ctx["tokenizer"], rate, ctx["n"],
                                                     ctx["input"], ctx["output"], path, ctx["timeout"]), indent=1))
    err = _run([str(bin_dir / "guidellm"), "run", "--scenario", str(scenario), "--disable-console-interactive"],
               out / f"guidellm@{rate:g}.log", ctx["n"] / rate + ctx["timeout"] + 120)
    return read_result("guidellm", rate, ctx["n"], out, err)


def run_aiperf(bin_dir: Path, ctx: dict, rate: float, out: Path) -> ClientResult:
    argv = aiperf_argv(ctx["url"], ctx["model"], ctx["tokenizer"], rate, ctx["n"], ctx["input"], ctx["output"],
                       out / f"aiperf@{rate:g}", ctx["timeout"])
    err = _run([str(bin_dir / "aiperf"), *argv], out / f"aiperf@{rate:g}.log", ctx["n"] / rate + ctx["timeout"] + 180,
               client_env(hub_offline=False))
    return read_result("aiperf", rate, ctx["n"], out, err)


def read_result(client: str, rate: float, sent: int, out: Path, err: str | None = None) -> ClientResult:
    """Parse what a client left in `out` for `rate` (its run's error, if any, is kept)."""
    if client == "guidellm":
        files = [out / f"guidellm@{rate:g}.json"]
    else:
        files = sorted((out / f"aiperf@{rate:g}").rglob("profile_export_aiperf.json"), key=lambda p: p.stat().st_mtime)
    files = [f for f in files if f.exists()]
    if not files:
        return ClientResult(client, rate, sent=sent, error=err or f"{client} wrote no JSON under {out}")
    parse = parse_guidellm if client == "guidellm" else parse_aiperf
    try:
        r = parse(json.loads(files[-1].read_text()), rate, sent)
    except (ValueError, KeyError, TypeError) as e:
        r = ClientResult(client, rate, sent=sent, error=f"cannot parse {files[-1]}: {e}")
    r.source, r.error = str(files[-1]), err or r.error
    return r


# ---- pdserve bench's own load generator ----------------------------------------------------------------
def run_pdserve(ctx: dict, rate: float, round_no: int, warm_up: bool = False) -> tuple[ClientResult, list]:
    """N requests at `rate` (constant gaps); `warm_up`: 3 requests one at a time, prompts of a round no
    probe uses (a prefix cache must not serve a probe from them)."""
    from cluster.bench.loadgen import Target, run_load, run_sequential
    from cluster.bench.workload import RequestSpec

    n = 3 if warm_up else ctx["n"]
    reqs = [RequestSpec(i, i / rate, ctx["input"], ctx["output"], (), round_no) for i in range(n)]
    target = Target(ctx["url"], ctx["model"], pdserve=True, timeout_s=ctx["timeout"])
    records = asyncio.run((run_sequential if warm_up else run_load)(reqs, ctx["source"].prompt, target))
    return pdserve_result(records, rate), records


# ---- the run ------------------------------------------------------------------------------------------------
RUNNERS = {"guidellm": run_guidellm, "aiperf": run_aiperf}


def measure(args, bins: dict[str, Path], out: Path) -> list[ClientResult]:
    from cluster.bench.prompts import PromptSource, load_tokenizer
    from cluster.bench.server import SpecServer, spec_variants
    from engine.loader import resolve_model

    [[variant]] = spec_variants([args.spec], args.set, out)  # one value per --set: one variant
    model_name = (yaml.safe_load(Path(variant.path).read_text()) or {}).get("model", "smollm2-135m")
    tok_dir = str(resolve_model(model_name))  # a local HF directory: the clients' tokenizer, no hub
    results: list[ClientResult] = []
    with SpecServer(variant.path, out / "server.log") as srv:
        print(f"[clients] serving {srv.model} at {srv.base_url}", flush=True)
        ctx = {"url": srv.base_url, "model": srv.model, "tokenizer": tok_dir, "n": args.num_requests,
               "input": args.input, "output": args.output, "timeout": args.timeout,
               "source": PromptSource(load_tokenizer(model_name))}
        run_pdserve(ctx, 1.0, 99, warm_up=True)
        for k, rate in enumerate(args.rates):
            r, records = run_pdserve(ctx, rate, k)
            (out / f"pdserve@{rate:g}.json").write_text(json.dumps([asdict(x) for x in records]))
            results.append(r)
            _say(r)
            for client in args.clients:
                time.sleep(args.gap)  # let the last run's stragglers and aborts clear
                results.append(RUNNERS[client](bins[client], ctx, rate, out))
                _say(results[-1])
    return results


def _say(r: ClientResult) -> None:
    print(f"[clients] {r.client} @ {r.rate:g} req/s: TTFT p50 {_f(r.ttft_p50_ms, '.0f')} ms, ITL p50 "
          f"{_f(r.itl_p50_ms, '.1f')} ms, {r.completed}/{r.sent} ok" + (f" -- {r.error[:300]}" if r.error else ""),
          flush=True)


def report(results: list[ClientResult], out: Path, args_doc: dict) -> str:
    md = table(results)
    (out / "results.json").write_text(json.dumps({"args": args_doc, "results": [asdict(r) for r in results]},
                                                 indent=1))
    (out / "summary.md").write_text("# GuideLLM and AIPerf beside pdserve bench\n\n" + md + "\n")
    return md


def reparse(out: Path) -> tuple[list[ClientResult], dict]:
    """--parse-only: the pdserve rows from results.json, the clients' rows parsed again from their files
    (a run's own error, say an exit code, is not kept: only what its files say), and the run's args."""
    doc = json.loads((out / "results.json").read_text())
    rows = [ClientResult(**r) for r in doc["results"]]
    return [r if r.client == "pdserve" else read_result(r.client, r.rate, r.sent, out) for r in rows], doc["args"]


def _floats(text: str) -> list[float]:
    if not (vals := [float(x) for x in text.split(",") if x.strip()]) or min(vals) <= 0:
        raise argparse.ArgumentTypeError(f"rates must be > 0, got {text!r}")
    return vals


def _clients(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if unknown := set(names) - set(CLIENTS):
        raise argparse.ArgumentTypeError(f"unknown client(s) {sorted(unknown)}; known: {list(CLIENTS)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", default="deploy/local.yaml", help="spec `pdserve serve` runs (default %(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a spec key for this run, e.g. dtype=float32 (repeatable; one value each)")
    p.add_argument("--rates", type=_floats, default=[0.5, 1.0], help="req/s, comma-separated (default 0.5,1)")
    p.add_argument("--num-requests", type=int, default=20, help="requests per client and rate (default %(default)s)")
    p.add_argument("--input", type=int, default=256, help="prompt tokens (default %(default)s)")
    p.add_argument("--output", type=int, default=64, help="output tokens, fixed by ignore_eos (default %(default)s)")
    p.add_argument("--clients", type=_clients, default=list(CLIENTS), help="guidellm,aiperf (default both)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, s (default %(default)s)")
    p.add_argument("--gap", type=float, default=3.0, help="seconds between runs (default %(default)s)")
    p.add_argument("--venv-root", type=Path, default=Path.home() / ".cache" / "pdserve" / "external-clients",
                   help="where the clients' throwaway venvs live (default %(default)s)")
    p.add_argument("--out", type=Path, help="output folder (default bench/out/external-clients-<time>)")
    p.add_argument("--parse-only", type=Path, metavar="DIR", help="re-read a finished run's files, print the table")
    p.add_argument("--install-only", action="store_true", help="build the clients' venvs and stop")
    args = p.parse_args(argv)
    if args.num_requests < 1 or args.input < 1 or args.output < 2:
        p.error("--num-requests and --input must be >= 1, --output >= 2 (ITL needs two tokens)")
    if any("," in s for s in args.set):
        p.error("--set takes one value per key here (no sweeps)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.parse_only:
        rows, run_args = reparse(args.parse_only)
        print(report(rows, args.parse_only, run_args))
        return 0
    bins = {c: ensure_venv(c, args.venv_root) for c in args.clients}
    if args.install_only:
        print("\n".join(f"{c}: {b}" for c, b in bins.items()))
        return 0
    out = args.out or Path(f"bench/out/external-clients-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    results = measure(args, bins, out)
    doc = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    print(report(results, out, doc))
    print(f"wrote {out / 'summary.md'}, {out / 'results.json'}")
    ok = all(verdict(r, next((b for b in results if b.client == "pdserve" and b.rate == r.rate), None)) == "ok"
             for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
