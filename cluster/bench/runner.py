"""The bench run: targets, SLOs, rate sweeps and goodput search, in the order `pdserve bench` runs them.

    result = run_bench(config, targets)          # cli.py builds both from the flags

For each target (a spec variant started here as a child process, or an `--endpoint`), in order -- the
SLO-reference target first, so SLOs are fixed before any loaded run:
    start (spec only: `pdserve serve` on a free port, wait for /health)
    warm-up       `warmup` requests one at a time, discarded (first-call costs: compiles, page faults)
    unloaded      only on the SLO reference and only if an SLO is relative (`3x`): `unloaded_requests`
                  requests of the workload, spread over it, one at a time; reference = p90 TTFT and p90
                  TPOT of those, so a scale of 1x is what ~90% of requests meet with no load at all
    load          metrics.find_goodput over the rates: each probe replays the workload at that rate
                  (open loop, all `num_requests`, or those arriving within `duration_s`; with
                  `min_probe_s` a probe at rate r sends max(num_requests, r x min_probe_s) requests)
                  pdserve targets: /metrics scraped before and after, the change kept (server_stats.py)
                  each probe's summary carries Andes QoE at the configured pace (qoe.py)
                  early stop (default on): once more requests have certainly missed the LOOSEST SLO of
                  the scale sweep (max(declared, max scale x reference)) than the attainment target
                  allows, the probe is cut short -- at that rate attainment is below target at every
                  SLO scale reported, so goodput readings stay valid; the recorded attainment of such a
                  probe counts the cancelled requests as misses (a lower bound), flagged `stopped_early`
    stop          SIGINT to the child and wait
Every send (warm-up, unloaded, each probe) is a new round of prompts (prompts.py), so a server's prefix
cache never serves one probe from another's prompts. The result keeps every record; report.py writes the JSON, markdown and PNGs from it.
"""
from __future__ import annotations

import asyncio
import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from cluster.bench import server_stats
from cluster.bench.loadgen import Target, run_load, run_sequential
from cluster.bench.metrics import (GoodputResult, RatePoint, RequestRecord, Summary, find_goodput, meets,
                                   request_metrics, summarize)
from cluster.bench.qoe import QoESetting
from cluster.bench.server import BenchServerError, SpecServer, SpecVariant
from cluster.bench.workload import RequestSpec, Workload
from cluster.stats import percentile


@dataclass
class SLOSetting:
    """A target in ms, or (relative) a multiple of the unloaded p90 ("3x")."""
    value: float
    relative: bool = False

    @classmethod
    def parse(cls, text: str) -> "SLOSetting":
        t = text.strip().lower()
        try:
            if t.endswith("x"):
                value, relative = float(t[:-1]), True
            else:
                value, relative = float(t.removesuffix("ms")), False
        except ValueError:
            raise ValueError(f"an SLO is a number of ms (2000) or a multiple of the unloaded p90 (3x), "
                             f"not {text!r}") from None
        if value <= 0:
            raise ValueError(f"an SLO must be > 0, got {text!r}")
        return cls(value, relative)

    def __str__(self) -> str:
        return f"{self.value:g}x" if self.relative else f"{self.value:g} ms"


@dataclass
class BenchConfig:
    rates: list[float | None]  # None: a trace's own timing
    ttft: SLOSetting
    tpot: SLOSetting
    target_attainment: float = 0.9
    bisect_steps: int = 3
    expand: int = 2
    duration_s: float | None = None
    num_requests: int | None = None  # per probe, when the workload holds more (see min_probe_s)
    min_probe_s: float = 0.0  # a probe at rate r sends max(num_requests, r * min_probe_s) requests
    warmup: int = 2
    unloaded_requests: int = 8
    slo_scales: list[float] = field(default_factory=lambda: [1.5, 2, 3, 4, 5, 6, 8, 10])
    progress: bool = True
    early_stop: bool = True
    timeout_s: float = 300.0  # per request, client side (pdserve targets also get it as deadline_s)
    out_dir: Path = Path("bench/out")
    qoe: QoESetting = field(default_factory=QoESetting)  # Andes QoE's expected TTFT and reading pace

    @property
    def needs_unloaded(self) -> bool:
        return self.ttft.relative or self.tpot.relative


@dataclass
class BenchTarget:
    label: str
    variant: SpecVariant | None = None  # a spec to start
    target: Target | None = None  # an endpoint already running (or filled in once the spec is up)
    reference: bool = False  # SLOs come from this target's unloaded run
    group: str = ""  # the spec a variant came from (compare groups variants by it)


@dataclass
class RateRun:
    rate: float | None
    records: list[RequestRecord]
    summary: Summary | None = None
    stopped_early: bool = False
    server: dict[str, float] = field(default_factory=dict)  # change of the server's counters (server_stats)


