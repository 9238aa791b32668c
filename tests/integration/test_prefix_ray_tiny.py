"""Prefix caching + prefix-aware routing on a real local Ray (tiny random Llama, float32, real gRPC; marked
`slow` for the Ray start): the spec's `kv.prefix_caching` and `routing` reach the actors and the router,
the actors' ready info carries the engine's page naming and their `prefix_hashes` reports refresh the
index; requests sharing a prefix at a page boundary, one past it and in whole, concurrently, are
greedy-equal to one `engine.LLM`; KV is left unsent; the cluster ends empty."""
from __future__ import annotations

import asyncio
import random

import pytest

from cluster.serving.ray_pools import start_cluster
from cluster.spec import parse_spec
from engine import LLM, SamplingParams
from tests.cluster_helpers import assert_cluster_empty
from tests.cluster_helpers import collect as collect_stream
from tests.exactness import assert_greedy_equal

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
rng = random.Random(3)
BASE = [rng.randrange(3, 250) for _ in range(40)]
PROMPTS = [BASE[:16] + [7, 8, 9], BASE[:17] + [4, 5], BASE[:32], BASE + [11, 12, 13], [9] * 5 + BASE]


def test_prefix_caching_and_routing_through_ray_actors(ray_session, tiny_dir):
    alone = LLM(model=str(tiny_dir), dtype="float32", num_pages=64, page_size=8)
    ref = [o.token_ids for o in alone.generate([BASE] + PROMPTS, PARAMS)]
    pool = {"replicas": 2, "resources": {"num_cpus": 0.5}, "max_model_len": 128,
            "kv": {"page_size": 8, "num_pages": 64, "prefix_caching": True}}
    spec = parse_spec({"model": str(tiny_dir), "dtype": "float32", "mode": "disaggregated",
                       "pools": {"prefill": pool, "decode": pool}, "routing": {"refresh_s": 0.2}})
    router = start_cluster(spec)

    async def main():
        try:
            assert router.prefix.active("prefill") and router.prefix.active("decode")
            warm = (await collect_stream(router, "warm", BASE, PARAMS, router.model_name))[0]
            got = await asyncio.gather(*(collect_stream(router, f"r{i}", p, PARAMS, router.model_name)
                                         for i, p in enumerate(PROMPTS)))
            assert_greedy_equal(ref, [warm] + [t for t, _ in got])
            await asyncio.sleep(1.0)  # a refresh round over the actors
            extra = (await router.stats()).extra
            assert extra["kv_bytes_not_sent"] > 0 and extra["prefill_tokens_saved"] > 0, extra
            assert extra["prefix_routing_refreshes"] >= 4 and extra["prefix_routing_decode_warm"] > 0
            await assert_cluster_empty(router)
        finally:
            await router.shutdown()
    asyncio.run(main())
