"""Live resizing on a real local Ray with a tiny random Llama (marker `faults`): decode and colocated pools go
1 -> 2 -> 1 replicas under steady load (`ClusterRouter.scale`, what `pdserve scale` and the admin endpoint
call). No request fails, outputs are greedy-equal to one `engine.LLM`, the new actor takes work, the
drained one leaves: after the scale-down Ray has every CPU back that the added replica's placement group
held, and after shutdown every CPU the pools reserved."""
from __future__ import annotations

import asyncio
import time

import pytest

from cluster.serving.ray_pools import start_cluster
from engine import LLM, SamplingParams
from tests.cluster_helpers import Load, assert_cluster_empty, tiny_ray_spec
from tests.exactness import assert_greedy_equal
from tests.prompts import CLUSTER_PROMPTS

pytestmark = pytest.mark.faults
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = CLUSTER_PROMPTS


@pytest.fixture(scope="module")
def reference(tiny_dir):
    alone = LLM(model=str(tiny_dir), dtype="float32", num_pages=64)
    return [o.token_ids for o in alone.generate(PROMPTS, GREEDY)]


def _cpus_back(level):
    import ray

    end = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < level:
        assert time.monotonic() < end, (ray.available_resources(), level)
        time.sleep(0.2)


@pytest.mark.parametrize("mode,pool", [("disaggregated", "decode"), ("colocated", "colocated")])
def test_a_pool_grows_and_shrinks_under_steady_load(ray_session, tiny_dir, reference, mode, pool):
    import ray

    total = ray.cluster_resources().get("CPU", 0)
    router = start_cluster(tiny_ray_spec(tiny_dir, mode, {p: {"max_replicas": 2} for p in (pool, "prefill")}))

    async def main():
        try:
            load = Load(router, PROMPTS, GREEDY, clients=2)
            await load.wait_for(2)
            serving_cpus = ray.available_resources().get("CPU", 0)
            assert await router.scale(pool, 2) == {"pool": pool, "replicas": 2, "added": [f"{pool}-1"],
                                                   "removed": []}
            new = router.workers[pool][1]
            seen = len(load.outputs)
            await load.wait_for(seen + 6)
            assert (await new.handle.call("stats")).num_steps > 0, "the new actor never ran a step"
            assert await router.scale(pool, 1) == {"pool": pool, "replicas": 1, "added": [],
                                                   "removed": [f"{pool}-1"]}
            await asyncio.to_thread(_cpus_back, serving_cpus)  # its actor and placement group are gone
            await load.wait_for(len(load.outputs) + 2)
            await load.stop()
            for i, toks in load.outputs:
                assert_greedy_equal([reference[i]], [toks])
            await assert_cluster_empty(router, timeout_s=30)
            led = router.ledger
            assert led.balanced(0) and led.failed == 0 and led.completed == len(load.outputs), led
            print(f"{pool} 1 -> 2 -> 1 on Ray: {len(load.outputs)} requests, none failed, "
                  f"{led.recovered} handed off")
        finally:
            await router.shutdown()
    asyncio.run(main())
    _cpus_back(total)
