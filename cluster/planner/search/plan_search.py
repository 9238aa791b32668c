"""The planner's search (a pure function): `search(PlanRequest) -> SearchResult` (`request.py`).

Order of work:
  1. `configs.instance_configs`: every TP x PP that fits memory and divides heads/layers (none: a typed
     `NoFeasibleConfigError` naming the smallest deployment that would fit); for a mixture of experts also
     the EP x TP decode instances (`expert_parallel`), measured beside them as decode choices only;
  2. per configuration and token budget, the goodput of one instance of each kind by bisection over the
     rate (`goodput`): prefill (TTFT), decode (TPOT), colocated (both) -- a coarse pass over all, then a
     fine pass over the `top_k` per kind by per-GPU goodput (none meets the SLO at any rate: a typed
     `InfeasibleSLOError` naming the closest SLO that some configuration meets);
  3. `pool_placement`: replica counts meeting the target rate with the fewest GPUs, for pools placed anywhere
     (KV over the cross-node network), for a stage's prefill and decode kept on one node (KV over
     NVLink; what wins when cross-node links are slow), and colocated replicas -- on equal terms;
  4. the best few plans of each mode are simulated whole at the target rate (adding a replica to the
     pool that misses while the GPUs last); the best verified plan wins: fewest GPUs, then the highest
     per-GPU goodput. No plan within the GPUs: `InfeasibleSLOError` naming the rate they sustain.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from cluster.planner.errors import InfeasibleSLOError, NoFeasibleConfigError
from cluster.planner.inputs.hardware import GIB
from cluster.planner.latency.profiles import latency_model
from cluster.planner.search.configs import InstanceMemory, instance_configs
from cluster.planner.search.expert_parallel import decode_ep_configs
from cluster.planner.search.goodput import COARSE, FINE, Goodput, Precision, coloc_goodput, phase_goodput
from cluster.planner.search.plans import PhaseChoice, Plan
from cluster.planner.search.pool_placement import candidate_plans, verify
from cluster.planner.search.request import PlanRequest
from cluster.planner.sim.coloc import ColocSetup
from cluster.planner.sim.disagg import DecodeSetup, PrefillSetup
from cluster.stats import percentile


@dataclass(frozen=True)
class SearchResult:
    best: Plan
    plans: tuple[Plan, ...]  # every candidate, best first (verified ones carry their attainment)
    phases: tuple[PhaseChoice, ...]  # every finely measured instance kind
    rejected: tuple[str, ...]  # configurations that do not exist, and why
    seconds: float = 0.0
    notes: tuple[str, ...] = field(default=())
    target: float = 0.9  # the attainment a plan must reach

    def best_of(self, mode: str) -> Plan | None:
        """The best plan of `mode` that met the target in its whole-plan simulation; else the simulated
        one of that mode that came closest (None: none was simulated)."""
        mine = [p for p in self.plans if p.mode == mode and p.attainment is not None]
        return next((p for p in mine if p.attainment >= self.target), None) or \
            max(mine, key=lambda p: p.attainment, default=None)


def _no_config_error(req: PlanRequest, rejected: list[str]) -> NoFeasibleConfigError:
    m, hw = req.model, req.hw
    bigger, _ = instance_configs(m, hw, req.dtype, req.gpus_per_node, 64 * req.gpus_per_node, req.model_len)
    weights = m.weight_bytes(req.dtype) / GIB
    closest = (f"the smallest instance that fits is {min(bigger, key=lambda c: c.parallel.gpus).parallel} "
               f"({min(c.parallel.gpus for c in bigger)} GPUs)" if bigger else
               f"a device with more than {hw.memory / GIB:.0f} GiB, or a shorter --max-len")
    shown = "; ".join(rejected[:4]) + (f"; ... ({len(rejected) - 4} more)" if len(rejected) > 4 else "")
    return NoFeasibleConfigError(f"{m.name} ({weights:.0f} GiB of {req.dtype} weights, {req.model_len}-token "
                                 f"context) fits no TP x PP on {req.nodes} x {req.gpus_per_node} {hw.name}: "
                                 f"{shown}; closest feasible: {closest}")


def measure_phase(req: PlanRequest, kind: str, mem: InstanceMemory, budget: int, prec: Precision,
                  warm: float = 0.0) -> tuple[PhaseChoice, Goodput]:
    """One instance of `kind` at `budget`: its goodput at the SLO as a PhaseChoice."""
    lm = latency_model(req.model, req.hw, mem.parallel, req.dtype, req.profile, req.gpus_per_node,
                       "colocated" if kind == "colocated" else "disaggregated")
    _, _, pre_seqs, seqs = req.budgets()
    pairs = list(req.pairs)
    # each phase alone at the full attainment target (DistServe's rule); a disaggregated request must
    # pass both, so the whole-plan check (`pool_placement.verify`) adds replicas where the joint rate falls short
    phase_slo = req.slo
    if kind == "prefill":
        g = phase_goodput("prefill", PrefillSetup(lm, budget, pre_seqs), pairs, phase_slo, prec, req.seed, warm)
    elif kind == "decode":
        g = phase_goodput("decode", DecodeSetup(lm, mem.kv_tokens, seqs), pairs, phase_slo, prec, req.seed, warm)
    else:
        g = coloc_goodput(ColocSetup(lm, mem.kv_tokens, budget, seqs), pairs, req.slo, prec, req.seed, warm)
    max_seqs = pre_seqs if kind == "prefill" else seqs
    return PhaseChoice(kind, mem.parallel, budget, mem.kv_tokens, max_seqs, g.rate, g.binding), g


def phase_choices(req: PlanRequest, configs: list[InstanceMemory],
                  decode_extra: list[InstanceMemory] = ()) -> tuple[dict[str, list[PhaseChoice]], dict]:
    """Coarse pass over every configuration at the middle token budget; fine pass (warm-started from the
    coarse goodput) over the finalists of each kind, every budget for the best finalist only.
    `decode_extra`: configurations only decode instances may take (expert parallelism)."""
    pre_b, col_b, _, _ = req.budgets()
    kinds = {"prefill": pre_b, "decode": (0,), "colocated": col_b}
    out: dict[str, list[PhaseChoice]] = {}
    low_load: dict[str, list[tuple[PhaseChoice, Goodput]]] = {}
    for kind, budgets in kinds.items():
        mid = budgets[len(budgets) // 2]
        mine = list(configs) + (list(decode_extra) if kind == "decode" else [])
        coarse = [measure_phase(req, kind, mem, mid, COARSE) for mem in mine]
        low_load[kind] = coarse
        fine = []
        for rank, c in enumerate(_finalists([c for c, _ in coarse if c.goodput > 0], req.top_k)):
            mem = next(m for m in mine if m.parallel == c.parallel)
            fine += [measure_phase(req, kind, mem, b, FINE, warm=c.goodput)[0] for b in (budgets if rank == 0 else (mid,))]
        out[kind] = [c for c in fine if c.goodput > 0]
    return out, low_load


def _finalists(coarse: list[PhaseChoice], top_k: int) -> list[PhaseChoice]:
    """The best `top_k` by per-GPU goodput, the best of the smallest instance size (a low rate may need
    one small instance only) and the best of each other size within 80% of the best per-GPU goodput
    (few GPUs favour sizes that pack)."""
    ranked = sorted(coarse, key=lambda c: -c.per_gpu)
    if not ranked:
        return []
    picked = ranked[:top_k]
    smallest = min(c.parallel.gpus for c in ranked)
    for c in ranked:
        new_size = all(c.parallel.gpus != x.parallel.gpus for x in picked)
        if new_size and (c.parallel.gpus == smallest or c.per_gpu >= 0.8 * ranked[0].per_gpu):
            picked.append(c)
    return picked


def _closest_slo(req: PlanRequest, low_load: dict) -> str:
    """The loosest-needed target at low load: what the best configuration reaches at the attainment."""
    q = req.slo.attainment * 100
    options = []
    for kind, metric in (("prefill", "ttft"), ("decode", "tpot"), ("colocated", "ttft"), ("colocated", "tpot")):
        for choice, g in low_load[kind]:
            value = percentile([getattr(r, metric) for r in g.low_load.results], q)
            options.append((metric, value, f"{kind} {choice.parallel}"))
    parts = []
    for metric, target in (("ttft", req.slo.ttft_s), ("tpot", req.slo.tpot_s)):
        best = min((o for o in options if o[0] == metric), key=lambda o: o[1])
        if best[1] > target:
            parts.append(f"--{metric}-ms {math.ceil(best[1] * 1000 * 1.1)} ({best[2]} reaches "
                         f"{best[1] * 1000:.0f} ms at p{q:.0f} at low load)")
    return "; ".join(parts) or "a lower --attainment"


def search(req: PlanRequest) -> SearchResult:
    start = time.perf_counter()
    configs, rejected = instance_configs(req.model, req.hw, req.dtype, req.gpus_per_node, req.total_gpus,
                                         req.model_len)
    if not configs:
        raise _no_config_error(req, rejected)
    ep_configs, ep_rejected = decode_ep_configs(req.model, req.hw, req.dtype, req.gpus_per_node, req.total_gpus,
                                                req.model_len, configs)  # none for dense models
    rejected += ep_rejected
    phases, low_load = phase_choices(req, configs, ep_configs)
    t_phases = time.perf_counter() - start
    if not phases["colocated"] and not (phases["prefill"] and phases["decode"]):
        raise InfeasibleSLOError(f"no configuration of {req.model.name} on {req.hw.name} meets TTFT "
                                 f"{req.slo.ttft_s * 1000:g} ms and TPOT {req.slo.tpot_s * 1000:g} ms for "
                                 f"{req.slo.attainment:.0%} of requests, even at low load", _closest_slo(req, low_load))
    plans = candidate_plans(req, phases)
    if not plans:
        raise _rate_error(req, phases)
    checked = list({_key(p): p for p in verify(req, plans)}.values())  # trims can meet twice
    ok = [p for p in checked if p.attainment is not None and p.attainment >= req.slo.attainment]
    if not ok:
        raise _rate_error(req, phases, checked)
    ranked = sorted(ok, key=_rank) + sorted((p for p in checked if p not in ok), key=_rank)
    seen = {_key(p) for p in checked}
    ranked += sorted((p for p in plans if _key(p) not in seen), key=_rank)
    all_phases = tuple(c for kind in phases.values() for c in kind)
    took = time.perf_counter() - start
    shapes = f"{len(configs)} TP x PP configurations" + (f" (+ {len(ep_configs)} EP x TP for decode)"
                                                         if ep_configs else "")
    notes = (f"{shapes}; per-instance goodputs {t_phases:.1f} s, whole-plan checks {took - t_phases:.1f} s",)
    return SearchResult(ranked[0], tuple(ranked), all_phases, tuple(rejected), took, notes, req.slo.attainment)


def _key(p: Plan):
    return p.mode, p.placement, p.pools


def _rank(p: Plan) -> tuple[int, float]:
    return p.gpus, -p.per_gpu_goodput


def _rate_error(req: PlanRequest, phases: dict[str, list[PhaseChoice]], checked: list[Plan] = ()) -> InfeasibleSLOError:
    best_c = max(phases["colocated"], key=lambda c: c.per_gpu, default=None)
    ideal = [(best_c.per_gpu, f"colocated {best_c.parallel}")] if best_c else []
    if phases["prefill"] and phases["decode"]:
        p = max(phases["prefill"], key=lambda c: c.per_gpu)
        d = max(phases["decode"], key=lambda c: c.per_gpu)
        ideal.append((1 / (1 / p.per_gpu + 1 / d.per_gpu), f"disaggregated {p.parallel} + {d.parallel}"))
    per_gpu, how = max(ideal)
    need = math.ceil(req.rate / per_gpu)
    if need <= req.total_gpus and checked:
        # Per-instance goodputs say it fits, but no whole plan did in the simulation (whole replicas at a
        # fixed ratio, queueing between pools): say so, and offer what the best simulated plan reached.
        best = max(checked, key=lambda p: (p.attainment or 0.0, p.goodput))
        return InfeasibleSLOError(
            f"{req.rate:g} req/s at the SLO: per-instance estimates allow it on {need} GPUs ({how}, "
            f"{per_gpu:.2f} req/s per GPU), but no whole plan on {req.total_gpus} GPUs reached "
            f"{req.slo.attainment:.0%} attainment in the simulation (best: {best.describe()}, "
            f"{(best.attainment or 0.0):.1%})", f"--rate {min(best.goodput, req.rate) * 0.8:.2f} on {req.total_gpus} GPUs, "
            f"or --nodes {req.nodes + 1}")
    return InfeasibleSLOError(
        f"{req.rate:g} req/s at the SLO needs about {need} GPUs ({how}, {per_gpu:.2f} req/s per GPU); "
        f"{req.total_gpus} are given", f"--rate {per_gpu * req.total_gpus * 0.95:.2f} on {req.total_gpus} GPUs, "
        f"or --nodes {math.ceil(need / req.gpus_per_node)}")
