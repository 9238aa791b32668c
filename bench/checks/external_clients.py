"""Real clients agree: GuideLLM and AIPerf against `pdserve serve`, beside `pdserve bench`'s own load
generator, at the same rates on the same synthetic workload (issue 22).

    python bench/checks/external_clients.py                       # deploy/local.yaml, 0.5 and 1 req/s, 20 requests
    python bench/checks/external_clients.py --rates 0.5,1 --num-requests 30 --input 256 --output 64 --out DIR
    python bench/checks/external_clients.py --parse-only DIR      # the table again from a finished run's files
    python bench/checks/external_clients.py --install-only        # just build the clients' venvs
    python bench/checks/external_clients.py --pool DIR DIR ...    # several finished runs pooled (below)

Order:
  1. one throwaway venv per client (default ~/.cache/pdserve/external-clients/<client>, `python -m venv`,
     never the project's): the pinned client, plus for GuideLLM the project's own torch version (no CUDA
     build on a CPU machine); reused while its stamp (the requirements) matches.
  2. `pdserve serve SPEC` (with any `--set KEY=VALUE`) on a free port (cluster/bench/server.py); warm-up.
  3. per rate, one after the other on the same server, each sending --num-requests requests at a
     constant rate with --input prompt tokens and exactly --output greedy output tokens (temperature 0,
     ignore_eos):
       pdserve   cluster/bench/loadgen.py (token-id prompts of exact length; options under `pdserve`),
                 before the clients and again after them: the baseline pools both, and their ratio shows
                 how much a shared machine drifted meanwhile (cluster/bench/external_results.py)
       guidellm  `guidellm run --scenario` (constant profile, synthetic_text, max_requests; it always sends
                 top-level `ignore_eos: true`, `stop: null`, stream_options.continuous_usage_stats; text prompts)
       aiperf    `aiperf profile` (constant arrival pattern, synthetic text prompts with stddev 0,
                 `--extra-inputs ignore_eos:true` at the top level, server token counts)
  4. each client's JSON (GuideLLM's benchmarks.json, AIPerf's profile_export_aiperf.json) is parsed and a
     table printed (cluster/bench/external_results.py): client x rate x {TTFT p50/p90, ITL p50/p90, completed/sent},
     each ratio against pdserve bench at the same rate; also in DIR/summary.md and DIR/results.json.
Acceptance (issue 22): every client completes every request at both rates, and its TTFT and ITL p50 are
within 10% of pdserve bench's.
--pool DIR DIR ...: on this 2-core machine one run's p50 over 12-30 requests moved as much as the band
(pdserve bench's own before/after runs differed by 0.84-1.16x); runs made the same way, pooled, are a larger
sample: one median per client and rate over every run's requests, each tool's own per-request numbers
(`external_results.pooled`), against pdserve bench's pooled requests.

Each number is the tool's own. ITL: pdserve bench's TPOT, (last token - first) / (tokens - 1) per request,
linear-interpolated percentiles; GuideLLM's inter_token_latency_ms, the same per request, its distribution
weighted by tokens - 1 (equal weights at a fixed output length), nearest-rank percentiles; AIPerf's
inter_token_latency, (request latency - TTFT) / (tokens - 1). TTFT: first token-carrying chunk minus send,
for all three. The clients run on the same cores as the server: AIPerf with one worker and one record
processor to keep its footprint near the others'. Each client, and pdserve bench's load generator too (a forked
child), runs under `nice -n --client-nice` (default 10):
on a 2-core machine GuideLLM's own CPU use (its scheduler and tokenizer loops) took cycles from the server's
workers and showed up as the server's ITL (4.08x and 3.16x pdserve bench's at 0.4 req/s, run at nice 0),
where a real deployment puts the load generator on another machine. --client-nice 0 measures the old way.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain script folder: make `bench`, `cluster` importable without an install
    sys.path.insert(0, str(ROOT))
from cluster.bench.external_clients import aiperf_argv, client_env, ensure_venv, guidellm_scenario  # noqa: E402
from cluster.bench.external_results import (CLIENTS, ClientResult, fmt, pdserve_result, pooled,  # noqa: E402
                                            read_result, report, reparse, verdict)

CLIENT_NICE = 10  # set from --client-nice; the priority the client processes run at


def _run(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> str | None:
    """Run a client to completion; None if it exited 0, else why not (with the log's tail). The client
    gets its own process group, so a timeout or Ctrl-C stops it and what it started (AIPerf's services)."""
    with log.open("w") as f:
        if CLIENT_NICE:
            cmd = ["nice", "-n", str(CLIENT_NICE), *cmd]
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


def run_guidellm(bin_dir: Path, ctx: dict, rate: float, out: Path, seed: int) -> ClientResult:
    path = out / f"guidellm@{rate:g}.json"
    scenario = out / f"guidellm@{rate:g}.scenario.json"
    scenario.write_text(json.dumps(guidellm_scenario(ctx["url"], ctx["model"], ctx["tokenizer"], rate, ctx["n"],
                                                     ctx["input"], ctx["output"], path, ctx["timeout"], seed),
                                   indent=1))
    err = _run([str(bin_dir / "guidellm"), "run", "--scenario", str(scenario), "--disable-console-interactive"],
               out / f"guidellm@{rate:g}.log", ctx["n"] / rate + ctx["timeout"] + 120)
    return read_result("guidellm", rate, ctx["n"], out, err)


def run_aiperf(bin_dir: Path, ctx: dict, rate: float, out: Path, seed: int) -> ClientResult:
    argv = aiperf_argv(ctx["url"], ctx["model"], ctx["tokenizer"], rate, ctx["n"], ctx["input"], ctx["output"],
                       out / f"aiperf@{rate:g}", ctx["timeout"], seed)
    err = _run([str(bin_dir / "aiperf"), *argv], out / f"aiperf@{rate:g}.log", ctx["n"] / rate + ctx["timeout"] + 180,
               client_env(hub_offline=False))
    return read_result("aiperf", rate, ctx["n"], out, err)


# ---- pdserve bench's own load generator ----------------------------------------------------------------
_CHILD_CTX: dict = {}  # what a forked load-generator child reads (set before the fork; never pickled)


def run_pdserve(ctx: dict, rate: float, round_no: int, warm_up: bool = False) -> list:
    """N requests at `rate` (constant gaps), their records; `warm_up`: 3 requests one at a time. Each call
    its own round of prompts (a prefix cache never serves one run from another's). It runs in a forked child
    at the clients' niceness: every load generator gets the same CPU priority, so a TTFT difference is the
    client's and not the scheduler's (a niced client's timestamps wait behind the busy server's workers)."""
    _CHILD_CTX.clear()
    _CHILD_CTX.update(ctx)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"), initializer=os.nice,
                             initargs=(CLIENT_NICE,)) as pool:
        return pool.submit(_pdserve_load, rate, round_no, warm_up).result()


def _pdserve_load(rate: float, round_no: int, warm_up: bool) -> list:
    from cluster.bench.loadgen import Target, run_load, run_sequential
    from cluster.bench.workload import RequestSpec

    ctx = _CHILD_CTX
    n = 3 if warm_up else ctx["n"]
    reqs = [RequestSpec(i, i / rate, ctx["input"], ctx["output"], (), round_no) for i in range(n)]
    target = Target(ctx["url"], ctx["model"], pdserve=True, timeout_s=ctx["timeout"])
    return asyncio.run((run_sequential if warm_up else run_load)(reqs, ctx["source"].prompt, target))


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
            before = run_pdserve(ctx, rate, 2 * k)
            _say(pdserve_result(before, rate))
            for client in args.clients:
                time.sleep(args.gap)  # let the last run's stragglers and aborts clear
                # a seed per rate: with one seed a client sent the second rate the first rate's prompts, which
                # the server's prefix cache then served (TTFT 0.87-0.90x pdserve bench's, whose prompts are new)
                results.append(RUNNERS[client](bins[client], ctx, rate, out, seed=k + 1))
                _say(results[-1])
            time.sleep(args.gap)
            after = run_pdserve(ctx, rate, 2 * k + 1)
            (out / f"pdserve@{rate:g}.json").write_text(json.dumps([asdict(x) for x in before + after]))
            results.append(pdserve_result(before, rate, after))
            _say(results[-1])
    return results


def _say(r: ClientResult) -> None:
    what = "pdserve (before and after, pooled)" if r.drift else r.client
    print(f"[clients] {what} @ {r.rate:g} req/s: TTFT p50 {fmt(r.ttft_p50_ms, '.0f')} ms, ITL p50 "
          f"{fmt(r.itl_p50_ms, '.1f')} ms, {r.completed}/{r.sent} ok" + (f" -- {r.error[:300]}" if r.error else ""),
          flush=True)


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
    p.add_argument("--client-nice", type=int, default=10, choices=range(0, 20), metavar="0..19",
                   help="niceness of the client processes, so they do not starve the server (default %(default)s)")
    p.add_argument("--gap", type=float, default=3.0, help="seconds between runs (default %(default)s)")
    p.add_argument("--venv-root", type=Path, default=Path.home() / ".cache" / "pdserve" / "external-clients",
                   help="where the clients' throwaway venvs live (default %(default)s)")
    p.add_argument("--out", type=Path, help="output folder (default bench/out/external-clients-<time>)")
    p.add_argument("--parse-only", type=Path, metavar="DIR", help="re-read a finished run's files, print the table")
    p.add_argument("--install-only", action="store_true", help="build the clients' venvs and stop")
    p.add_argument("--pool", type=Path, nargs="+", metavar="DIR",
                   help="finished runs: per-request TTFT and ITL medians over all of them, per client and rate")
    args = p.parse_args(argv)
    if args.num_requests < 1 or args.input < 1 or args.output < 2:
        p.error("--num-requests and --input must be >= 1, --output >= 2 (ITL needs two tokens)")
    if any("," in s for s in args.set):
        p.error("--set takes one value per key here (no sweeps)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    global CLIENT_NICE
    CLIENT_NICE = args.client_nice
    if args.pool:
        if missing := [str(d) for d in args.pool if not d.is_dir()]:
            print(f"--pool: not a folder: {', '.join(missing)}", file=sys.stderr)
            return 2
        print("\n".join(pooled(args.pool)))
        return 0
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
