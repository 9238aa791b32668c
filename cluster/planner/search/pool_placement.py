"""From per-instance goodputs to whole plans, and the whole-plan check by simulation.

    candidate_plans(req, phases) -> [Plan]     every plan that meets the target rate within the GPUs
    verify(req, plans) -> [Plan]               the best few per mode simulated at the target rate

Placements (DistServe's two algorithms):
  independent  prefill and decode pools anywhere; a KV transfer crosses nodes when there is more than
               one node (aggregate bandwidth: the cross-node link of each sending device), so it suits
               clusters with fast networks;
  co-node      a pipeline stage's prefill and decode segments share a node (equal PP; a "unit" of `a`
               prefill and `b` decode instances whose stage segments fit one node), KV moves over
               NVLink; the choice when cross-node links are slow;
  colocated    replicas doing both phases (no KV moves).
Replicas: n = ceil(rate / goodput) per pool; stages are packed into nodes first-fit decreasing. The
whole-plan simulation puts each instance on its node the same way, so instances sharing a node's memory
bus slow each other by the profile's co-run factors (`bus.py`; none on GPUs unless a profile says so).
"""
from __future__ import annotations

import math

from cluster.planner.inputs.workload import poisson_requests
from cluster.planner.latency.profiles import corun_of, latency_model
from cluster.planner.search.goodput import VERIFY, Precision, lifetime
from cluster.planner.search.kv_link import plan_link
from cluster.planner.search.plans import PhaseChoice, Plan
from cluster.planner.search.request import PlanRequest
from cluster.planner.sim.bus import Sharing, pack_nodes
from cluster.planner.sim.coloc import ColocSetup, simulate_colocated
from cluster.planner.sim.disagg import DecodeSetup, PrefillSetup, simulate_disaggregated


MAX_BUMPS = 3  # replicas added to a plan that misses the attainment in the whole-plan check


def _packs(items: list[int], nodes: int, per_node: int) -> bool:
    """First-fit decreasing of stage sizes (TP GPUs each) into `nodes` bins of `per_node` GPUs."""
    free = [per_node] * nodes
    for size in sorted(items, reverse=True):
        slot = next((k for k, f in enumerate(free) if f >= size), None)
        if slot is None:
            return False
        free[slot] -= size
    return True


def _stages(c: PhaseChoice, n: int) -> list[int]:
    return [c.parallel.stage_gpus] * (c.parallel.pp * n)


