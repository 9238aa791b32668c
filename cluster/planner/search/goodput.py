"""Goodput: the highest request rate at which a setup still meets the SLO attainment, by bisection.

    phase_goodput("prefill", setup, ...)   one prefill instance alone; TTFT attainment (output 1 token)
    phase_goodput("decode", setup, ...)    one decode instance fed at zero prefill cost; TPOT attainment
    coloc_goodput(setup, ...)              one colocated replica; joint attainment
    copies=K (either)                      K identical instances behind the router (least queued work),
                                           the goodput reported per instance: a pool's tail latency is
                                           not one instance's at 1/K of the rate (a request finds the
                                           least loaded of K; Splitwise's JSQ pools, bench/splitwise_repro)

Each probe simulates Poisson arrivals at the probed rate (common random numbers: the same seed at every
rate) for at least `n` requests and at least `LIFETIMES` request lifetimes (at low load): fewer, and a
fast rate is a single burst that an instance absorbs before its queue can show the overload. The bracket starts from a capacity estimate and doubles until attainment
fails; bisection stops at 2% relative width. A setup that misses the SLO even at 1/100 of its capacity
has goodput 0 (the SLO itself is out of reach for it). Pure Python; called by `search` and `report`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cluster.planner.inputs.workload import poisson_requests
from cluster.planner.latency.base import LatencyModel, ZeroLatency
from cluster.planner.sim.coloc import ColocSetup, simulate_colocated
from cluster.planner.sim.disagg import DecodeSetup, Link, PrefillSetup, simulate_decode_only, simulate_disaggregated
from cluster.planner.sim.metrics import SLO, SimResult


@dataclass(frozen=True)
class Precision:
    n: int = 300  # requests per probe, at least
    lifetimes: float = 10  # simulated time >= this many low-load request lifetimes
    max_requests: int = 4000  # per probe: bounds the cost of probes far above capacity
    rel_tol: float = 0.02  # bisection stops at this relative bracket width

    def size(self, rate: float, lifetime: float) -> int:
        return min(self.max_requests, max(self.n, int(rate * self.lifetimes * lifetime) + 1))


FINE = Precision(1500, 8, 3000, 0.03)
VERIFY = Precision(4000, 10, 6000, 0.02)  # whole plans at the target rate
REPORT = Precision(4000, 10, 6000, 0.05)  # the report: as VERIFY (shorter runs read optimistic), coarser bisection
COARSE = Precision(600, 3, 1000, 0.1)  # the search's first pass over every configuration


_FREE_LINK = Link(1.0, float("inf"), 1)


@dataclass(frozen=True)
class Goodput:
    rate: float  # req/s at the attainment target (0: not even at low load)
    low_load: SimResult  # the run at the lowest probed rate (for "closest feasible SLO")
    binding: str  # ttft | tpot: what fails first above `rate`; throughput: capped by the capacity bound


def _mean(pairs, f, at_most: int = 200) -> float:
    """Mean of f over (at most `at_most` evenly spaced) pairs: estimates only size the search."""
    sample = pairs[::max(1, len(pairs) // at_most)]
    return sum(f(i, o) for i, o in sample) / len(sample)


def bisect_rate(attain: Callable[[float], float], target: float, guess: float, rel_tol: float = 0.02,
                warm: bool = False, cap: float = float("inf")) -> tuple[float, float, float]:
    """(goodput, a passing or the lowest probed rate, the lowest failing rate): the largest rate with
    attain(rate) >= target; 0 when even `guess`/100 fails. `warm`: `guess` is a measured goodput (the
    coarse pass's), so the bracket starts at +-10% around it. `cap`: a throughput bound the rate cannot
    exceed in steady state; a finite run above it only looks fine because the backlog has not built up."""
    guess = min(guess, cap)
    low = guess / 100
    lo, hi = (guess * 0.9, min(guess * 1.1, cap)) if warm else (low, guess)
    if attain(lo) < target:
        if not warm or attain(low) < target:
            return 0.0, low, low
        lo, hi = low, lo
    for _ in range(12):  # grow the bracket until attainment fails
        if attain(hi) < target:
            break
        if hi >= cap:
            return hi, low if not warm else lo, hi
        lo, hi = hi, min(hi * 2, cap)
    else:
        return lo, low if not warm else lo, lo  # never failed: reported as the last passing rate
    while (hi - lo) / hi > rel_tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if attain(mid) >= target else (lo, mid)
    return lo, low if not warm else lo, hi


def _goodput(run: Callable[[float], SimResult], slo: SLO, guess: float, prec: Precision,
             warm: float = 0.0, cap: float = float("inf")) -> Goodput:
    results: dict[float, SimResult] = {}

    def attain(rate: float) -> float:
        results[rate] = run(rate)
        return results[rate].attainment(slo)

    rate, low, fail = bisect_rate(attain, slo.attainment, warm or guess, prec.rel_tol, warm > 0, cap)
    capped = rate >= cap * (1 - 1e-9)  # the throughput bound, not an SLO target, stopped the search
    return Goodput(rate, results[low], "throughput" if capped else results[fail].binding(slo))


def _batch_capacity(step: Callable[[float, float], float], pairs, budget: int, max_seqs: int) -> float:
    """Prompts per second when every step is a full token-budget batch of average prompts (x1.2 for the
    estimate's slack): no rate above it is sustainable."""
    mean_in = _mean(pairs, lambda i, o: i)
    per_batch = max(1.0, min(max_seqs, budget / mean_in))
    return 1.2 * per_batch / step(per_batch * mean_in, per_batch * _mean(pairs, lambda i, o: i * i))


def phase_goodput(phase: str, setup: PrefillSetup | DecodeSetup, pairs, slo: SLO, prec: Precision = FINE,
                  seed: int = 0, warm: float = 0.0, copies: int = 1) -> Goodput:
    k = copies
    if phase == "prefill":
        pairs1 = [(i, 1) for i, _ in pairs]
        guess = 1.0 / _mean(pairs1, lambda i, o: setup.model.prefill_interval(i, i * i))
        cap = _batch_capacity(setup.model.prefill_interval, pairs, setup.token_budget, setup.max_seqs)
        life = 1.0 / guess

        def run(rate: float) -> SimResult:
            reqs = poisson_requests(pairs1, rate, prec.size(rate, life), seed)
            return simulate_disaggregated(reqs, [setup] * k, [DecodeSetup(ZeroLatency(), 1 << 40)], _FREE_LINK)
    else:
        batch = max(1, min(setup.max_seqs, setup.kv_tokens // max(1, int(_mean(pairs, lambda i, o: i + o)))))
        step = setup.model.decode(batch, batch * _mean(pairs, lambda i, o: i + o / 2))
        guess = batch / step / _mean(pairs, lambda i, o: max(1, o - 1))
        cap = 1.1 * guess  # at the largest batch the KV and max_seqs allow: a throughput bound
        life = _mean(pairs, lambda i, o: (o - 1) * setup.model.decode(1, i + o / 2))

        def run(rate: float) -> SimResult:
            reqs = poisson_requests(pairs, rate, prec.size(rate, life), seed)
            return simulate_decode_only(reqs, [setup] * k)
    return _per_instance(_goodput(run, slo, guess * k, prec, warm * k, cap * k), k)


def coloc_goodput(setup: ColocSetup, pairs, slo: SLO, prec: Precision = FINE, seed: int = 0,
                  warm: float = 0.0, copies: int = 1) -> Goodput:
    k = copies
    per_req = _mean(pairs, lambda i, o: setup.model.mixed(i, i * i, 0, 0)) + \
        _mean(pairs, lambda i, o: (o - 1) * setup.model.decode(32, 32 * (i + o / 2)) / 32)
    life = _mean(pairs, lambda i, o: setup.model.mixed(i, i * i, 0, 0) + (o - 1) * setup.model.decode(1, i + o / 2))
    # a colocated replica cannot take prompts faster than its steps compute them alone
    cap = _batch_capacity(lambda t, sq: setup.model.mixed(t, sq, 0, 0), pairs, setup.token_budget, setup.max_seqs)
    return _per_instance(_goodput(lambda rate: simulate_colocated(
        poisson_requests(pairs, rate, prec.size(rate, life), seed), [setup] * k), slo, k / per_req, prec, warm * k,
        cap * k), k)


def _per_instance(g: Goodput, copies: int) -> Goodput:
    return g if copies == 1 else Goodput(g.rate / copies, g.low_load, g.binding)


def lifetime(model: LatencyModel, pairs) -> float:
    """Mean low-load latency of a request (prefill alone, then decode at batch 1): sizes simulations."""
    return _mean(pairs, lambda i, o: model.prefill(i, i * i) + (o - 1) * model.decode(1, i + o / 2))


