"""Server-side counters around a probe: scrape a pdserve target's `/metrics` before and after, keep the
change. Called by `runner._probe` for pdserve targets; `report` prints the deltas per probe.

Why: some results are only visible inside the server — KV bytes moved prefill -> decode, prefix-cache hits,
preemptions — and their change over one probe is what a with/without comparison needs (the server's
totals also include warm-up and earlier probes). Histogram series are left out (latency comes from the
client); so are gauges of current state (queue length, pages in use), whose difference means nothing.
A target without `/metrics` (another server) gives an empty dict, never an error.
"""
from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Gauges that hold running totals (the backend reports totals; metrics.py sets them), so deltas are right.
TOTAL_GAUGES = ("pdserve_kv_transfer_bytes", "pdserve_kv_transfer_seconds", "pdserve_backend_stat")
STATE_NAMES = ("pdserve_requests_queued", "pdserve_requests_running", "pdserve_kv_pages_in_use",
               "pdserve_kv_pages_total")


def metrics_url(base_url: str) -> str:
    root = base_url.rstrip("/")
    return (root[:-3] if root.endswith("/v1") else root) + "/metrics"


def parse(text: str) -> dict[str, float]:
    """Prometheus text -> {series: value} for counters and running-total gauges."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.type == "counter" or (fam.type == "gauge" and fam.name in TOTAL_GAUGES):
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def scrape(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(metrics_url(base_url), headers=headers, timeout=timeout_s)
        r.raise_for_status()
        return parse(r.text)
    except (httpx.HTTPError, ValueError):
        return {}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Series that changed (a series new since `before` counts from zero)."""
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items()) if v != before.get(k, 0.0)}
