"""Which TP x PP configurations exist for a model on a device, and the memory each leaves for KV.

    instance_configs(model, hw, dtype, gpus_per_node, total_gpus, max_len) -> (configs, rejected)

Rules (each rejection is kept with its reason, for the planner's error messages):
  - TP stays inside a node and divides the GPUs per node (instances pack into nodes);
  - TP divides the attention heads; it divides the KV heads, or is a multiple of them (each rank then
    holds a replica of one KV head, as vLLM does when TP > KV heads);
  - TP divides the FFN size (row/column-parallel MLP), and TP and PP are not combined: the engine runs
    either (`engine/parallel/validate.py`), and the planner emits only what `pdserve serve` can run;
  - PP divides the layers; an instance spans at most max(one node, 2x the smallest instance that fits)
    GPUs (wider pipelines only add bubbles and hops) and never more than the cluster;
  - memory per device: weights / (tp*pp) + an activation reserve <= util x device memory, and what is
    left holds the KV of at least one `max_len`-token sequence. Weights are the total parameters (a
    mixture of experts holds every expert); with expert parallelism (decode instances of MoE models,
    `expert_parallel.py`) the experts divide by tp x ep x pp and each EP group adds its own KV room.
Who calls: `search`, and `cli` for the "model fits no configuration" error. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster.planner.inputs.hardware import GIB, Hardware
from cluster.planner.inputs.models import DTYPE_BYTES, ModelSpec
from cluster.planner.latency.base import Parallel

MEM_UTIL = 0.9  # fraction of device memory the engine may use (vLLM's gpu_memory_utilization)
ACTIVATION_FRACTION = 0.05  # of device memory kept for activations and workspace


@dataclass(frozen=True)
class InstanceMemory:
    parallel: Parallel
    weights_per_gpu: float  # bytes
    kv_tokens: int  # KV capacity of the whole instance, in tokens (every rank holds all tokens' shards)
    kv_bytes_per_token_per_gpu: float


def instance_memory(model: ModelSpec, hw: Hardware, parallel: Parallel, dtype: str = "bfloat16",
                    util: float = MEM_UTIL) -> InstanceMemory:
    tp, pp, ep = parallel.tp, parallel.pp, parallel.ep
    weights = model.weight_bytes(dtype) / (tp * pp)  # total parameters: every expert is held somewhere
    if ep > 1:  # the experts split ep ways more; attention and dense parts on every group (latency/moe.py)
        weights -= model.expert_weight_params * DTYPE_BYTES[dtype] * (1 - 1 / ep) / (tp * pp)
    kv_heads_per_rank = max(1.0, model.kv_heads / tp)  # replicated when tp > kv heads
    per_token = 2 * (model.layers / pp) * kv_heads_per_rank * model.head_dim * DTYPE_BYTES[dtype]
    free = hw.memory * (util - ACTIVATION_FRACTION) - weights
    # each EP group holds the KV of its own sequences: capacity adds up over the groups
    return InstanceMemory(parallel, weights, max(0, int(free // per_token)) * ep, per_token)


def head_problem(model: ModelSpec, tp: int) -> str | None:
    if model.heads % tp:
        return f"tp {tp} does not divide {model.heads} attention heads"
    if model.kv_heads % tp and tp % model.kv_heads:
        return f"tp {tp} neither divides nor is a multiple of {model.kv_heads} KV heads"
    if model.ffn % tp:
        return f"tp {tp} does not divide the FFN size {model.ffn}"
    if model.is_moe and model.expert_ffn % tp:
        return f"tp {tp} does not divide the expert FFN size {model.expert_ffn}"
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def instance_configs(model: ModelSpec, hw: Hardware, dtype: str, gpus_per_node: int, total_gpus: int,
                     max_len: int, util: float = MEM_UTIL) -> tuple[list[InstanceMemory], list[str]]:
    """Every valid TP x PP with its memory; and why each other one was rejected."""
    fits, rejected = [], []
    for tp in _divisors(gpus_per_node):
        problem = head_problem(model, tp)
        if problem:
            rejected.append(problem)
            continue
        for pp in _divisors(model.layers):
            if tp * pp > total_gpus:
                break
            if tp > 1 and pp > 1:  # the engine runs one or the other (engine/parallel/validate.py)
                rejected.append(f"tp{tp}pp{pp}: tensor and pipeline parallel together are not runnable yet")
                continue
            mem = instance_memory(model, hw, Parallel(tp, pp), dtype, util)
            if mem.kv_tokens < max_len:
                rejected.append(f"tp{tp}pp{pp}: {mem.weights_per_gpu / GIB:.1f} GiB of weights per device leaves "
                                f"KV for {mem.kv_tokens} tokens (< one {max_len}-token sequence) in "
                                f"{hw.memory / GIB:.0f} GiB x {util:.0%}")
                continue
            fits.append(mem)
    if fits:
        smallest = min(m.parallel.gpus for m in fits)
        widest = min(total_gpus, max(gpus_per_node, 2 * smallest))
        fits = [m for m in fits if m.parallel.gpus <= widest]
    return fits, rejected
