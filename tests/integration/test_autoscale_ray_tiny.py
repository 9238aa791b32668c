"""The SLO autoscaler on a real local Ray with a tiny random Llama (marker `faults`): a colocated pool with
`autoscaling.enabled` (interval 0.5 s) under a synthetic load -- paced, then three clients back to back, then
paced again -- goes 1 -> 2 -> 1 replicas by itself, through the router's resize path. The capacity model is
a fake (2 replicas above 4 req/s): the planner's model of a tiny random Llama is not what is under test here,
the loop is (window -> policy -> scale -> drain). No request fails, outputs are greedy-equal to one
`engine.LLM`, the decisions are counted where /metrics reads them, and nothing is left in the workers or Ray."""
from __future__ import annotations

import asyncio
import time

import pytest

from cluster.serving.ray_pools import start_cluster
from cluster.serving_api import GenerateRequest
from engine import SamplingParams
from tests.cluster_helpers import Load, assert_cluster_empty, greedy_reference, tiny_ray_spec
from tests.exactness import assert_greedy_equal
from tests.prompts import CLUSTER_PROMPTS

pytestmark = pytest.mark.faults
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = CLUSTER_PROMPTS
BUSY = 4.0  # req/s above which the fake model asks for 2 replicas


class TwoWhenBusy:
    def needed(self, pool, load, correction, bounds):
        return min(bounds[1], 2 if load.rate > BUSY else 1)

    def predict(self, pool, load, replicas):
        return {}  # nothing to compare: the correction stays 1


def spec_for(model_dir):
    return tiny_ray_spec(model_dir, "colocated", {"colocated": {"max_replicas": 2}},
                         slo={"ttft_ms": 30000, "tpot_ms": 10000},
                         autoscaling={"enabled": True, "interval_s": 0.5, "window_s": 2.0, "scale_up_cooldown_s": 0,
                                      "scale_down_cooldown_s": 2.0, "scale_down_stable_intervals": 2,
                                      "min_samples": 3, "pools": {"colocated": {"min_replicas": 1, "max_replicas": 2}}})


async def paced(router, outputs, stop, every_s=0.5):
    """One client, one request every `every_s` (1-2 req/s: below BUSY)."""
    k = 0
    while not stop.is_set():
        i = k % len(PROMPTS)
        req = GenerateRequest(f"p-{k}", PROMPTS[i], GREEDY, model=router.model_name)
        out = [d async for d in router.generate(req)]
        assert out[-1].finished and out[-1].finish_reason == "length", out[-1]
        outputs.append((i, [t for d in out for t in d.new_token_ids]))
        k += 1
        await asyncio.sleep(every_s)


async def until(cond, timeout_s, what):
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, what
        await asyncio.sleep(0.1)


def test_the_autoscaler_grows_and_shrinks_a_pool_with_the_load(ray_session, tiny_dir):
    import ray

    reference = greedy_reference(tiny_dir, PROMPTS, GREEDY, page_size=8)
    total = ray.cluster_resources().get("CPU", 0)
    router = start_cluster(spec_for(tiny_dir), capacity=TwoWhenBusy())
    pool = router.pools["colocated"]

    async def main():
        outputs, stop = [], asyncio.Event()
        try:
            slow = asyncio.ensure_future(paced(router, outputs, stop))
            await asyncio.sleep(2.0)
            assert pool.target == 1, "a paced client alone must not scale the pool up"
            load = Load(router, PROMPTS, GREEDY, clients=3)
            await until(lambda: pool.target == 2 and len(pool.live()) == 2, 30, "no scale-up under load")
            await load.wait_for(len(load.outputs) + 10)
            assert (await router.workers["colocated"][1].handle.call("stats")).num_steps > 0
            await load.stop()
            await until(lambda: pool.target == 1 and len(pool.members) == 1, 30, "no scale-down once idle")
            await asyncio.sleep(1.0)  # the paced client keeps going on the one replica left
            stop.set()
            await slow
            for i, toks in outputs + load.outputs:
                assert_greedy_equal([reference[i]], [toks])
            counts = (await router.stats()).autoscaling["decisions"]
            assert counts.get(("colocated", "up", "forecast"), 0) == 1, counts
            assert counts.get(("colocated", "down", "low_load"), 0) == 1, counts
            await assert_cluster_empty(router, timeout_s=30)
            led = router.ledger
            assert led.balanced(0) and led.failed == 0 and led.completed == len(outputs) + len(load.outputs), led
            print(f"autoscaled 1 -> 2 -> 1: {led.completed} requests, none failed, {led.recovered} handed off; "
                  f"decisions {dict(counts)}")
        finally:
            stop.set()
            await router.shutdown()
    asyncio.run(main())
    end = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < total:  # every actor and placement group gone
        assert time.monotonic() < end, ray.available_resources()
        time.sleep(0.2)
