"""The SLO autoscaler at run time: the router's request window, the interval loop, applying decisions.

    RequestLog          the router calls `opened(flight, now)` at intake and `ended(flight, outcome, now)`
                        at a flight's end; it keeps the last window's arrivals (time, prompt tokens,
                        max_tokens) and completed requests' lengths, TTFT and TPOT (router clock)
    Autoscaler.run      every `interval_s`: `tick()` -> a `Window` snapshot -> `Policy.step` (in a thread:
                        the simulations must not stall the event loop) -> per decision its counters and
                        one log line (logger pdserve.autoscaler; a hold for the same reason as the one
                        before it is only counted); a change asks Ray for the resources of every pool's target first
                        (`request_resources`, multi-node Ray only, so a Ray autoscaler can add nodes) and
                        then goes through the router's own resize path (`ClusterRouter.scale`: joins, or
                        drains that hand off and leave -- nothing fails because of it)
    Autoscaler.status   what /metrics shows (`BackendStats.autoscaling`): per pool target, current,
                        correction, forecast rate, need, and decision counts by (pool, direction, reason)
    autoscale_config    the spec's `autoscaling:` + `slo:` -> the policy's frozen `AutoscaleConfig`
    resource_bundles / resource_requester   what a target needs from Ray, and the call that asks for it
                        (the Ray SDK is passed in: only `ray_pools` imports ray)
Who builds it: `ray_pools.start_cluster` when `autoscaling.enabled`; it sets `router.autoscaler`, whose
loop the router starts with its own (`_ensure_started`) and cancels at shutdown.
"""
from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from typing import Awaitable, Callable

from cluster.serving.autoscale_policy import AutoscaleConfig, Decision, Finished, Policy, Window

log = logging.getLogger("pdserve.autoscaler")


class RequestLog:
    def __init__(self, keep_s: float = 600.0):
        self.keep_s = keep_s
        self.arrivals: deque = deque()  # (time, input_len, max_tokens)
        self.finished: deque[tuple[float, Finished]] = deque()  # (end time, record)

    def opened(self, f, now: float) -> None:
        self.arrivals.append((now, len(f.prompt_ids), f.params.max_tokens))
        self._prune(now)

    def ended(self, f, outcome: str, now: float) -> None:
        t, n = f.timeline, len(f.output_ids)
        if outcome != "completed" or n == 0 or not {"queued", "first_token", "finish"} <= t.keys():
            return
        ttft = t["first_token"] - t["queued"]
        tpot = (t["finish"] - t["first_token"]) / (n - 1) if n > 1 else None
        arrival = now - (t["finish"] - t["queued"])  # (the timeline is in unix seconds; this clock is not)
        self.finished.append((now, Finished(arrival, len(f.prompt_ids), n, ttft, tpot)))

    def window(self, now: float, start: float, unsettled: frozenset = frozenset()) -> Window:
        return Window(now, start, tuple(a for a in self.arrivals if a[0] >= start),
                      tuple(f for end, f in self.finished if end >= start), unsettled)

    def _prune(self, now: float) -> None:
        while self.arrivals and self.arrivals[0][0] < now - self.keep_s:
            self.arrivals.popleft()
        while self.finished and self.finished[0][0] < now - self.keep_s:
            self.finished.popleft()


def autoscale_config(spec) -> AutoscaleConfig:
    from cluster.spec_autoscaling import pool_bounds

    a = spec.autoscaling
    return AutoscaleConfig(pool_bounds(spec), a.interval_s, a.window_s, a.scale_up_cooldown_s,
                           a.scale_down_cooldown_s, a.scale_down_headroom, a.scale_down_stable_intervals,
                           a.min_samples, a.correction_smoothing, 0.9,
                           spec.slo.ttft_ms / 1000, spec.slo.tpot_ms / 1000, a.scale_up_tolerance,
                           a.latency_pressure, a.demonstrated_horizon_s)


def resource_bundles(spec, targets: dict[str, int]) -> list[dict[str, float]]:
    """One Ray bundle per rank of every replica the targets ask for (what `ray_pools` places)."""
    out = []
    for name, pool in spec.pools_in_use().items():
        r = pool.resources
        rank = {"CPU": r.num_cpus, **({"GPU": r.num_gpus} if r.num_gpus else {}), **r.custom}
        out += [dict(rank) for _ in range(targets.get(name, pool.replicas) * pool.degree)]
    return out


def resource_requester(spec, sdk) -> Callable[[dict[str, int]], None] | None:
    """On a multi-node Ray (address not `local`): a call asking Ray's autoscaler for what the targets need
    (`sdk`: `ray.autoscaler.sdk`, or a fake); None on the private local Ray (no node can be added)."""
    if spec.ray.address == "local":
        return None
    return lambda targets: sdk.request_resources(bundles=resource_bundles(spec, targets))


class Autoscaler:
    def __init__(self, cfg: AutoscaleConfig, policy: Policy, requests: RequestLog,
                 scale: Callable[[str, int], Awaitable], replicas: Callable[[], dict[str, int]],
                 clock: Callable[[], float], request_resources: Callable[[dict[str, int]], None] | None = None,
                 unsettled: Callable[[], frozenset] = frozenset):
        """`scale(pool, n)`: the router's resize; `replicas()`: each pool's current target count;
        `unsettled()`: the pools with a replica still starting or draining."""
        self.cfg, self.policy, self.requests, self._scale, self._replicas = cfg, policy, requests, scale, replicas
        self.clock, self.request_resources, self._unsettled = clock, request_resources, unsettled
        self.started = clock()
        if not log.handlers and not logging.getLogger().handlers:  # `pdserve serve` configures no logging
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
        self.last: dict[str, Decision] = {}
        self.counts: Counter = Counter()  # (pool, direction, reason) -> decisions
        self.failed: Counter = Counter()  # pool -> changes the resize path refused or could not finish

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            await self.tick()

    async def tick(self) -> list[Decision]:
        now = self.clock()
        w = self.requests.window(now, max(now - self.cfg.window_s, self.started), self._unsettled())
        decisions = await asyncio.to_thread(self.policy.step, w, self._replicas())
        for d in decisions:
            before = self.last.get(d.pool)
            self.last[d.pool] = d
            self.counts[(d.pool, d.direction, d.reason)] += 1
            if d.direction != "hold" or before is None or before.reason != d.reason:
                log.info(d.log_line())  # (a hold like the one before it only counts)
        changes = [d for d in decisions if d.direction != "hold"]
        if changes and self.request_resources is not None:
            targets = {**self._replicas(), **{d.pool: d.target for d in changes}}
            try:
                self.request_resources(targets)
            except Exception as e:  # noqa: BLE001 - the resize still tries what the cluster has
                log.warning("autoscaler: request_resources(%s) failed: %s: %s", targets, type(e).__name__, e)
        for d in changes:
            try:
                await self._scale(d.pool, d.target)
            except Exception as e:  # noqa: BLE001 - a refused or failed resize: logged, retried next interval
                self.failed[d.pool] += 1
                log.warning("autoscaler: resizing pool %s to %d failed: %s: %s", d.pool, d.target,
                            type(e).__name__, e)
        return decisions

    def status(self) -> dict:
        pools = {p: {"target": d.target, "current": d.current, "need": d.need, "forecast_rate": d.rate,
                     "correction": self.policy.state(p).correction, "failed": self.failed[p]}
                 for p, d in self.last.items()}
        return {"pools": pools, "decisions": {k: v for k, v in self.counts.items()}}
