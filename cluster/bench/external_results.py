"""What bench/checks/external_clients.py measured: one row per client and rate, the clients' own output files
parsed into it, and the table with ratios against pdserve bench; and several finished runs pooled. Pure
apart from reading and writing files under a run's folder; no network, no subprocess.

    parse_guidellm(doc, rate, sent) / parse_aiperf(doc, rate, sent) -> ClientResult   # a loaded JSON
    read_result(client, rate, sent, out_dir)      # finds and parses what a client left for `rate`
    pdserve_result(records, rate)                 # cluster/bench RequestRecords -> the baseline row
    table(rows) -> markdown; verdict(row, baseline) -> "ok" or what fails the issue's acceptance
    report(rows, out_dir, args) / reparse(out_dir)   # summary.md + results.json, and back
    pooled(run_dirs) -> markdown lines           # --pool: per-request medians over several runs

The baseline at a rate is pdserve bench's load generator run twice, before and after the clients, pooled:
a shared machine's load drifts over minutes, and the two halves say by how much (`note`). A drift beyond
the acceptance bound means the machine, not a client, decides that rate's verdict.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

CLIENTS = ("guidellm", "aiperf")
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
    drift: dict[str, float] | None = None  # pdserve: after / before ratio of each p50 (see the module map)


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


def pdserve_result(records: list, rate: float, after: list | None = None) -> ClientResult:
    """pdserve bench's row from its records; with `after` (a second run), the two pooled, and `drift`."""
    from cluster.bench.metrics import summarize

    s = summarize(records + (after or []), math.inf, math.inf)
    r = ClientResult("pdserve", rate, _num(s.ttft_ms["p50"]), _num(s.ttft_ms["p90"]), _num(s.tpot_ms["p50"]),
                     _num(s.tpot_ms["p90"]), s.completed, s.requests)
    if after:
        one, two = pdserve_result(records, rate), pdserve_result(after, rate)
        r.drift = {k: _ratio(getattr(two, k), getattr(one, k)) for k in ("ttft_p50_ms", "itl_p50_ms")}
    return r


# ---- the table --------------------------------------------------------------------------------------
def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def verdict(r: ClientResult, base: ClientResult | None) -> str:
    """'ok' when the issue's acceptance holds for this row, else what fails."""
    if r.error:
        return r.error.splitlines()[0][:80].replace("|", "/")
    bad, drift = ([] if r.completed == r.sent else [f"{r.sent - r.completed} failed"]), []
    for name, key in (("TTFT", "ttft_p50_ms"), ("ITL", "itl_p50_ms")):
        if r.client == "pdserve":  # the baseline: did the machine hold still while the clients ran?
            if (q := (r.drift or {}).get(key, 1.0)) is None or abs(q - 1.0) > ACCEPT_P50:
                drift.append(f"{name} p50 x{fmt(q, '.2f')}")
        elif (q := _ratio(getattr(r, key), getattr(base, key) if base else None)) is None or abs(q - 1) > ACCEPT_P50:
            bad.append(f"{name} p50 x{fmt(q, '.2f')}")
    bad += [f"baseline drifted (after/before): {', '.join(drift)}"] if drift else []
    return "ok" if not bad else ", ".join(bad)


def table(results: list[ClientResult]) -> str:
    base = {r.rate: r for r in results if r.client == "pdserve" and not r.error}
    lines = ["| client | rate (req/s) | TTFT p50 / p90 (ms) | ITL p50 / p90 (ms) | completed/sent "
             "| TTFT p50, p90 vs pdserve | ITL p50, p90 vs pdserve | acceptance |", "|---|---|---|---|---|---|---|---|"]
    order = ["pdserve", *CLIENTS]
    for r in sorted(results, key=lambda r: (r.rate, order.index(r.client))):
        b = base.get(r.rate)
        rt = lambda k: fmt(_ratio(getattr(r, k), getattr(b, k) if b else None), ".2f")  # noqa: E731
        lines.append(f"| {r.client} | {r.rate:g} | {fmt(r.ttft_p50_ms, '.0f')} / {fmt(r.ttft_p90_ms, '.0f')} "
                     f"| {fmt(r.itl_p50_ms, '.1f')} / {fmt(r.itl_p90_ms, '.1f')} | {r.completed}/{r.sent} "
                     f"| {rt('ttft_p50_ms')}, {rt('ttft_p90_ms')} | {rt('itl_p50_ms')}, {rt('itl_p90_ms')} "
                     f"| {verdict(r, b)} |")
    return "\n".join(lines)


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


