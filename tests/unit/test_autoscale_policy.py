"""The SLO autoscaler's decisions (cluster/serving/autoscale_policy.py) on a fake clock and a fake capacity
model: scale-up under a rising rate, scale-down only after hysteresis and cooldown, no flapping on a noisy
rate, min/max clamps, the correction factor converging to the true slowdown; the runtime's
`request_resources` on a non-local Ray (a fake SDK), the request window and the /metrics series."""
from __future__ import annotations

import asyncio
import math
import random
from types import SimpleNamespace

import pytest

from cluster.http.metrics import FrontendMetrics
from cluster.serving.autoscale_policy import AutoscaleConfig, Finished, Load, Policy, Window, estimate_load
from cluster.serving.autoscaler import Autoscaler, RequestLog, resource_bundles, resource_requester
from cluster.serving_api import BackendStats
from cluster.spec import SpecError, parse_spec

MU = 1.0  # req/s one replica of the fake serves at all (at the SLO: 3/4 of it, where TTFT reaches 2 s)


class FakeCapacity:
    """A replica serves MU req/s (x 1/correction); latency grows with utilisation: TTFT 0.5 s / (1 - u)
    meets the 2 s target up to u = 3/4, so `needed` keeps u below that."""

    def __init__(self):
        self.calls = 0

    def needed(self, pool, load, correction, bounds):
        self.calls += 1
        lo, hi = bounds
        return min(hi + 1, max(lo, math.ceil(load.rate * correction / (0.75 * MU) - 1e-9)))

    def predict(self, pool, load, replicas):
        u = min(0.95, load.rate / (replicas * MU))
        return {"ttft": 0.5 / (1 - u), "tpot": 0.05 / (1 - u)}


def cfg(**kw):
    base = dict(bounds={"colocated": (1, 4)}, interval_s=10, window_s=60, up_cooldown_s=30, down_cooldown_s=120,
                down_headroom=0.2, down_stable=3, min_samples=10, smoothing=0.5)
    return AutoscaleConfig(**{**base, **kw})


class Sim:
    """Drives a Policy interval by interval on a fake clock with arrivals at `rate(t)` (deterministic
    Poisson) and finished requests whose latencies are the fake's prediction x `slowdown`."""

    def __init__(self, policy, rate, slowdown=1.0, replicas=1, seed=0):
        self.p, self.rate, self.slowdown, self.n = policy, rate, slowdown, replicas
        self.rng, self.t, self.arrivals, self.finished, self.log = random.Random(seed), 0.0, [], [], []

    def run(self, until):
        while self.t < until:
            end = self.t + self.p.cfg.interval_s
            t = self.t
            while True:
                t += self.rng.expovariate(max(self.rate(t), 1e-6))
                if t >= end:
                    break
                self.arrivals.append((t, 100, 20))
                lat = self.p.capacity.predict("colocated", Load(self.rate(t), self.rate(t)), self.n)
                self.finished.append(Finished(t, 100, 20, lat["ttft"] * self.slowdown, lat["tpot"] * self.slowdown))
            self.t = end
            start = max(0.0, end - self.p.cfg.window_s)
            w = Window(end, start, tuple(a for a in self.arrivals if a[0] >= start),
                       tuple(f for f in self.finished if f.arrival >= start))
            d = self.p.step(w, {"colocated": self.n})[0]
            self.log.append((end, d))
            self.n = d.target
        return self.log


def test_scale_up_under_a_rising_rate_and_never_above_max():
    log = Sim(Policy(cfg(), FakeCapacity()), lambda t: 0.5 + t / 60).run(300)  # 0.5 -> 5.5 req/s
    targets = [d.target for _, d in log]
    assert targets == sorted(targets), "a steadily rising rate only ever scales up"
    assert max(targets) == 4 and all(t <= 4 for t in targets)
    ups = [(t, d) for t, d in log if d.direction == "up"]
    assert ups and all(d.reason in ("forecast", "slo_miss") for _, d in ups)
    first3 = next(t for t, d in log if d.target >= 3)
    assert first3 <= 150, f"3 replicas (needed from ~2 req/s, t~90 s) only at t={first3}"
    assert any(d.reason == "at_max" for _, d in log[-5:])


def test_scale_down_one_at_a_time_only_after_hysteresis_and_cooldown():
    p = Policy(cfg(), FakeCapacity())
    log = Sim(p, lambda t: 3.5 if t < 100 else 0.3, replicas=4).run(600)
    downs = [(t, d) for t, d in log if d.direction == "down"]
    assert [d.target for _, d in downs] == [3, 2, 1]
    assert all(d.current - d.target == 1 and d.reason == "low_load" for _, d in downs)
    # the first shrink waits for the window to forget the busy part and 3 low decisions in a row
    assert downs[0][0] >= 100 + 3 * 10
    gaps = [b[0] - a[0] for a, b in zip(downs, downs[1:])]
    assert all(g >= 120 for g in gaps), gaps  # down cooldown
    holds = [d.reason for t, d in log if d.direction == "hold" and t > 100 and d.current > 1]
    assert "hysteresis" in holds and "cooldown" in holds


