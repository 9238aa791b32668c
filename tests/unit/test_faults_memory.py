"""Memory under a repeated fault (issue 8, section 2: "resident memory grows < 5% from cycle 10 to cycle 50
of a repeated fault"), on the in-process cluster (tiny random Llama, fake transport, no Ray). Each cycle
runs four requests through the same faults: every other KV transfer has a corrupted chunk (policy
recompute), one client leaves mid-stream, one request hits its deadline. After each cycle nothing is left
on any worker or in the router; the process's resident memory and its count of live Python objects at
cycle 50 are within 5% of cycle 10 (both read after a full garbage collection)."""
from __future__ import annotations

import asyncio
import gc
import itertools
import os
import threading

from cluster.serving_api import GenerateRequest
from engine import SamplingParams
from tests.cluster_helpers import assert_cluster_empty
from tests.unit.test_faults_tiny import cluster, run

CYCLES, MEASURE_AT = 50, 10
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _corrupt_every_other_transfer():
    opens, lock = itertools.count(), threading.Lock()
    state = {"bad": False}

    def fault(index, frame):
        kind = frame.WhichOneof("kind")
        if kind == "open":
            with lock:
                state["bad"] = next(opens) % 2 == 1
        elif kind == "chunk" and state["bad"] and index == 1:
            frame.chunk.payload = bytes(len(frame.chunk.payload))
        return [frame]
    return fault


async def _cycle(router, c: int) -> tuple[int, int] | None:
    async def full(i):
        out = [d async for d in router.generate(GenerateRequest(f"c{c}-{i}", [5 + i, 9, 33, 7], PARAMS,
                                                                model="tiny"))]
        return out[-1].finish_reason

    async def leaves():
        gen = router.generate(GenerateRequest(f"c{c}-leave", [60, 61, 62], PARAMS, model="tiny"))
        await gen.__anext__()
        await gen.aclose()

    async def times_out():
        req = GenerateRequest(f"c{c}-late", [7, 7, 7], SamplingParams(max_tokens=100, ignore_eos=True),
                              model="tiny", deadline_s=0.05)
        return [d async for d in router.generate(req)][-1].finish_reason

    reasons = await asyncio.gather(full(0), full(1), leaves(), times_out())
    assert reasons[:2] == ["length", "length"] and reasons[3] == "timeout", reasons
    stats = await assert_cluster_empty(router, timeout_s=20)
    if c + 1 not in (MEASURE_AT, CYCLES):
        return None
    assert sum(s.num_transfer_failures for n, s in stats.items() if n.startswith("decode")) >= c // 2
    gc.collect()
    return rss_bytes(), len(gc.get_objects())


def test_resident_memory_is_flat_from_cycle_10_to_50_of_a_repeated_fault(tiny_dir):
    async def main():
        router = cluster(tiny_dir, policy="recompute", fault=_corrupt_every_other_transfer(), decode_delay=0.005)
        try:
            samples = [s for s in [await _cycle(router, c) for c in range(CYCLES)] if s is not None]
        finally:
            await router.shutdown()
        (rss10, obj10), (rss50, obj50) = samples
        print(f"cycle {MEASURE_AT} -> {CYCLES}: RSS {rss10 / 2**20:.1f} -> {rss50 / 2**20:.1f} MiB "
              f"({100 * (rss50 / rss10 - 1):+.2f}%), Python objects {obj10} -> {obj50} "
              f"({100 * (obj50 / obj10 - 1):+.2f}%); ledger {router.ledger}")
        assert rss50 < 1.05 * rss10 and obj50 < 1.05 * obj10
        led = router.ledger
        assert led.balanced(0) and led.admitted == 4 * CYCLES and led.cancelled == CYCLES
        assert led.failed == CYCLES and led.completed == 2 * CYCLES, led
    run(main())