def independent_plan(req: PlanRequest, p: PhaseChoice, d: PhaseChoice) -> Plan | None:
    """Replicas for the target rate; when those do not fit the GPUs, the split that serves the most
    within them (a whole plan serves more than its instances alone, so it may still meet the rate)."""
    per_device = req.hw.inter_node_bw if req.nodes > 1 else req.hw.intra_node_bw
    link = per_device * min(p.parallel.gpus, d.parallel.gpus)
    n_p, n_d = math.ceil(req.rate / p.goodput), math.ceil(req.rate / d.goodput)
    splits = [(n_p, n_d)]
    if n_p * p.parallel.gpus + n_d * d.parallel.gpus > req.total_gpus:
        splits = []
        for a in range(1, req.total_gpus // p.parallel.gpus + 1):
            room = (req.total_gpus - a * p.parallel.gpus) // d.parallel.gpus
            splits.append((a, min(room, math.ceil(a * p.goodput / d.goodput))))  # no idle decode replicas
        splits.sort(key=lambda ab: (-min(ab[0] * p.goodput, ab[1] * d.goodput),
                                    ab[0] * p.parallel.gpus + ab[1] * d.parallel.gpus))
    for a, b in splits:
        gpus = a * p.parallel.gpus + b * d.parallel.gpus
        if b >= 1 and gpus <= req.total_gpus and _packs(_stages(p, a) + _stages(d, b), req.nodes, req.gpus_per_node):
            return Plan("disaggregated", "independent", ((p, a), (d, b)), gpus, link)
    return None


def co_node_plans(req: PlanRequest, p: PhaseChoice, d: PhaseChoice) -> list[Plan]:
    if req.nodes < 2 or p.parallel.pp != d.parallel.pp:
        return []
    g, pp, out = req.gpus_per_node, p.parallel.pp, []
    for a in range(1, g // p.parallel.stage_gpus + 1):
        for b in range(1, (g - a * p.parallel.stage_gpus) // d.parallel.stage_gpus + 1):
            units = min(math.ceil(req.rate / min(a * p.goodput, b * d.goodput)), req.nodes // pp)
            if units < 1:  # each unit stage takes one node
                continue
            gpus = units * pp * (a * p.parallel.stage_gpus + b * d.parallel.stage_gpus)
            link = req.hw.intra_node_bw * min(p.parallel.gpus, d.parallel.gpus)
            out.append(Plan("disaggregated", "co-node", ((p, units * a), (d, units * b)), gpus, link))
    return out


def colocated_plan(req: PlanRequest, c: PhaseChoice) -> Plan | None:
    n = min(math.ceil(req.rate / c.goodput), req.total_gpus // c.parallel.gpus)
    while n >= 1 and not _packs(_stages(c, n), req.nodes, req.gpus_per_node):
        n -= 1
    return Plan("colocated", "colocated", ((c, n),), n * c.parallel.gpus) if n >= 1 else None


def candidate_plans(req: PlanRequest, phases: dict[str, list[PhaseChoice]]) -> list[Plan]:
    """Plans sized for the target rate by per-instance goodputs, or (when that does not fit) the most
    goodput the GPUs hold; the whole-plan check decides."""
    plans: list[Plan] = []
    for p in phases["prefill"]:
        for d in phases["decode"]:
            plan = independent_plan(req, p, d)
            plans += ([plan] if plan else []) + co_node_plans(req, p, d)
    plans += [x for x in (colocated_plan(req, c) for c in phases["colocated"]) if x]
    return plans


def simulate_plan(req: PlanRequest, plan: Plan, rate: float, prec: Precision = VERIFY):
    """Simulate the whole plan at `rate` (req/s); returns the `SimResult`."""
    def lm(c: PhaseChoice):
        return latency_model(req.model, req.hw_of(c.hardware), c.parallel, req.dtype, req.profile,
                             req.gpus_per_node, "colocated" if c.phase == "colocated" else "disaggregated")

    first = plan.pools[0][0]
    n = prec.size(rate, lifetime(lm(first), list(req.pairs)))
    reqs = poisson_requests(list(req.pairs), rate, n, req.seed + 1)  # a fresh draw, not the search's
    sharing = plan_sharing(req, plan)
    if plan.mode == "colocated":
        c, k = plan.pools[0]
        return simulate_colocated(reqs, [ColocSetup(lm(c), c.kv_tokens, c.token_budget, c.max_seqs)] * k, sharing)
    (p, n_p), (d, n_d) = plan.pools
    link = plan_link(req, plan)
    return simulate_disaggregated(reqs, [PrefillSetup(lm(p), p.token_budget, p.max_seqs)] * n_p,
                                  [DecodeSetup(lm(d), d.kv_tokens, d.max_seqs)] * n_d, link, sharing)


def plan_sharing(req: PlanRequest, plan: Plan) -> Sharing | None:
    """Which node each of the plan's instances sits on (pools in order, first-fit decreasing by size; an
    instance wider than a node counts on its first node). None: no co-run factors to apply."""
    corun = corun_of(req.profile)
    if corun.is_none:
        return None
    sizes = [min(c.parallel.gpus, req.gpus_per_node) for c, n in plan.pools for _ in range(n)]
    for count in range(req.nodes, req.nodes + len(sizes) + 1):  # verified plans pack into req.nodes
        nodes = pack_nodes(sizes, count, req.gpus_per_node)
        if nodes is not None:
            return Sharing(corun, nodes)
    raise AssertionError("one instance per node always packs")


def _bump(req: PlanRequest, plan: Plan, result) -> Plan | None:
    """One more replica of the pool that misses more often (a whole unit for co-node plans)."""
    pools = list(plan.pools)
    if plan.placement == "co-node":
        units = math.gcd(pools[0][1], pools[1][1])
        return resized_plan(req, plan, [(c, n + n // units) for c, n in pools])
    k = 0
    if plan.mode == "disaggregated" and result.ttft_attainment(req.slo) >= result.tpot_attainment(req.slo):
        k = 1
    return resized_plan(req, plan, [(c, n + (j == k)) for j, (c, n) in enumerate(pools)])


def resized_plan(req: PlanRequest, plan: Plan, pools: list) -> Plan | None:
    """The plan with other replica counts, if they fit: each machine type packs into its own nodes."""
    if any(n < 1 for _, n in pools):
        return None
    for kind in {c.hardware for c, _ in pools}:
        mine = [(c, n) for c, n in pools if c.hardware == kind]
        stages = [s for c, n in mine for s in _stages(c, n)]
        if sum(c.parallel.gpus * n for c, n in mine) > req.total_gpus or \
                not _packs(stages, req.nodes, req.gpus_per_node):
            return None
    gpus = sum(c.parallel.gpus * n for c, n in pools)
    return Plan(plan.mode, plan.placement, tuple(pools), gpus, plan.link_bw)


def _scaled(req: PlanRequest, plan: Plan, factor: float) -> Plan | None:
    """Every pool scaled by `factor` (at least one replica; co-node plans by whole units)."""
    pools = list(plan.pools)
    if plan.placement == "co-node":
        units = math.gcd(pools[0][1], pools[1][1])
        keep = max(1, math.ceil(units * factor))
        return resized_plan(req, plan, [(c, n // units * keep) for c, n in pools])
    return resized_plan(req, plan, [(c, max(1, math.ceil(n * factor))) for c, n in pools])


def _trims(req: PlanRequest, plan: Plan) -> list[Plan]:
    """The plan with one replica fewer in one pool (largest instances first); co-node: one unit fewer."""
    pools = list(plan.pools)
    if plan.placement == "co-node":
        units = math.gcd(pools[0][1], pools[1][1])
        out = [resized_plan(req, plan, [(c, n - n // units) for c, n in pools])]
    else:
        order = sorted(range(len(pools)), key=lambda k: -pools[k][0].parallel.gpus)
        out = [resized_plan(req, plan, [(c, n - (k == j)) for k, (c, n) in enumerate(pools)]) for j in order]
    return [p for p in out if p is not None]


def _checked(req: PlanRequest, plan: Plan) -> Plan:
    result = simulate_plan(req, plan, req.rate)
    return Plan(plan.mode, plan.placement, plan.pools, plan.gpus, plan.link_bw, result.attainment(req.slo), result)


def bumped_until_ok(req: PlanRequest, plan: Plan) -> list[Plan]:
    """The plan simulated whole; while it misses, one more replica of the pool that misses more."""
    out = [_checked(req, plan)]
    for _ in range(MAX_BUMPS):
        if out[-1].attainment >= req.slo.attainment:
            break
        bigger = _bump(req, plan, out[-1].result)
        if bigger is None:
            break
        plan = bigger
        out.append(_checked(req, bigger))
    return out


def shrunk_plans(req: PlanRequest, plan: Plan) -> list[Plan]:
    """Per-instance goodputs come from one instance alone, and many instances behind a load-balancing
    router smooth each other's bursts: a plan sized from them usually has spare replicas. Bisect a scale
    factor on all pools (4 probes), then try one replica fewer per pool."""
    out, best, lo, hi = [], plan, 0.0, 1.0
    for _ in range(4):
        mid = (lo + hi) / 2
        cand = _scaled(req, plan, mid)
        if cand is None or cand.pools == best.pools:
            hi = mid
            continue
        checked = _checked(req, cand)
        out.append(checked)
        if checked.attainment >= req.slo.attainment:
            best, hi = checked, mid
        else:
            lo = mid
    for smaller in _trims(req, best):
        checked = _checked(req, smaller)
        out.append(checked)
        if checked.attainment >= req.slo.attainment:
            break
    return out


def verify(req: PlanRequest, plans: list[Plan]) -> list[Plan]:
    """Simulate the best `verify_per_mode` plans of each mode whole at the target rate (adding replicas
    while one misses), then shrink the best passing plan of each mode: both modes on equal terms."""
    out = []
    for mode in ("disaggregated", "colocated"):
        mine = sorted((p for p in plans if p.mode == mode), key=_by_size)
        meets = [p for p in mine if p.goodput >= req.rate]  # by per-instance goodputs
        picks = meets[:req.verify_per_mode]
        biggest = max(mine, key=lambda p: p.goodput, default=None)  # in case none meets it alone
        picks += [biggest] if biggest is not None and biggest not in picks else []
        passing = []
        for plan in picks:
            runs = bumped_until_ok(req, plan)
            out += runs
            passing += [runs[-1]] if runs[-1].attainment >= req.slo.attainment else []
        if passing:
            out += shrunk_plans(req, min(passing, key=_by_size))
    return out


def _by_size(p: Plan) -> tuple[int, float]:
    return p.gpus, -p.per_gpu_goodput