# ---- several finished runs, pooled ---------------------------------------------------------------------
# On a 2-core machine one run's p50 over 12-30 requests moved as much as the acceptance band (pdserve bench's
# own before/after runs differed by 0.84-1.16x); runs made the same way, pooled, are a larger sample of the
# same thing. Each tool's own per-request numbers, nothing recomputed from raw timestamps except pdserve
# bench's (its RequestRecords, as `pdserve bench` computes them):
#   pdserve   pdserve@RATE.json: TTFT = first token chunk - send; ITL = (last chunk - first) / (tokens - 1)
#   guidellm  guidellm@RATE.json benchmarks[0].requests.successful[*]: time_to_first_token_ms,
#             inter_token_latency_ms
#   aiperf    aiperf@RATE/profile_export.jsonl records: time_to_first_token, inter_token_latency (ms)
# The median is the same (linear-interpolated) for all three, so the tools' percentile methods drop out.
def pdserve_rows(path: Path) -> list[tuple[float, float]]:
    """(TTFT ms, ITL ms) of each completed request of a pdserve@RATE.json (one output token: no ITL, left out)."""
    from cluster.bench.metrics import RequestRecord, request_metrics

    out = []
    for raw in json.loads(path.read_text()):
        m = request_metrics(RequestRecord(**raw))
        if m.ok and m.tpot_s is not None:
            out.append((m.ttft_s * 1000, m.tpot_s * 1000))
    return out


def guidellm_rows(path: Path) -> list[tuple[float, float]]:
    reqs = json.loads(path.read_text())["benchmarks"][0]["requests"]["successful"]
    return [(r["time_to_first_token_ms"], r["inter_token_latency_ms"]) for r in reqs]


def aiperf_rows(path: Path) -> list[tuple[float, float]]:
    out = []
    for line in path.read_text().splitlines():
        m = json.loads(line).get("metrics") or {}
        if "time_to_first_token" in m and "inter_token_latency" in m:
            out.append((m["time_to_first_token"]["value"], m["inter_token_latency"]["value"]))
    return out


def rows_of(run: Path, client: str, rate: str) -> list[tuple[float, float]]:
    """One run's per-request (TTFT ms, ITL ms) for a client at `rate` (as its file names spell it)."""
    if client == "pdserve":
        return pdserve_rows(run / f"pdserve@{rate}.json")
    if client == "guidellm":
        return guidellm_rows(run / f"guidellm@{rate}.json")
    return aiperf_rows(run / f"aiperf@{rate}" / "profile_export.jsonl")


def pooled(runs: list[Path]) -> list[str]:
    """Markdown: per rate and client, the median TTFT and ITL over every run's requests, each as a ratio to
    pdserve bench's pooled requests, and whether both are within the acceptance band."""
    rates = sorted({p.stem.split("@")[1] for r in runs for p in r.glob("pdserve@*.json")}, key=float)
    out = [f"pooled over {', '.join(str(r) for r in runs)}", "",
           "| client | rate | requests | TTFT p50 (ms) | ITL p50 (ms) | TTFT p50 vs pdserve | ITL p50 vs pdserve | "
           f"within {100 * ACCEPT_P50:.0f}% |", "|---|---|---|---|---|---|---|---|"]
    for rate in rates:
        base = None
        for client in ("pdserve", *CLIENTS):
            rows = [x for r in runs for x in rows_of(r, client, rate)]
            ttft, itl = statistics.median(x[0] for x in rows), statistics.median(x[1] for x in rows)
            base = base or (ttft, itl)
            rt, ri = ttft / base[0], itl / base[1]
            ok = "yes" if abs(rt - 1) <= ACCEPT_P50 and abs(ri - 1) <= ACCEPT_P50 else "no"
            out.append(f"| {client} | {rate} | {len(rows)} | {ttft:.0f} | {itl:.1f} | {rt:.2f} | {ri:.2f} | {ok} |")
    return out
