"""`serve` with tensor_parallel > 1 on a real local Ray (issue 9 item 4), with a tiny random Llama.

Spec: prefill TP=2 with `placement: strict_pack` (a STRICT_PACK placement group per replica, one bundle
of `resources` per rank), decode TP=1; fractional CPUs so it fits the 2-core session. The prefill actor's
engine starts its two rank processes as its own children; its KV leaves over gRPC resharded to the decode
actor's one process (kv_io through the sender). Requests served concurrently are greedy-equal to one
`engine.LLM`; afterwards the cluster is empty, and after shutdown no rank process is left.
"""
from __future__ import annotations

import asyncio
import time

from cluster.router import ClusterRouter
from cluster.serving_api import GenerateRequest
from cluster.spec import parse_spec
from engine import LLM, SamplingParams
from tests.cluster_helpers import assert_cluster_empty
from tests.exactness import assert_greedy_equal
from tests.tiny_models import write_tiny

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


def test_serve_prefill_tp2_decode_tp1_greedy_equal_and_ranks_gone(ray_session, tmp_path):
    import ray

    model = write_tiny("llama", tmp_path / "l82", num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=2, initializer_range=0.1)
    prompts = [[(7 * i + j) % 250 + 3 for j in range(9 + 5 * i)] for i in range(3)]
    with LLM(model=str(model), dtype="float32", num_pages=64) as alone:
        ref = [o.token_ids for o in alone.generate(prompts, PARAMS)]
    pool = {"resources": {"num_cpus": 0.25}, "kv": {"page_size": 8, "num_pages": 64}, "max_model_len": 128}
    spec = parse_spec({"model": str(model), "dtype": "float32", "mode": "disaggregated",
                       "pools": {"prefill": {**pool, "tensor_parallel": 2, "placement": "strict_pack"},
                                 "decode": pool},
                       "server": {"request_timeout_s": 120.0}})
    router = ClusterRouter.from_spec(spec)
    (prefill,), (decode,) = router.workers["prefill"], router.workers["decode"]
    rank_pids = prefill.handle.info["rank_pids"]
    assert len(rank_pids) == 2 and decode.handle.info["rank_pids"] == []
    packed = [g for g in ray.util.placement_group_table().values()
              if g["strategy"] == "STRICT_PACK" and g["state"] == "CREATED"]
    assert [list(g["bundles"].values()) for g in packed] == [[{"CPU": 0.25}, {"CPU": 0.25}]]

    async def one(i):
        req = GenerateRequest(f"tp{i}", prompts[i], PARAMS, model=router.model_name)
        return [t for d in [d async for d in router.generate(req)] for t in d.new_token_ids]

    async def main():
        try:
            got = await asyncio.gather(*(one(i) for i in range(len(prompts))))
            assert_greedy_equal(ref, list(got))
            await assert_cluster_empty(router, timeout_s=30)
            assert all(map(_alive, rank_pids)), "the prefill replica's ranks run while it serves"
        finally:
            await router.shutdown()
    asyncio.run(main())
    assert _wait_gone(rank_pids) == [], "rank processes outlived the cluster"
    assert not [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    print(f"prefill TP=2 (rank processes {rank_pids}) -> decode TP=1: served greedy-equal, ranks gone")
