"""The SLO autoscaler's decisions: a pure function of what the request window saw, the pools' replica counts
and a capacity model. No clock, no I/O: `autoscaler.py` runs it each interval; tests drive it with a fake
clock (`now`) and a fake `CapacityModel`.

Each `Policy.step(window, replicas)`, per autoscaled pool:
  1. `estimate_load`: the coming arrival rate -- the larger of the window's mean rate and its last two
     intervals' less two Poisson standard deviations (a step up shows at once; a steady rate's noise
     seldom does. A line fitted through the intervals was tried and dropped: on 6 noisy points it
     extrapolated chance runs into scale-ups); never above twice the busiest interval -- and the length
     mix (finished requests' (input, output) lengths; arrivals' (input, max_tokens) while too few have
     finished);
  2. the evidence of the window since the pool's last resize finished (`Window.unsettled`: a replica still
     starting or draining): its attainment (`missed`: below target), whether its latencies near the targets
     (`near`: p90 beyond `pressure` x a target, autoscale_evidence.near_targets) and the rate per replica it
     carried (`served`: its requests that finished within the SLO, over at least half a window). Missed or
     near, the records of what the pool carried at or above that rate are dropped after the decision
     (`Demonstrated.refute`: the machine got slower);
  3. the correction factor (Dynamo's SLA planner idea): measured mean latency / the capacity model's
     prediction for the same load on the current replicas -- TTFT for a prefill pool, TPOT for decode,
     both (geometric mean) for colocated -- from those requests only, and only where the pool meets the SLO
     and the model predicts it does (in overload the latencies grow with the backlog, not with the model's
     error: a ratio there ran the factor to its bound at once); smoothed (`correction_smoothing`), bounded
     to [1/4, 4], per band of the rate per replica it was measured at (`LoadBands`); a decision plans with
     the factor at the load per replica it asks about (the forecast over the current count for `up`; the
     down rate over one fewer for `down`), interpolated between learnt bands and never below 1 above
     them: a single factor of ~0.4 learnt at low load (the profile's fixed costs overstated) did not hold
     at 6x the rate, and clamping it at 1 everywhere made the model 4x pessimistic at low load, where it
     brought a second replica back for 0.48 req/s that one replica had carried twice over;
  4. `CapacityModel.needed`: the fewest replicas meeting the SLO at the forecast rate (`up`), and at the
     larger of max(forecast, observed) x (1 + scale_down_headroom) and the busiest interval seen in the
     last `scale_down_cooldown_s` (`down`: the hysteresis band; like Kubernetes' downscale stabilization,
     a pool shrinks only when even the recent peak fits fewer replicas); the demonstrated capacity
     (`Demonstrated.per_replica`: the best rate per replica carried within the SLO in the last
     `demonstrated_horizon_s`, scaled to the mix) bounds both from above: ceil(rate / demonstrated)
     replicas have served that rate (for `down`, only while latencies are clear of the targets);
  5. the decision, up only for a reason the SLO gives: "forecast" (the model asks for more than the current
     count and the forecast is beyond what the current count has carried within the SLO: up at once to
     the smaller of the two needs, after `scale_up_cooldown_s`, unless the forecast less `scale_up_tolerance`
     (10%) still fits the current count: "tolerance", Kubernetes' HPA tolerance; at GPU scale the pool
     sized to the SLO runs near its targets, and a tolerance dropped there too added replicas: 0.723x
     static GPU-hours against 0.687x in bench/serving/autoscale_sim.py); "slo_miss" (the window's
     attainment is below target: up by one); "latency" (the model asks for more, the demonstrated capacity
     says no, and the latencies near the targets: up by one); the model asking for more within what was
     carried is a hold ("demonstrated"). Down one replica at a time, only after `down` stayed below the
     count for `scale_down_stable_intervals` decisions in a row and `scale_down_cooldown_s` passed; never
     outside [min, max]. Every decision -- holds too -- carries its reason. Last, the window's `served`
     rate is recorded (`Demonstrated.record`) when the SLO held with latencies clear: later decisions, not
     this one, rest on it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Protocol

from cluster.serving.autoscale_evidence import Demonstrated, LoadBands, near_targets

DIRECTIONS = ("up", "down", "hold")
REASONS = ("below_min", "above_max", "forecast", "slo_miss", "latency", "low_load", "steady", "at_max", "cooldown",
           "hysteresis", "tolerance", "demonstrated", "no_data")
CORRECTION_BOUNDS = (0.25, 4.0)
MIX_SIZE = 200  # (input, output) pairs handed to the capacity model, evenly spaced over the window
DEFAULT_MIX = ((256, 64),)  # before any request was seen
POOL_METRICS = {"prefill": ("ttft",), "decode": ("tpot",), "colocated": ("ttft", "tpot")}


@dataclass(frozen=True)
class AutoscaleConfig:
    bounds: dict  # pool -> (min_replicas, max_replicas)
    interval_s: float = 10.0
    window_s: float = 60.0
    up_cooldown_s: float = 30.0
    down_cooldown_s: float = 120.0
    down_headroom: float = 0.2
    down_stable: int = 3
    min_samples: int = 10
    smoothing: float = 0.5
    attainment: float = 0.9  # the SLO's fraction of requests that must meet both targets
    ttft_s: float = 2.0  # the SLO's targets
    tpot_s: float = 0.15
    up_tolerance: float = 0.1  # a forecast within this fraction of what the current count serves: no scale-up
    pressure: float = 0.8  # latencies "near the targets": the attainment quantile beyond this x a target
    demonstrated_horizon_s: float = 1800.0  # how long what a replica carried within the SLO counts

    def metrics(self, pool: str) -> tuple[str, ...]:
        """What a pool's replicas decide: prefill the TTFT, decode the TPOT, colocated both."""
        return POOL_METRICS.get(pool, ("ttft", "tpot"))

    def met(self, f: "Finished", metrics: tuple[str, ...]) -> bool:
        return ("ttft" not in metrics or f.ttft <= self.ttft_s) and \
            ("tpot" not in metrics or f.tpot is None or f.tpot <= self.tpot_s)


