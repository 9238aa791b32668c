"""`serve` with tensor_parallel > 1 on a real local Ray (issue 9 item 4), with a tiny random Llama.

Specs: prefill TP=2 with `placement: strict_pack` (a STRICT_PACK placement group per replica, one bundle
of `resources` per rank) -> decode TP=1; prefill PP=2 (pack: one bundle of both ranks) -> decode TP=2
strict_pack; and, on a tiny Mixtral, prefill in one process -> decode EP=2 strict_pack (issue 35: expert ranks
started as the TP/PP ones). Fractional CPUs so they fit the 2-core session. Each parallel actor's engine starts its rank
processes as its own children; KV leaves over gRPC resharded (kv_io in the sender / receiver). Requests
served concurrently are greedy-equal to one `engine.LLM`; afterwards the cluster is empty, and after
shutdown no rank process and no placement group is left.
"""
from __future__ import annotations

import asyncio
import time

import pytest

from cluster.serving.ray_pools import start_cluster
from cluster.serving_api import GenerateRequest
from cluster.spec import parse_spec
from engine import LLM, SamplingParams
from tests.cluster_helpers import assert_cluster_empty
from tests.exactness import assert_greedy_equal
from tests.tiny_models import write_tiny
from tests.tiny_moe_models import write_tiny_moe

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone: it holds no memory and runs nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    end = time.monotonic() + timeout_s
    while any(map(_alive, pids)) and time.monotonic() < end:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _strict_packed() -> list[list[dict]]:
    import ray

    return [list(g["bundles"].values()) for g in ray.util.placement_group_table().values()
            if g["strategy"] == "STRICT_PACK" and g["state"] == "CREATED"]


async def _serve(router, spec, prompts, ref) -> dict[str, list[int]]:
    """Check each replica's rank processes and the STRICT_PACK reservation, serve `prompts` concurrently
    (greedy-equal to `ref`, cluster empty after), shut the router down; the rank pids by pool."""
    async def one(i):
        req = GenerateRequest(f"r{i}", prompts[i], PARAMS, model=router.model_name)
        return [t for d in [d async for d in router.generate(req)] for t in d.new_token_ids]

    try:
        pids = {}
        for name, pool in spec.pools_in_use().items():
            (worker,) = router.workers[name]
            pids[name] = worker.handle.info["rank_pids"]
            assert len(pids[name]) == (pool.degree if pool.degree > 1 else 0), (name, pids)
        assert _strict_packed() == [[{"CPU": 0.25}, {"CPU": 0.25}]]  # the strict_pack pool: a bundle per rank
        assert_greedy_equal(ref, list(await asyncio.gather(*(one(i) for i in range(len(prompts))))))
        await assert_cluster_empty(router, timeout_s=30)
        assert all(_alive(p) for ps in pids.values() for p in ps), "a replica's ranks run while it serves"
        return pids
    finally:
        await router.shutdown()


@pytest.mark.parametrize("prefill, decode", [
    ({"tensor_parallel": 2, "placement": "strict_pack"}, {}),  # the layout: TP=2 -> TP=1
    ({"pipeline_parallel": 2}, {"tensor_parallel": 2, "placement": "strict_pack"}),  # chunks into 2 ranks
    ({}, {"expert_parallel": 2, "placement": "strict_pack"}),  # MoE: each request's chunks into the rank of its pages
], ids=["prefill-tp2-strict-decode-tp1", "prefill-pp2-decode-tp2-strict", "moe-prefill-decode-ep2-strict"])
def test_serve_parallel_pools_greedy_equal_and_ranks_gone(ray_session, tmp_path, prefill, decode):
    import ray

    if "expert_parallel" in decode:
        model = write_tiny_moe("mixtral", tmp_path / "mixtral")
    else:
        model = write_tiny("llama", tmp_path / "l82", num_hidden_layers=2, num_attention_heads=8,
                           num_key_value_heads=2, initializer_range=0.1)
    prompts = [[(7 * i + j) % 250 + 3 for j in range(9 + 5 * i)] for i in range(3)]
    with LLM(model=str(model), dtype="float32", num_pages=64) as alone:
        ref = [o.token_ids for o in alone.generate(prompts, PARAMS)]
    pool = {"resources": {"num_cpus": 0.25}, "kv": {"page_size": 8, "num_pages": 64}, "max_model_len": 128}
    spec = parse_spec({"model": str(model), "dtype": "float32", "mode": "disaggregated",
                       "pools": {"prefill": {**pool, **prefill}, "decode": {**pool, **decode}},
                       "server": {"request_timeout_s": 120.0}})
    pids = asyncio.run(_serve(start_cluster(spec), spec, prompts, ref))
    everyone = [p for ps in pids.values() for p in ps]
    assert _wait_gone(everyone) == [], "rank processes outlived the cluster"
    assert not [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    print(f"{prefill} -> {decode} (rank processes {pids}): served greedy-equal, ranks gone")
