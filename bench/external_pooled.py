"""Pool several finished `bench/external_clients.py` runs: per-request TTFT and ITL from each tool's own
per-request files, one median over all the runs' requests per client and rate, as ratios against pdserve
bench's pooled requests (issue 22's criterion: p50 within 10%).

    python bench/external_pooled.py DIR [DIR ...]

Why: on this 2-core machine one run's p50 over 12-30 requests moved as much as the band (pdserve bench's
own before/after runs differed by 0.84-1.16x); pooling runs made the same way is a larger sample of the
same thing. Each tool's own per-request numbers, nothing recomputed from raw timestamps except pdserve
bench's (its `RequestRecord`s, as `pdserve bench` computes them):
  pdserve   pdserve@RATE.json: TTFT = first token chunk - send; ITL = (last chunk - first) / (tokens - 1)
  guidellm  guidellm@RATE.json benchmarks[0].requests.successful[*]: time_to_first_token_ms,
            inter_token_latency_ms
  aiperf    aiperf@RATE/profile_export.jsonl records: time_to_first_token, inter_token_latency (ms)
The median is the same (linear-interpolated) for all three, so the tools' percentile methods drop out.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cluster.bench.metrics import RequestRecord, request_metrics  # noqa: E402

BAND = 0.10


def pdserve_rows(path: Path) -> list[tuple[float, float]]:
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
    if client == "pdserve":
        return pdserve_rows(run / f"pdserve@{rate}.json")
    if client == "guidellm":
        return guidellm_rows(run / f"guidellm@{rate}.json")
    return aiperf_rows(run / f"aiperf@{rate}" / "profile_export.jsonl")


def pooled(runs: list[Path]) -> list[str]:
    rates = sorted({p.stem.split("@")[1] for r in runs for p in r.glob("pdserve@*.json")}, key=float)
    out = [f"pooled over {', '.join(str(r) for r in runs)}", "",
           "| client | rate | requests | TTFT p50 (ms) | ITL p50 (ms) | TTFT p50 vs pdserve | ITL p50 vs pdserve | "
           "within 10% |", "|---|---|---|---|---|---|---|---|"]
    for rate in rates:
        base = None
        for client in ("pdserve", "guidellm", "aiperf"):
            rows = [x for r in runs for x in rows_of(r, client, rate)]
            ttft, itl = statistics.median(x[0] for x in rows), statistics.median(x[1] for x in rows)
            base = base or (ttft, itl)
            rt, ri = ttft / base[0], itl / base[1]
            ok = "yes" if abs(rt - 1) <= BAND and abs(ri - 1) <= BAND else "no"
            out.append(f"| {client} | {rate} | {len(rows)} | {ttft:.0f} | {itl:.1f} | {rt:.2f} | {ri:.2f} | {ok} |")
    return out


def main(argv: list[str] | None = None) -> int:
    runs = [Path(a) for a in (argv if argv is not None else sys.argv[1:])]
    if not runs or not all(r.is_dir() for r in runs):
        print("usage: external_pooled.py DIR [DIR ...] (finished bench/external_clients.py runs)", file=sys.stderr)
        return 2
    print("\n".join(pooled(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
