"""Serving calibration: what the runtime adds to the engine times a profile fitted, read off a bench run.

    calibrate_serving(runs, coeffs) -> entry     the profile's `serving` entry (pure Python)
    add_serving(profile, benches)                 `pdserve profile --serving-from`, bench/checks/planner_check.py

The simulators' side (the entry as step-time factors and a `Drift`): `latency/drift.py`.

Why: `pdserve profile` times the engine alone (one process, its CPU clock), while a served request also
pays for the runtime around it: HTTP, routing, the decode-side reservation and the prefill submit (RPCs
between processes), the layer hook's KV snapshots, steps that wait for a core shared with the other
worker, the server and Ray's own processes. Measured on this 2-core machine (SmolLM2, deploy/local.yaml,
256-token prompts at 0.125 req/s): a prefill alone took 265-1166 ms, median ~400, where the profile says
243; TPOT at batch 1-2 ~95 ms where it says ~71; arrival to prefill start 55-130 ms.

What is measured, from a `pdserve bench` run at low load (its requests carry server timelines; every
request counts, so a few noisy ones move a median little), for the run's serving mode:
    prefill_factor   median of the prompt's own time (prefill_end - prefill_start; engine_added ->
                     first_token where a server reports no prefill events) / the profile's prefill of it
                     alone; the mode is disaggregated where the timeline has the KV reservation
    decode_factor    median of measured TPOT / the profile's decode step at batch 1 and that context
    admission_s      median of (client TTFT - the prefill's own time): routing, queueing, delivery
    prefill_spread   the prefill ratios / their median at 0, 5, ..., 100% (likewise decode_spread)
`latency.profiles.load_profile(serving=True)` multiplies the fitted coefficients by the factors and gives the
latency model `admission_s`, which the simulators add before a request reaches an instance, and a
`Drift`: the machine's slow and fast spells. Why model them: a shared machine's speed wanders (other
tenants on the memory bus): the same lone 256-token prefill took 265 ms and 1166 ms minutes apart, so
P90s sit far above medians even at low load. Each spread was measured over its own span (a prefill's
time, ~0.4 s; a TPOT, the mean over a request's whole decode, ~7 s), so for each kind the simulated
time is cut into windows of that span (the median measured one: `prefill_window_s`, `decode_window_s`);
each window draws one quantile (seeded: a run is still a pure function of its inputs) and every step of
that kind starting in it, on every instance, is scaled by it. A run at higher load would fold queueing
into these numbers: calibrate at a rate where requests rarely overlap.
"""
from __future__ import annotations

import statistics

from cluster.planner.errors import BadConfigError
from cluster.planner.latency.base import Coeffs
from cluster.planner.latency.drift import KINDS, SPREAD_POINTS, at_fraction

MIN_POINTS = 5
PROMPT_PHASES = (("prefill_start", "prefill_end"), ("engine_added", "first_token"))


def spread(ratios: list[float]) -> tuple[float, ...]:
    """Quantiles of ratios / their median at SPREAD_POINTS evenly spaced levels."""
    s = sorted(ratios)
    mid = statistics.median(s)
    return tuple(round(at_fraction(s, k / (SPREAD_POINTS - 1)) / mid, 4) for k in range(SPREAD_POINTS))


def calibrate_serving(runs: list[dict], coeffs: Coeffs, source: str = "") -> dict:
    """runs: bench probe records of one spec (`requests` with `input_len`, `output_tokens`, `ttft_ms`,
    `tpot_ms`, `timeline_ms`); coeffs: the profile's fit at TP 1. The entry names its `mode` (from the
    timelines' events). Raises BadConfigError without enough points."""
    pa, pb, pc = coeffs.prefill
    da, db, dc = coeffs.decode
    prefill, decode, admission, spans, modes = [], [], [], {k: [] for k in KINDS}, set()
    for run in runs:
        for r in run.get("requests", []):
            t = r.get("timeline_ms") or {}
            phase = next(((a, b) for a, b in PROMPT_PHASES if a in t and b in t), None)
            if not r.get("ok") or phase is None:
                continue
            modes.add("disaggregated" if "reserved" in t else "colocated")
            start, end = phase
            n = r["input_len"]
            took = (t[end] - t[start]) / 1000
            prefill.append(took / (pa + pb * n + pc * n * n))
            admission.append(r["ttft_ms"] / 1000 - took)
            spans["prefill"].append(took)
            out = r.get("output_tokens") or 0
            if r.get("tpot_ms") and out > 1:
                decode.append(r["tpot_ms"] / 1000 / (da + db * (n + out / 2) + dc))
                spans["decode"].append(r["tpot_ms"] / 1000 * (out - 1))
    if len(prefill) < MIN_POINTS or len(decode) < MIN_POINTS:
        raise BadConfigError(f"serving calibration needs >= {MIN_POINTS} finished requests with server timelines "
                             f"(a `pdserve bench --spec` run of pdserve); got {len(prefill)} with timelines, "
                             f"{len(decode)} with a TPOT")
    if len(modes) > 1:
        raise BadConfigError("serving calibration: these runs mix disaggregated and colocated specs; give one at a time")
    return {"mode": modes.pop(), "prefill_factor": round(statistics.median(prefill), 4),
            "decode_factor": round(statistics.median(decode), 4),
            "admission_s": round(max(0.0, statistics.median(admission)), 4),
            "prefill_spread": list(spread(prefill)), "decode_spread": list(spread(decode)),
            **{f"{k}_window_s": round(statistics.median(spans[k]), 3) for k in KINDS},
            "points": len(prefill), "source": source}


def add_serving(profile: dict, benches: list[dict], source: str = "") -> dict:
    """Calibrate from `benches` (bench.json documents, or single probe records) against the profile's
    TP 1 fit and store the entry under its mode in `profile` (a profile JSON document); returns the entry.
    KeyError: the profile has no TP 1 fit."""
    tp1 = profile["tp"]["1"]
    runs = [r for b in benches for r in ([r for t in b["targets"] for r in t["runs"]] if "targets" in b else [b])]
    entry = calibrate_serving(runs, Coeffs(tuple(tp1["prefill"]), tuple(tp1["decode"])), source)
    profile.setdefault("serving", {})[entry["mode"]] = entry
    return entry