@dataclass
class TargetResult:
    label: str
    group: str
    spec: str | None
    settings: dict
    unloaded: list[RequestRecord] = field(default_factory=list)
    runs: list[RateRun] = field(default_factory=list)
    goodput: GoodputResult | None = None
    server_log: str | None = None
    base_url: str | None = None
    error: str | None = None  # the target could not be benchmarked (its server did not start)


@dataclass
class SLO:
    ttft_s: float
    tpot_s: float
    ref_ttft_s: float | None = None  # what scales multiply (unloaded p90, or the absolute SLO)
    ref_tpot_s: float | None = None
    source: str = ""


@dataclass
class BenchResult:
    config: BenchConfig
    workload: Workload
    slo: SLO | None = None
    targets: list[TargetResult] = field(default_factory=list)
    on_probe: Callable[[TargetResult, RateRun], None] | None = None  # e.g. write each probe as it ends
    interrupted: bool = False  # Ctrl-C: the report covers the probes finished before it


def unloaded_sample(workload: Workload, n: int, round_no: int = 0) -> list[RequestSpec]:
    """`n` requests spread evenly over the workload (its length mix, not just its first requests)."""
    reqs = workload.at_rate(1.0, round_no=round_no)
    n = min(n, len(reqs))
    return [reqs[round(i * (len(reqs) - 1) / max(1, n - 1))] for i in range(n)] if n > 1 else reqs[:n]


def resolve_slo(cfg: BenchConfig, unloaded: list[RequestRecord], label: str) -> SLO:
    ms = [request_metrics(r) for r in unloaded]
    ttfts = [m.ttft_s for m in ms if m.ok and m.ttft_s is not None]
    tpots = [m.tpot_s for m in ms if m.ok and m.tpot_s is not None]
    if cfg.needs_unloaded and not ttfts:
        raise RuntimeError(f"{label}: no unloaded request succeeded; cannot set relative SLOs: "
                           f"{[r.error for r in unloaded][:3]}")
    ref_ttft = percentile(ttfts, 90) if ttfts else None
    ref_tpot = percentile(tpots, 90) if tpots else None
    if cfg.tpot.relative and ref_tpot is None:
        raise RuntimeError(f"{label}: every unloaded request had one output token: no TPOT to scale")

    def pick(s: SLOSetting, ref: float | None) -> float:
        return s.value * ref if s.relative else s.value / 1000.0

    ttft, tpot = pick(cfg.ttft, ref_ttft), pick(cfg.tpot, ref_tpot)
    # scales multiply the unloaded p90 when it was measured, else the declared SLO itself
    src = f"TTFT {cfg.ttft}, TPOT {cfg.tpot}" + (f"; unloaded p90 of {label}" if cfg.needs_unloaded else "")
    return SLO(ttft, tpot, ref_ttft if cfg.needs_unloaded else ttft, ref_tpot if cfg.needs_unloaded else tpot, src)


