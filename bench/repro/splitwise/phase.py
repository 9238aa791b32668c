"""One Splitwise machine kind measured alone: the planner's per-instance goodput under the paper's setup.

    measure_phase(req, kind, mem, budget, prec, setup) -> PhaseChoice

The product search (`cluster.planner.search.plan_search.measure_phase`) measures one instance with the
request's latency model, chunked prefill and least-outstanding-tokens routing. The reproduction needs four
things the product does not, carried by `PhaseSetup`:
  copies         n identical machines behind the router, goodput per machine (the artifact's JSQ pools;
                 `goodput`'s `copies`);
  lm             the artifact's measured iteration times (`step_table.TableLatency`) instead of the model's;
  whole_prompts  the baselines' batching: whole prompts FCFS within the token budget (`baseline.py`);
  route          the baselines' router signal, prompt tokens queued ("prompts") instead of outstanding.
Pure Python; used by repro.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from bench.repro.splitwise.baseline import ArtifactSetup
from cluster.planner.latency.base import LatencyModel
from cluster.planner.latency.profiles import latency_model
from cluster.planner.search.configs import InstanceMemory
from cluster.planner.search.goodput import Precision, coloc_goodput, phase_goodput
from cluster.planner.search.plans import PhaseChoice
from cluster.planner.search.request import PlanRequest
from cluster.planner.sim.disagg import DecodeSetup, PrefillSetup


@dataclass(frozen=True)
class PhaseSetup:
    copies: int = 1
    lm: LatencyModel | None = None  # None: the request's latency model, as the product search
    whole_prompts: bool = False
    route: str = "outstanding"


def measure_phase(req: PlanRequest, kind: str, mem: InstanceMemory, budget: int, prec: Precision,
                  setup: PhaseSetup = PhaseSetup()) -> PhaseChoice:
    """One machine of `kind` at `budget`: its goodput at the request's SLO (per machine of `setup.copies`)."""
    lm = setup.lm or latency_model(req.model, req.hw, mem.parallel, req.dtype, req.profile, req.gpus_per_node,
                                   "colocated" if kind == "colocated" else "disaggregated")
    _, _, pre_seqs, seqs = req.budgets()
    pairs, k = list(req.pairs), setup.copies
    if kind == "prefill":
        g = phase_goodput("prefill", PrefillSetup(lm, budget, pre_seqs), pairs, req.slo, prec, req.seed, copies=k)
    elif kind == "decode":
        g = phase_goodput("decode", DecodeSetup(lm, mem.kv_tokens, seqs), pairs, req.slo, prec, req.seed, copies=k)
    else:
        coloc = ArtifactSetup(lm, mem.kv_tokens, budget, seqs, setup.whole_prompts, setup.route)
        g = coloc_goodput(coloc, pairs, req.slo, prec, req.seed, copies=k)
    max_seqs = pre_seqs if kind == "prefill" else seqs
    return PhaseChoice(kind, mem.parallel, budget, mem.kv_tokens, max_seqs, g.rate, g.binding)