def test_no_flapping_on_a_noisy_rate_near_a_boundary():
    rng = random.Random(3)
    noise = {k: rng.uniform(-0.3, 0.3) for k in range(200)}
    # 1.6 req/s, each 10 s interval +-0.3 (and Poisson): the rate crosses 1.5, where 2 replicas stop
    # sufficing, every few intervals; the pool goes to 3 and stays there
    log = Sim(Policy(cfg(), FakeCapacity()), lambda t: 1.6 + noise[int(t // 10)], replicas=2, seed=5).run(1800)
    changes = [(t, d.direction, d.target) for t, d in log if d.direction != "hold"]
    assert [c[1:] for c in changes] == [("up", 3)], changes
    assert sum(1 for _, d in log if d.reason == "hysteresis") > 0 or all(d.target == 3 for _, d in log[1:])


def test_min_and_max_clamps():
    c = cfg(bounds={"colocated": (2, 3)})
    p = Policy(c, FakeCapacity())
    w = Window(100.0, 40.0, tuple((40 + k * 0.01, 100, 20) for k in range(6000)))  # 100 req/s
    d = p.step(w, {"colocated": 3})[0]
    assert (d.direction, d.target, d.reason, d.need) == ("hold", 3, "at_max", 4)
    d = Policy(c, FakeCapacity()).step(w, {"colocated": 1})[0]
    assert (d.direction, d.target, d.reason) == ("up", 2, "below_min")
    idle = Window(1000.0, 940.0)
    p = Policy(c, FakeCapacity())
    for k in range(10):
        d = p.step(Window(1000.0 + 200 * k, 940.0 + 200 * k), {"colocated": 2})[0]
        assert d.target == 2 and d.direction == "hold"
    d = Policy(c, FakeCapacity()).step(idle, {"colocated": 5})[0]
    assert (d.direction, d.target, d.reason) == ("down", 3, "above_max")


def test_correction_factor_converges_to_the_true_slowdown_and_raises_the_need():
    p = Policy(cfg(up_cooldown_s=0), FakeCapacity())
    log = Sim(p, lambda t: 1.2, slowdown=2.0, replicas=2).run(600)
    factors = [d.correction for _, d in log]
    # measured / predicted at the observed rate: the Poisson noise of that rate stays in each ratio
    assert abs(sum(factors[-20:]) / 20 - 2.0) < 0.1 and all(abs(f - 2.0) < 0.3 for f in factors[-40:]), factors
    assert log[-1][1].target == 4  # 1.2 req/s at half speed: ceil(1.2 x 2 / 0.75) replicas
    steady = Policy(cfg(), FakeCapacity())
    Sim(steady, lambda t: 1.2, slowdown=1.0, replicas=2).run(300)
    assert abs(steady.state("colocated").correction - 1.0) < 0.05


def test_the_forecast_follows_a_rising_rate_and_the_mix_comes_from_the_window():
    c = cfg()
    rising = tuple((t / 10, 300, 40) for t in range(0, 600) for _ in range(1 + t // 100))  # 1 -> 6 per 0.1 s
    load = estimate_load(Window(60.0, 0.0, rising), c)
    assert load.rate > load.observed and load.rate <= 2 * 60
    assert set(load.pairs) == {(300, 40)}
    done = tuple(Finished(1.0, 100 + k, 7, 0.1, 0.01) for k in range(20))
    assert estimate_load(Window(60.0, 0.0, rising, done), c).pairs[0] == (100, 7)


def test_request_resources_on_a_multinode_ray_only():
    data = {"model": "smollm2-135m", "mode": "colocated", "pools": {"colocated": {
        "replicas": 1, "max_replicas": 4, "resources": {"num_cpus": 2, "num_gpus": 1, "custom": {"a10": 1}}}},
        "autoscaling": {"enabled": True, "pools": {"colocated": {"max_replicas": 4}}}}
    calls = []
    sdk = SimpleNamespace(request_resources=lambda **kw: calls.append(kw))
    assert resource_requester(parse_spec(data), sdk) is None  # the private local Ray: no node to add
    spec = parse_spec({**data, "ray": {"address": "10.0.0.1:6379"}})
    assert resource_bundles(spec, {"colocated": 3}) == [{"CPU": 2.0, "GPU": 1.0, "a10": 1.0}] * 3
    scaled = []

    async def scale(pool, n):
        scaled.append((pool, n))

    c = cfg()
    a = Autoscaler(c, Policy(c, FakeCapacity()), RequestLog(), scale, lambda: {"colocated": 1}, lambda: 100.0,
                   resource_requester(spec, sdk))
    a.started = 40.0
    for k in range(180):  # 3 req/s over the window
        a.requests.arrivals.append((40 + k / 3, 100, 20))
    decisions = asyncio.run(a.tick())
    assert [(d.direction, d.target) for d in decisions] == [("up", 4)]  # 3 req/s at 3/4 of MU each
    assert calls == [{"bundles": [{"CPU": 2.0, "GPU": 1.0, "a10": 1.0}] * 4}] and scaled == [("colocated", 4)]
    status = a.status()
    assert status["pools"]["colocated"]["target"] == 4 and status["decisions"] == {("colocated", "up", "forecast"): 1}
    m = FrontendMetrics()
    m.refresh(BackendStats(autoscaling=status))
    m.refresh(BackendStats(autoscaling=status))  # running totals: counted once
    text = m.render().decode()
    assert 'pdserve_autoscaler_target_replicas{pool="colocated"} 4.0' in text
    assert 'pdserve_autoscaler_decisions_total{direction="up",pool="colocated",reason="forecast"} 1.0' in text
    assert 'pdserve_autoscaler_correction_factor{pool="colocated"} 1.0' in text


def test_the_request_log_reads_ttft_and_tpot_from_a_flight_timeline():
    log = RequestLog()
    f = SimpleNamespace(prompt_ids=[1] * 30, params=SimpleNamespace(max_tokens=9), output_ids=list(range(9)),
                        timeline={"queued": 1000.0, "first_token": 1000.5, "finish": 1002.1})
    log.opened(f, 50.0)
    log.ended(f, "completed", 52.1)
    log.ended(f, "failed", 52.2)  # only completed requests say what the service did
    w = log.window(53.0, 0.0)
    assert w.arrivals == ((50.0, 30, 9),)
    (done,) = w.finished
    assert done.ttft == pytest.approx(0.5) and done.tpot == pytest.approx(0.2) and done.arrival == pytest.approx(50.0)


@pytest.mark.parametrize("auto,key", [
    ({"pools": {"colocated": {"min_replicas": 3, "max_replicas": 2}}}, "autoscaling.pools.colocated.min_replicas"),
    ({"pools": {"colocated": {"min_replicas": 0}}}, "autoscaling.pools.colocated.min_replicas"),
    ({"pools": {"colocated": {"max_replicas": 3}}}, "autoscaling.pools.colocated.max_replicas"),
    ({"pools": {"decode": {}}}, "autoscaling.pools.decode"),
    ({"interval_s": 0}, "autoscaling.interval_s"),
    ({"interval_s": 30, "window_s": 10}, "autoscaling.window_s"),
    ({"pools": {"colocated": {"min_replicas": 2}}}, "pools.colocated.replicas"),
    ({"cooldown_s": 5}, "autoscaling.cooldown_s"),
])
def test_bad_autoscaling_specs_name_the_key(auto, key):
    data = {"model": "smollm2-135m", "mode": "colocated", "pools": {"colocated": {"replicas": 1, "max_replicas": 2}},
            "autoscaling": {"enabled": True, **auto}}
    with pytest.raises(SpecError) as e:
        parse_spec(data)
    assert key + ":" in str(e.value), str(e.value)


def steady_window(rate: float, ttft: float, now: float = 60.0) -> Window:
    """Arrivals evenly spaced at `rate` over the last 60 s, each finished with `ttft` (the 2 s target)."""
    times = [k / rate for k in range(int(now * rate))]
    return Window(now, 0.0, tuple((t, 100, 20) for t in times), tuple(Finished(t, 100, 20, ttft, 0.05) for t in times))


@pytest.mark.parametrize("rate, ttft, want", [
    (0.8, 0.5, ("hold", "tolerance")),   # 7% over one replica's 0.75 req/s: within the 10% tolerance
    (0.9, 0.5, ("up", "forecast")),      # 20% over: a real step
    (0.8, 3.0, ("up", "forecast")),      # within the tolerance, but the window misses the SLO: no hold
])
def test_scale_up_tolerance(rate, ttft, want):
    d = Policy(cfg(), FakeCapacity()).step(steady_window(rate, ttft), {"colocated": 1})[0]
    assert (d.direction, d.reason) == want
    off = Policy(cfg(up_tolerance=0.0), FakeCapacity()).step(steady_window(rate, ttft), {"colocated": 1})[0]
    assert off.direction == "up"  # without the tolerance every one of them scales up