def _say(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def hopeless(ttft_s: float, tpot_s: float, target: float, n: int):
    """stop_when for run_load: more than n * (1 - target) requests certainly missed (finished and
    missed, or waiting for a first token longer than the TTFT target)."""
    allowed = n * (1.0 - target) + 1e-9

    def check(records: list[RequestRecord], now: float) -> bool:
        misses = 0
        for r in records:
            if r.end_s is not None:
                misses += not meets(request_metrics(r), ttft_s, tpot_s)
            elif r.sent_s is not None and not r.chunk_s and now - r.sent_s > ttft_s:
                misses += 1
        return misses > allowed
    return check


def _probe(cfg: BenchConfig, workload: Workload, prompt_of, target: Target, rate: float | None,
           label: str, slo: "SLO", round_no: int = 0) -> RateRun:
    reqs = workload.at_rate(rate, cfg.duration_s, round_no)
    if cfg.num_requests is not None and rate is not None:
        # A short probe at a high rate ends before an overloaded queue has grown past the TTFT target
        # (32 requests at 2 req/s last 16 s): longer probes at higher rates keep attainment honest.
        reqs = reqs[:max(cfg.num_requests, math.ceil(rate * cfg.min_probe_s))]
    desc = f"{label} @ {'trace' if rate is None else f'{rate:g}'} req/s"
    stop = None
    if cfg.early_stop:
        top = max(cfg.slo_scales, default=0.0)
        stop = hopeless(max(slo.ttft_s, top * (slo.ref_ttft_s or 0.0)),
                        max(slo.tpot_s, top * (slo.ref_tpot_s or 0.0)), cfg.target_attainment, len(reqs))
    before = server_stats.scrape(target.base_url, target.api_key) if target.pdserve else {}
    records = asyncio.run(run_load(reqs, prompt_of, target, progress=cfg.progress, desc=desc, stop_when=stop))
    after = server_stats.scrape(target.base_url, target.api_key) if target.pdserve else {}
    return RateRun(rate, records, stopped_early=any((r.error or "").startswith("stopped early") for r in records),
                   server=server_stats.delta(before, after))


def bench_target(cfg: BenchConfig, workload: Workload, prompt_of, bt: BenchTarget, result: BenchResult) -> TargetResult:
    """Warm-up, unloaded (reference only), rate sweep + goodput search on one running target."""
    tr = TargetResult(bt.label, bt.group, bt.variant.source if bt.variant else None,
                      dict(bt.variant.settings) if bt.variant else {})
    result.targets.append(tr)  # now: an interrupted run still reports the probes this target finished
    target = bt.target
    tr.base_url = target.base_url
    # Rounds: every send of the workload gets its own prompts (prompts.py), so a server's prefix cache
    # never answers a probe from an earlier send; numbered the same way on every target of a --compare.
    rounds = itertools.count()
    warm = unloaded_sample(workload, cfg.warmup, next(rounds))
    if warm:
        asyncio.run(run_sequential(warm, prompt_of, target))
    unloaded_round = next(rounds)
    if bt.reference and result.slo is None:
        tr.unloaded = asyncio.run(run_sequential(unloaded_sample(workload, cfg.unloaded_requests, unloaded_round),
                                                 prompt_of, target))
        result.slo = resolve_slo(cfg, tr.unloaded, bt.label)
        _say(f"SLO: TTFT {1000 * result.slo.ttft_s:.0f} ms, TPOT {1000 * result.slo.tpot_s:.1f} ms "
             f"({result.slo.source})")
    slo = result.slo
    assert slo is not None, "the SLO reference target runs first"

    def measure(rate: float | None) -> float:
        run = _probe(cfg, workload, prompt_of, target, rate, bt.label, slo, next(rounds))
        run.summary = summarize(run.records, slo.ttft_s, slo.tpot_s, cfg.qoe)
        tr.runs.append(run)
        if result.on_probe is not None:
            result.on_probe(tr, run)
        s = run.summary
        _say(f"{bt.label} @ {'trace' if rate is None else f'{rate:g}'} req/s: attainment {s.attainment:.2f}, "
             f"TTFT p50 {s.ttft_ms['p50']:.0f} ms, TPOT p50 {s.tpot_ms['p50']:.1f} ms, "
             f"QoE mean {s.qoe['mean']:.2f}, {s.completed}/{s.requests} ok"
             + (" (stopped early)" if run.stopped_early else ""))
        time.sleep(1.0)  # let late cleanup (aborts, page frees) finish before the next probe
        return s.attainment

    if cfg.rates == [None] or len(cfg.rates) == 1:
        a = measure(cfg.rates[0])
        rate = cfg.rates[0] if cfg.rates[0] is not None else workload.native_rate
        tr.goodput = GoodputResult(rate if a >= cfg.target_attainment else 0.0, [RatePoint(rate, a)])
        tr.runs[-1].rate = rate
    else:
        tr.goodput = find_goodput(measure, [r for r in cfg.rates if r], cfg.target_attainment,
                                  cfg.bisect_steps, cfg.expand)
    tr.runs.sort(key=lambda r: r.rate or 0.0)
    return tr


def run_bench(cfg: BenchConfig, workload: Workload, prompt_of, targets: list[BenchTarget],
              on_probe: Callable[[TargetResult, RateRun], None] | None = None) -> BenchResult:
    result = BenchResult(cfg, workload, on_probe=on_probe)
    if not cfg.needs_unloaded:
        result.slo = resolve_slo(cfg, [], "")
    try:
        for bt in sorted(targets, key=lambda t: not t.reference):  # reference first (stable otherwise)
            _bench_one(cfg, workload, prompt_of, bt, result)
    except KeyboardInterrupt:  # Ctrl-C: the server of the current spec is stopped by now; report the rest
        result.interrupted = True
        _say("interrupted: reporting what was measured")
    return result


def _bench_one(cfg: BenchConfig, workload: Workload, prompt_of, bt: BenchTarget, result: BenchResult) -> None:
    if bt.variant is None:
        _say(f"{bt.label}: {bt.target.base_url}")
        bench_target(cfg, workload, prompt_of, bt, result)
        return
    log = cfg.out_dir / f"server-{bt.label}.log"
    _say(f"{bt.label}: starting pdserve serve {bt.variant.path} (log {log})")
    try:
        with SpecServer(bt.variant.path, log) as server:
            _say(f"{bt.label}: serving {server.model} at {server.base_url}")
            bt.target = Target(server.base_url, server.model, pdserve=True, timeout_s=cfg.timeout_s)
            tr = bench_target(cfg, workload, prompt_of, bt, result)
    except BenchServerError as e:
        if result.slo is None:
            raise  # the SLO reference did not start: nothing else can be judged
        _say(f"{bt.label}: {e}")  # a variant that cannot start (say, a bad --set value) is reported
        tr = TargetResult(bt.label, bt.group, bt.variant.source, dict(bt.variant.settings), error=str(e))
        result.targets.append(tr)
    tr.server_log = str(log)
