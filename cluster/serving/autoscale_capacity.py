"""`PlannerCapacity`: the autoscaler's `CapacityModel` (autoscale_policy.py) over the planner's latency model
and simulators. Pure Python (the planner's core); the bench (`bench/serving/autoscale_sim.py`) uses it as the live
autoscaler does.

    needed(pool, load, correction, (lo, hi))   a walk over [lo, hi] replicas from the last answer (attainment
        grows with replicas: a step down while one fewer still meets, up until one meets): Poisson arrivals at
        load.rate with the load's length mix (common random numbers: the same seed at every count) through
        the pool's simulator -- colocated: `simulate_colocated`; prefill: `simulate_disaggregated` with a
        free decode side (TTFT only); decode: `simulate_decode_only` (TPOT only), DistServe's per-phase
        rule -- each replica's model scaled by `correction` (`ScaledLatency`); the fewest replicas whose
        attainment of the pool's metrics reaches the target; hi + 1 when hi does not
    predict(pool, load, n)                     the same simulation, uncorrected, on n replicas: the mean
        TTFT and/or TPOT the correction factor compares measurements with
    capacity_for_spec(spec)                    setups per pool from a cluster spec (KV pages, token budget,
        max_num_seqs; `setups_from_spec`) and its latency profile (`profile_for`: autoscaling.profile, else
        deploy/profiles' one of the model and dtype; else the hardware entry's own model)
Results are cached per (pool, rate, mix, correction, replicas), rounded, so a steady load costs nothing.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

from cluster.planner.inputs.workload import poisson_requests
from cluster.planner.latency.base import ZeroLatency
from cluster.planner.latency.base import LatencyModel
from cluster.planner.sim.coloc import ColocSetup, simulate_colocated
from cluster.planner.sim.disagg import DecodeSetup, Link, PrefillSetup, simulate_decode_only, simulate_disaggregated
from cluster.planner.sim.metrics import SLO, SimResult
from cluster.serving.autoscale_policy import POOL_METRICS, Load

FREE_LINK = Link(1.0, float("inf"), 1)


class ScaledLatency(LatencyModel):
    """Another model's step times x `factor` (the online correction): every stage, the hop between stages."""

    def __init__(self, base: LatencyModel, factor: float):
        super().__init__(base.parallel)
        self.base, self.factor = base, factor
        self.admission_s, self.drift = base.admission_s, base.drift

    def stage_prefill(self, tokens, sq):
        return self.factor * self.base.stage_prefill(tokens, sq)

    def stage_decode_lines(self, batch):
        return tuple((self.factor * a, self.factor * b) for a, b in self.base.stage_decode_lines(batch))

    def stage_mixed(self, tokens, sq, batch, context):
        return self.factor * self.base.stage_mixed(tokens, sq, batch, context)

    def p2p(self, tokens):
        return self.factor * self.base.p2p(tokens)


