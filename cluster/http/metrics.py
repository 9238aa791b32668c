"""Prometheus metrics and per-request timelines of one frontend app.

Who calls it: `handlers.py` calls `observe_finished` once per finished choice (with the backend's
timeline) and `count_error` per error answer; `GET /metrics` calls `refresh(backend)` (gauges from
`BackendStats`) then `render()`. The registry is per app, so several apps in one process (tests) never
share or collide on metric names.

Timeline events (unix seconds) come from the backend; any subset may be present. Local engine and
colocated cluster: queued, engine_added, first_token, finish (cluster: also decode_admitted, the step that
produced the first token). Disaggregated: queued, reserved, prefill_submitted (router); prefill_start =
transfer_start, prefill_end, transfer_done (prefill worker); transfer_commit, decode_admitted (decode
worker); first_token, finish (router). `PHASES` turns event pairs into phase durations; "handoff" is
the part of the transfer that layer-wise streaming did not hide behind the prefill. Two entries are counts,
not times (`serving_api.TIMELINE_COUNTS`, cluster backends): kv_bytes (KV payload bytes shipped prefill ->
decode for the request) and kv_pages (the most KV pages it held at once on its decode or colocated
worker); they feed the histograms pdserve_request_kv_bytes and pdserve_request_kv_pages.
Gauges read `BackendStats` at scrape time: queued, running, pages; `preemptions` is a running total
turned into a counter; `extra["kv_transfer_bytes"]` / `extra["kv_transfer_seconds"]` (backend totals) feed
the transfer gauges and every other `extra` key becomes `pdserve_backend_stat{name=...}`. `health` (cluster
backends) feeds `pdserve_pool_degraded{pool,reason}` (1 while degraded, with why; 0 and reason "" when not)
and `pdserve_pool_degraded_since_seconds{pool}` (unix time the spell began; 0 when healthy).
`autoscaling` (with `autoscaling.enabled`) feeds pdserve_autoscaler_target_replicas{pool},
pdserve_autoscaler_need_replicas{pool}, pdserve_autoscaler_forecast_rate{pool},
pdserve_autoscaler_correction_factor{pool} and the counter pdserve_autoscaler_decisions{pool,direction,reason}
(from the autoscaler's running totals; each decision is also one log line of logger pdserve.autoscaler).
`TimelineStore` keeps the last timelines by response id for `GET /v1/pdserve/timeline/{id}`.
"""
from __future__ import annotations

import re
from collections import OrderedDict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cluster.serving_api import BackendStats

PHASES = {  # phase -> (start event, end event)
    "queue": ("queued", ("prefill_start", "engine_added", "decode_admitted")),
    "prefill": ("prefill_start", ("prefill_end",)),
    "transfer": ("transfer_start", ("transfer_commit",)),
    "handoff": ("prefill_end", ("transfer_commit",)),
    "ttft": ("queued", ("first_token",)),
    "decode": ("first_token", ("finish",)),
    "e2e": ("queued", ("finish",)),
}
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)
_KV_BYTES_BUCKETS = (1e3, 1e4, 1e5, 3e5, 1e6, 3e6, 1e7, 3e7, 1e8, 3e8, 1e9, 4e9)  # SmolLM2 bf16: ~23 KB/token
_KV_PAGES_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)
_EXTRA_NAME = re.compile(r"[^a-zA-Z0-9_]")


class FrontendMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "Arrival to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds", "Mean gap between output tokens after "
                              "the first", registry=r, buckets=_TPOT_BUCKETS)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "Arrival to finish", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.phase = Histogram("pdserve_request_phase_seconds", "Time spent per request phase (from the "
                               "timeline)", ["phase"], registry=r, buckets=_LATENCY_BUCKETS)
        self.requests = Counter("pdserve_requests", "Finished requests (choices) by finish reason",
                                ["finish_reason"], registry=r)
        self.errors = Counter("pdserve_http_errors", "Error answers by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("pdserve_generation_tokens", "Generated tokens", registry=r)
        self.preemptions = Counter("pdserve_preemptions", "Requests preempted (recomputed) by the backend",
                                   registry=r)
        self.queued = Gauge("pdserve_requests_queued", "Requests waiting for their first token", registry=r)
        self.running = Gauge("pdserve_requests_running", "Requests generating", registry=r)
        self.pages_in_use = Gauge("pdserve_kv_pages_in_use", "KV cache pages in use", registry=r)
        self.pages_total = Gauge("pdserve_kv_pages_total", "KV cache pages in the pool(s)", registry=r)
        self.transfer_bytes = Gauge("pdserve_kv_transfer_bytes", "KV bytes moved prefill -> decode (backend "
                                    "total)", registry=r)
        self.transfer_seconds = Gauge("pdserve_kv_transfer_seconds", "Time spent moving KV (backend total)",
                                      registry=r)
        self.kv_bytes = Histogram("pdserve_request_kv_bytes", "KV payload bytes shipped prefill -> decode per "
                                  "request (timeline kv_bytes)", registry=r, buckets=_KV_BYTES_BUCKETS)
        self.kv_pages = Histogram("pdserve_request_kv_pages", "Most KV pages a request held at once on its decode "
                                  "worker (timeline kv_pages)", registry=r, buckets=_KV_PAGES_BUCKETS)
        self.extra = Gauge("pdserve_backend_stat", "Other backend statistics (BackendStats.extra)", ["name"],
                           registry=r)
        self.degraded = Gauge("pdserve_pool_degraded", "1 while a pool has fewer live workers than it should "
                              "or one is being replaced (reason: why it became so)", ["pool", "reason"], registry=r)
        self.degraded_since = Gauge("pdserve_pool_degraded_since_seconds", "Unix time a pool became degraded "
                                    "(0: healthy)", ["pool"], registry=r)
        self.autoscale = {k: Gauge(f"pdserve_autoscaler_{k}", doc, ["pool"], registry=r) for k, doc in (
            ("target_replicas", "Replicas the autoscaler last decided for the pool"),
            ("need_replicas", "Replicas the corrected model needs at the forecast rate (max + 1: beyond max)"),
            ("forecast_rate", "Arrival rate (req/s) the autoscaler forecast for the coming interval"),
            ("correction_factor", "Measured / predicted latency the autoscaler scales its model's step times by"))}
        self.decisions = Counter("pdserve_autoscaler_decisions", "Autoscaler decisions by pool, direction (up, "
                                 "down, hold) and reason", ["pool", "direction", "reason"], registry=r)
        self._preemptions_seen = 0
        self._decisions_seen: dict = {}

    def observe_finished(self, finish_reason: str | None, prompt_tokens: int, completion_tokens: int,
                         timeline: dict[str, float] | None) -> None:
        self.requests.labels(finish_reason or "unknown").inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if not timeline:
            return
        for name, (start, ends) in PHASES.items():
            end = next((e for e in ends if e in timeline), None)
            if start in timeline and end is not None:
                self.phase.labels(name).observe(max(0.0, timeline[end] - timeline[start]))
        t = timeline
        if "queued" in t and "first_token" in t:
            self.ttft.observe(max(0.0, t["first_token"] - t["queued"]))
        if "queued" in t and "finish" in t:
            self.e2e.observe(max(0.0, t["finish"] - t["queued"]))
        if "first_token" in t and "finish" in t and completion_tokens > 1:
            self.tpot.observe(max(0.0, t["finish"] - t["first_token"]) / (completion_tokens - 1))
        if "kv_bytes" in t:
            self.kv_bytes.observe(t["kv_bytes"])
        if "kv_pages" in t:
            self.kv_pages.observe(t["kv_pages"])

    def count_error(self, status: int) -> None:
        self.errors.labels(str(status)).inc()

    def refresh(self, stats: BackendStats) -> None:
        self.queued.set(stats.queued)
        self.running.set(stats.running)
        self.pages_in_use.set(stats.pages_in_use)
        self.pages_total.set(stats.num_pages)
        if stats.preemptions > self._preemptions_seen:  # the backend reports a running total
            self.preemptions.inc(stats.preemptions - self._preemptions_seen)
            self._preemptions_seen = stats.preemptions
        extra = dict(stats.extra)
        self.transfer_bytes.set(extra.pop("kv_transfer_bytes", 0.0))
        self.transfer_seconds.set(extra.pop("kv_transfer_seconds", 0.0))
        for key, value in extra.items():
            self.extra.labels(_EXTRA_NAME.sub("_", key)).set(value)
        if stats.health is not None:
            self.degraded.clear()  # (one series per pool: the reason label changes)
            for pool, h in stats.health["pools"].items():
                self.degraded.labels(pool, h["reason"] if h["degraded"] else "").set(float(h["degraded"]))
                self.degraded_since.labels(pool).set(h["since"] or 0.0)
        if stats.autoscaling is not None:
            self._refresh_autoscaling(stats.autoscaling)

    def _refresh_autoscaling(self, a: dict) -> None:
        for pool, p in a["pools"].items():
            for key, field in (("target_replicas", "target"), ("need_replicas", "need"),
                               ("forecast_rate", "forecast_rate"), ("correction_factor", "correction")):
                self.autoscale[key].labels(pool).set(p[field])
        for labels, total in a["decisions"].items():  # running totals -> counter increments
            seen = self._decisions_seen.get(labels, 0)
            if total > seen:
                self.decisions.labels(*labels).inc(total - seen)
                self._decisions_seen[labels] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TimelineStore:
    """The last `capacity` responses' per-choice timelines (debug endpoint)."""

    def __init__(self, capacity: int = 1024):
        self.capacity = capacity
        self._items: OrderedDict[str, list[dict | None]] = OrderedDict()

    def put(self, response_id: str, timelines: list[dict | None]) -> None:
        self._items[response_id] = timelines
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> list[dict | None] | None:
        return self._items.get(response_id)