@dataclass(frozen=True)
class Finished:
    """One request that ended (completed) inside the window; seconds on the autoscaler's clock."""
    arrival: float
    input_len: int
    output_len: int
    ttft: float
    tpot: float | None  # None: one output token


@dataclass(frozen=True)
class Window:
    now: float
    start: float  # the window's start: max(now - window_s, when the autoscaler started)
    arrivals: tuple = ()  # (time, input_len, max_tokens) of requests that arrived in it
    finished: tuple[Finished, ...] = ()
    unsettled: frozenset = frozenset()  # pools with a resize under way (a replica starting or draining)


@dataclass(frozen=True)
class Load:
    rate: float  # forecast req/s
    observed: float  # req/s over the window
    peak: float = 0.0  # req/s of the window's busiest interval
    pairs: tuple = DEFAULT_MIX  # (input, output) lengths
    surge: float = 0.0  # req/s of the last interval less two Poisson standard deviations (a step, at once)

    def at(self, rate: float) -> "Load":
        return replace(self, rate=rate)


@dataclass(frozen=True)
class Decision:
    pool: str
    current: int
    target: int
    direction: str  # up | down | hold
    reason: str
    need: int  # replicas the model asked for at the forecast (max + 1: more than max would be needed)
    rate: float
    correction: float  # the factor the decision planned with (at the forecast's load per replica)
    demonstrated: float = 0.0  # req/s one replica has carried within the SLO at this mix (0: none yet)

    def log_line(self) -> str:
        return (f"autoscaler: pool {self.pool} {self.direction} {self.current} -> {self.target} ({self.reason}; "
                f"forecast {self.rate:.3g} req/s needs {self.need}, correction x{self.correction:.2f}, "
                f"demonstrated {self.demonstrated:.3g} req/s per replica)")


class CapacityModel(Protocol):
    def needed(self, pool: str, load: Load, correction: float, bounds: tuple[int, int]) -> int:
        """Fewest replicas of `pool` in [min, max] meeting the SLO at `load.rate` with the model's step times
        x `correction`; max + 1 when even max does not."""

    def predict(self, pool: str, load: Load, replicas: int) -> dict[str, float]:
        """The uncorrected model's mean latencies ({"ttft": s} and/or {"tpot": s}: the pool's metrics) at
        `load.rate` on `replicas`."""