class PlannerCapacity:
    def __init__(self, setups: dict, slo: SLO, requests: int = 300, lifetimes: float = 8.0, seed: int = 0):
        """`setups`: pool -> ColocSetup | PrefillSetup | DecodeSetup (one replica); `requests`: simulated
        requests per probe, at least (more at high rates: `lifetimes` low-load request lifetimes)."""
        self.setups, self.slo, self.requests, self.lifetimes, self.seed = setups, slo, requests, lifetimes, seed
        self._sim = lru_cache(maxsize=512)(self._simulate)
        self._hint: dict[str, int] = {}

    def needed(self, pool: str, load: Load, correction: float, bounds: tuple[int, int]) -> int:
        lo, hi = bounds
        if load.rate <= 0:
            return lo
        n = min(hi, max(lo, self._hint.get(pool, lo)))  # the last answer: the next one is seldom far
        meets = lambda k: self._meets(pool, load, correction, k)  # noqa: E731
        if meets(n):
            while n > lo and meets(n - 1):
                n -= 1
        else:
            while n < hi and not meets(n + 1):
                n += 1
            n += 1  # (hi + 1: not even hi meets it)
        self._hint[pool] = min(n, hi)
        return n

    def predict(self, pool: str, load: Load, replicas: int) -> dict[str, float]:
        r = self._run(pool, load, 1.0, replicas).results
        out = {}
        if "ttft" in POOL_METRICS.get(pool, ()):
            out["ttft"] = sum(x.ttft for x in r) / len(r)
        if "tpot" in POOL_METRICS.get(pool, ()):
            out["tpot"] = sum(x.tpot for x in r) / len(r)
        return out

    def attainment(self, pool: str, result: SimResult) -> float:
        metrics = POOL_METRICS.get(pool, ("ttft", "tpot"))
        if metrics == ("ttft",):
            return result.ttft_attainment(self.slo)
        return result.tpot_attainment(self.slo) if metrics == ("tpot",) else result.attainment(self.slo)

    def _meets(self, pool: str, load: Load, correction: float, n: int) -> bool:
        return self.attainment(pool, self._run(pool, load, correction, n)) >= self.slo.attainment

    def _run(self, pool: str, load: Load, correction: float, n: int) -> SimResult:
        rate = float(f"{load.rate:.3g}")  # (rounded: nearby rates share a cache entry)
        return self._sim(pool, rate, tuple(load.pairs), round(correction, 2), n)

    def _simulate(self, pool: str, rate: float, pairs: tuple, correction: float, n: int) -> SimResult:
        setup = self.setups[pool]
        if correction != 1.0:
            setup = dataclasses.replace(setup, model=ScaledLatency(setup.model, correction))
        m = setup.model
        life = sum(m.prefill(i, i * i) + (o - 1) * m.decode(1, i + o / 2) for i, o in pairs) / len(pairs)
        size = max(self.requests, min(4000, int(rate * self.lifetimes * life)))
        if isinstance(setup, ColocSetup):
            return simulate_colocated(poisson_requests(list(pairs), rate, size, self.seed), [setup] * n)
        if isinstance(setup, PrefillSetup):
            reqs = poisson_requests([(i, 1) for i, _ in pairs], rate, size, self.seed)
            return simulate_disaggregated(reqs, [setup] * n, [DecodeSetup(ZeroLatency(), 1 << 40)], FREE_LINK)
        return simulate_decode_only(poisson_requests(list(pairs), rate, size, self.seed), [setup] * n)


def setups_from_spec(spec, model, hw, profile=None) -> dict:
    """One replica's simulator setup per pool of `spec` (a `ClusterSpec`), on `hw` with `model` (planner
    `ModelSpec`) and an optional latency `profile`."""
    from cluster.planner.latency.base import Parallel
    from cluster.planner.latency.profiles import latency_model

    out = {}
    for name, pool in spec.pools_in_use().items():
        mode = "colocated" if name == "colocated" else "disaggregated"
        lm = latency_model(model, hw, Parallel(pool.tensor_parallel, pool.pipeline_parallel), spec.dtype,
                           profile, mode=mode)
        kv = pool.kv.num_pages * pool.kv.page_size
        if name == "colocated":
            out[name] = ColocSetup(lm, kv, pool.max_num_batched_tokens, pool.max_num_seqs)
        elif name == "prefill":
            out[name] = PrefillSetup(lm, pool.max_num_batched_tokens, pool.max_num_seqs)
        else:
            out[name] = DecodeSetup(lm, kv, pool.max_num_seqs)
    return out


def profile_for(spec):
    """The latency profile the autoscaler plans with: `autoscaling.profile`, else one under deploy/profiles
    of the spec's model and dtype, else None (the hardware entry's own model)."""
    from cluster.planner.errors import BadConfigError
    from cluster.planner.inputs.paths import deploy_dir
    from cluster.planner.latency.profiles import load_profile

    if spec.autoscaling.profile is not None:
        return load_profile(spec.autoscaling.profile)
    for path in sorted((deploy_dir() / "profiles").glob("*.json")):
        try:
            p = load_profile(str(path))
        except BadConfigError:
            continue
        if p.model == spec.model and p.dtype == spec.dtype:
            return p
    return None


def capacity_for_spec(spec) -> PlannerCapacity:
    """The planner's model of `spec`'s pools (a `PlannerError` naming what is missing when it has none)."""
    from cluster.planner.errors import BadConfigError
    from cluster.planner.inputs.hardware import load_hardware
    from cluster.planner.inputs.models import load_model

    profile = profile_for(spec)
    gpus = any(p.resources.num_gpus > 0 for p in spec.pools_in_use().values())
    if profile is None and gpus:
        raise BadConfigError("autoscaling.profile: the pools use GPUs and no profile of "
                             f"{spec.model} ({spec.dtype}) is under deploy/profiles; name one (`pdserve fit-gpu` "
                             "or `pdserve profile` writes it)")
    hw = load_hardware(profile.hardware if profile is not None else "cpu-local")
    setups = setups_from_spec(spec, load_model(spec.model), hw, profile)
    return PlannerCapacity(setups, SLO(spec.slo.ttft_ms / 1000, spec.slo.tpot_ms / 1000, 0.9))
