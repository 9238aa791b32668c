"""Expert parallelism as a decode-pool choice for mixture-of-experts models: which EP x TP instances exist.

    decode_ep_configs(model, hw, dtype, gpus_per_node, total_gpus, max_len, base) -> (configs, rejected)

An EP instance is `ep` groups of `tp` GPUs (`Parallel(tp, 1, ep)`): the experts of every MoE layer split ep
ways between the groups, each group running the attention and holding the KV of its own sequences;
`latency/moe.py` prices its steps, `configs.instance_memory` its memory. The search measures these beside
the TP x PP decode instances and keeps whichever serves more per GPU (`plan_search`).
Rules (each rejection kept with its reason):
  - models with experts only; ep > 1 divides the expert count (each rank holds whole experts);
  - tp as for any instance (`configs.head_problem`: heads, KV heads, FFN and expert FFN sizes);
  - tp x ep GPUs inside one node and dividing its GPUs: every MoE layer's all-to-all runs over NVLink
    (across nodes it would be the NIC's, an order of magnitude slower per GPU on the entries we have);
  - no pipeline with EP (one kind of layout at a time, as for TP x PP);
  - memory: every rank holds 1/(tp x ep) of the experts and 1/tp of the rest, and KV for one `max_len`
    sequence; the instance is no wider than `instance_configs` allows (2x the smallest that fits, or a node).
Decode only: a prompt is one sequence and is not split between attention groups, so prefill and colocated
instances keep TP x PP. Who calls: `plan_search.search`. Pure Python.
"""
from __future__ import annotations

from cluster.planner.inputs.hardware import GIB, Hardware
from cluster.planner.inputs.models import ModelSpec
from cluster.planner.latency.base import Parallel
from cluster.planner.search.configs import MEM_UTIL, InstanceMemory, head_problem, instance_memory


def ep_degrees(model: ModelSpec, limit: int) -> list[int]:
    """EP degrees above 1 that divide the expert count, up to `limit` GPUs."""
    return [e for e in range(2, min(model.experts, limit) + 1) if model.experts % e == 0] if model.is_moe else []


def decode_ep_configs(model: ModelSpec, hw: Hardware, dtype: str, gpus_per_node: int, total_gpus: int,
                      max_len: int, base: list[InstanceMemory],
                      util: float = MEM_UTIL) -> tuple[list[InstanceMemory], list[str]]:
    """The EP x TP decode instances that fit (none for dense models), and why the others do not."""
    fits: list[InstanceMemory] = []
    rejected: list[str] = []
    room = min(gpus_per_node, total_gpus)
    for tp in (d for d in range(1, room + 1) if gpus_per_node % d == 0):
        if head_problem(model, tp):
            continue  # `instance_configs` already says why
        for ep in ep_degrees(model, room // tp):
            if gpus_per_node % (tp * ep):
                rejected.append(f"tp{tp}ep{ep}: {tp * ep} GPUs do not divide a node's {gpus_per_node}")
                continue
            mem = instance_memory(model, hw, Parallel(tp, 1, ep), dtype, util)
            if mem.kv_tokens < max_len * ep:
                rejected.append(f"tp{tp}ep{ep}: {mem.weights_per_gpu / GIB:.1f} GiB of weights per device leaves "
                                f"KV for {mem.kv_tokens // ep} tokens a group (< one {max_len}-token sequence)")
                continue
            fits.append(mem)
    smallest = min((m.parallel.gpus for m in base + fits), default=0)
    widest = min(total_gpus, max(gpus_per_node, 2 * smallest))
    return [m for m in fits if m.parallel.gpus <= widest], rejected