def estimate_load(w: Window, cfg: AutoscaleConfig, last_pairs: tuple = DEFAULT_MIX) -> Load:
    span = max(w.now - w.start, 1e-9)
    observed = len(w.arrivals) / span
    nb = max(1, int(round(span / cfg.interval_s)))
    width = span / nb
    counts = [0] * nb
    for t, _, _ in w.arrivals:
        counts[min(nb - 1, max(0, int((t - w.start) / width)))] += 1
    rates = [c / width for c in counts]
    # the last two intervals, less two Poisson standard deviations: a real step up shows within them, the
    # noise of a steady rate seldom does
    last = sum(counts[-2:])
    forecast = max(observed, (last - 2 * math.sqrt(last)) / (width * len(counts[-2:])))
    forecast = min(max(forecast, 0.0), 2 * max(rates))
    if len(w.finished) >= cfg.min_samples:
        pairs = tuple((f.input_len, f.output_len) for f in w.finished)
    elif w.arrivals:
        pairs = tuple((i, o) for _, i, o in w.arrivals)
    else:
        pairs = last_pairs
    step = max(1, len(pairs) // MIX_SIZE)
    surge = max(0.0, (counts[-1] - 2 * math.sqrt(counts[-1])) / width)
    return Load(forecast, observed, max(rates), pairs[::step], surge)


def measured_latency(finished, metrics: tuple[str, ...] = ("ttft", "tpot")) -> dict[str, float]:
    out = {"ttft": sum(f.ttft for f in finished) / len(finished)} if "ttft" in metrics else {}
    tpots = [f.tpot for f in finished if f.tpot is not None]
    if tpots and "tpot" in metrics:
        out["tpot"] = sum(tpots) / len(tpots)
    return out


def latency_ratio(measured: dict[str, float], predicted: dict[str, float]) -> float | None:
    """Geometric mean of measured / predicted over the metrics both have (None: none comparable)."""
    logs = [math.log(measured[k] / predicted[k]) for k in predicted if k in measured
            and measured[k] > 0 and predicted[k] > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


@dataclass
class _PoolState:
    last_change: float = -math.inf
    settled: float = -math.inf  # requests arriving from then on met the pool at its current size (inf: not yet)
    low_streak: int = 0
    correction: float = 1.0  # the factor over all loads (smoothed, bounded): what /metrics shows; plans use bands
    history: list = field(default_factory=list)  # (time, peak rate) over the last scale_down_cooldown_s
    bands: LoadBands = field(default_factory=lambda: LoadBands(bounds=CORRECTION_BOUNDS))
    shown: Demonstrated = field(default_factory=Demonstrated)


@dataclass(frozen=True)
class _Evidence:
    """What the window says about the pool at its current size (requests since its last resize finished)."""
    since: tuple  # Finished
    served: float  # req/s per replica over them (0: too short a stretch to count)
    missed: bool  # attainment below target
    near: bool  # latencies approaching the targets


@dataclass
class Policy:
    cfg: AutoscaleConfig
    capacity: CapacityModel
    pools: dict = field(default_factory=dict)  # pool -> _PoolState
    pairs: tuple = DEFAULT_MIX

    def state(self, pool: str) -> _PoolState:
        return self.pools.setdefault(pool, _PoolState(shown=Demonstrated(self.cfg.demonstrated_horizon_s)))

    def step(self, w: Window, replicas: dict[str, int]) -> list[Decision]:
        load = estimate_load(w, self.cfg, self.pairs)
        self.pairs = load.pairs
        return [self._decide(pool, w, load, replicas[pool], bounds) for pool, bounds in self.cfg.bounds.items()
                if pool in replicas]

    def evidence(self, pool: str, w: Window, cur: int) -> _Evidence:
        s, cfg = self.state(pool), self.cfg
        since = tuple(f for f in w.finished if f.arrival >= s.settled)
        if len(since) < cfg.min_samples:
            return _Evidence(since, 0.0, False, False)
        metrics = cfg.metrics(pool)
        missed = sum(cfg.met(f, metrics) for f in since) / len(since) < cfg.attainment
        near = near_targets(since, metrics, {"ttft": cfg.ttft_s, "tpot": cfg.tpot_s}, cfg.attainment, cfg.pressure)
        span = w.now - max(w.start, s.settled)
        # requests finished within the SLO, not arrivals: in a step up the arrivals run ahead while the backlog
        # has not finished yet (counting them, a pool about to miss showed 1.37 req/s per replica "carried");
        # a stretch shorter than half a window can be a burst a queue absorbed, not a rate carried
        served = sum(cfg.met(f, metrics) for f in since) / span / max(cur, 1) if span >= cfg.window_s / 2 else 0.0
        return _Evidence(since, served, missed, near)

    def correct(self, pool: str, w: Window, load: Load, current: int, ev: _Evidence) -> None:
        """Fold the window's measured / predicted latency ratio (requests since the pool's last change) into
        the band of the rate per replica it was measured at."""
        s = self.state(pool)
        since = ev.since
        if len(since) < self.cfg.min_samples or load.observed <= 0 or ev.missed:
            return  # (missing the SLO: latencies measure a backlog; the "slo_miss" rule acts instead)
        span = max(w.now - max(w.start, s.settled), 1e-9)
        rate = sum(1 for t, _, _ in w.arrivals if t >= s.settled) / span
        predicted = self.capacity.predict(pool, load.at(max(rate, 1e-6)), current)
        targets = {"ttft": self.cfg.ttft_s, "tpot": self.cfg.tpot_s}
        if any(v > targets[k] for k, v in predicted.items()):
            return  # the model itself says overloaded: latencies there measure the backlog, not the model
        ratio = latency_ratio(measured_latency(since, self.cfg.metrics(pool)), predicted)
        if ratio is None:
            return
        lo, hi = CORRECTION_BOUNDS
        a = self.cfg.smoothing
        s.correction = min(hi, max(lo, math.exp(a * math.log(ratio) + (1 - a) * math.log(s.correction))))
        s.bands.learn(max(rate, 1e-6) / max(current, 1), ratio, a)

    def _decide(self, pool: str, w: Window, load: Load, cur: int, bounds: tuple[int, int]) -> Decision:
        s = self.state(pool)
        if s.settled == math.inf and pool not in w.unsettled:
            s.settled = w.now  # the last resize has finished: from now on the pool is its new size
        ev = self.evidence(pool, w, cur)
        self.correct(pool, w, load, cur, ev)
        d = self._choose(pool, w, load, cur, bounds, ev)
        if (ev.missed or ev.near) and ev.served > 0:
            s.shown.refute(ev.served)  # carried before, not now: the machine got slower (after the decision:
            # this one names "latency", the next ones rest on the model)
        elif ev.served > 0:
            s.shown.record(w.now, ev.served, [(f.input_len, f.output_len) for f in ev.since])
        return d

    def _choose(self, pool: str, w: Window, load: Load, cur: int, bounds: tuple[int, int],
                ev: _Evidence) -> Decision:
        lo, hi = bounds
        s = self.state(pool)
        c = s.bands.factor_at(load.rate / max(cur, 1))  # the factor learnt at the load cur would carry
        s.history = [h for h in s.history if h[0] >= w.now - self.cfg.down_cooldown_s] + [(w.now, load.peak)]
        up = self.capacity.needed(pool, load, c, bounds) if load.rate > 0 else lo
        demo = s.shown.per_replica(load.pairs, w.now)
        # what the replicas carried bounds the need from above; a step shows against it in its first interval
        # (the forecast's two intervals would halve it: a step to 2.6 req/s read 0.99, under the 1 carried)
        lead = max(load.rate, load.surge)
        demo_need = math.ceil(lead / demo - 1e-9) if demo > 0 else hi + 1
        out = lambda target, direction, reason: self._emit(pool, cur, target, direction, reason, up, load, w.now,
                                                           c, demo)
        if cur < lo:
            return out(lo, "up", "below_min")
        if cur > hi:
            return out(hi, "down", "above_max")
        beyond = up > cur and demo_need > cur  # the model asks for more, and no replica has carried this much
        if beyond and not ev.missed and self.cfg.up_tolerance > 0 and \
                self.capacity.needed(pool, load.at(load.rate / (1 + self.cfg.up_tolerance)), c, bounds) <= cur:
            s.low_streak = 0
            return out(cur, "hold", "tolerance")  # the forecast is within the tolerance of what cur serves
        want, reason = cur, ""
        if beyond:
            want, reason = min(up, demo_need), "forecast"
        elif ev.missed:
            want, reason = cur + 1, "slo_miss"
        elif up > cur and ev.near:  # the evidence holding the model back is wearing thin
            want, reason = cur + 1, "latency"
        elif up > cur:
            s.low_streak = 0
            return out(cur, "hold", "demonstrated")  # the replicas have carried this load within the SLO
        if want > cur:
            s.low_streak = 0
            if cur >= hi:
                return out(cur, "hold", "at_max")
            if w.now - s.last_change < self.cfg.up_cooldown_s:
                return out(cur, "hold", "cooldown")
            return out(min(want, hi), "up", reason)
        peak = max(h[1] for h in s.history)
        down_rate = max(peak, max(load.rate, load.observed) * (1 + self.cfg.down_headroom))
        # the factor learnt at the load one replica fewer would carry (none learnt there: the model's own)
        c_down = s.bands.factor_at(down_rate / max(cur - 1, 1))
        down = self.capacity.needed(pool, load.at(down_rate), c_down, bounds) if down_rate > 0 else lo
        if demo > 0 and not ev.near:  # (what was carried counts for a shrink only while latencies are clear)
            down = min(down, max(lo, math.ceil(down_rate / demo - 1e-9)))
        if down >= cur or cur <= lo:
            s.low_streak = 0
            return out(cur, "hold", "steady")
        s.low_streak += 1
        if s.low_streak < self.cfg.down_stable:
            return out(cur, "hold", "hysteresis")
        if w.now - s.last_change < self.cfg.down_cooldown_s:
            return out(cur, "hold", "cooldown")
        s.low_streak = 0
        return out(max(cur - 1, down, lo), "down", "low_load")

    def _emit(self, pool, cur, target, direction, reason, need, load, now, correction, demo) -> Decision:
        if direction != "hold":
            self.state(pool).last_change, self.state(pool).settled = now, math.inf
        return Decision(pool, cur, target, direction, reason, need, load.rate, correction, demo)
