"""The KV transfer between a prefill and a decode instance, possibly on two machine types.

    link_bandwidth(req, p, d) -> bytes/s a transfer gets      (sizing: `pool_placement`, `designs`)
    reshard_cost(model, dtype, p, d, decode_hw) -> s/token     (the simulator's `Link.reshard_s_per_token`)
    plan_link(req, plan) -> sim.disagg.Link                    (the whole-plan simulation)

Bandwidth: every TP rank ships its own KV shard in parallel, so a transfer gets the per-device link times
the smaller instance's device count. Two instances of one type share a node's NVLink only in a co-node
plan (the plan's `link_bw` says so); instances of two machine types are always on different machines, so
their KV crosses the slower of the two types' inter-node links.
Re-shard: with TP_p != TP_d, a decode rank's KV heads come from a different set of prefill ranks (several
chunks per rank, or a slice of one) and land in pages laid out for its own shard: one read and one write
of each received byte in the decode device's HBM, ranks in parallel. Equal TP: shards map one to one, no
re-layout. Who calls: `pool_placement.simulate_plan`, `designs`. Pure Python.
"""
from __future__ import annotations

from cluster.planner.inputs.hardware import Hardware
from cluster.planner.inputs.models import ModelSpec
from cluster.planner.search.plans import PhaseChoice, Plan
from cluster.planner.search.request import PlanRequest
from cluster.planner.sim.disagg import Link


def cross_type_bandwidth(p_hw: Hardware, d_hw: Hardware, p: PhaseChoice, d: PhaseChoice) -> float:
    """Bytes/s between instances on two machine types: the slower inter-node link, per sending device."""
    return min(p_hw.inter_node_bw, d_hw.inter_node_bw) * min(p.parallel.gpus, d.parallel.gpus)


def reshard_cost(model: ModelSpec, dtype: str, p: PhaseChoice, d: PhaseChoice, decode_hw: Hardware) -> float:
    """Seconds per prompt token to re-lay the KV into the decode instance's shards (0 when TP matches)."""
    if p.parallel.tp == d.parallel.tp:
        return 0.0
    per_rank = model.kv_bytes_per_token(dtype) / d.parallel.gpus
    return 2 * per_rank / decode_hw.hbm_bw


def plan_link(req: PlanRequest, plan: Plan) -> Link:
    (p, _), (d, _) = plan.pools
    reshard = reshard_cost(req.model, req.dtype, p, d, req.hw_of(d.hardware))
    return Link(req.model.kv_bytes_per_token(req.dtype), plan.link_bw, req.model.layers, reshard)
