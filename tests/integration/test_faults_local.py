"""Fault injection against the real local cluster (`deploy/local-2d.yaml`'s shape: 1 prefill + 2 decode Ray
actors, SmolLM2 float32, KV over loopback gRPC): a decode actor killed mid-stream (`ray.kill`, no restart).
The requests it was decoding resume on the other decode actor (prompt + streamed tokens re-prefilled), the
streams neither lose nor repeat a token and stay greedy-equal to one `engine.LLM`, the ledger balances
(admitted == completed), and the surviving workers end empty. Marker `faults` (and `slow`: it loads SmolLM2);
the README test command runs it."""
from __future__ import annotations

import asyncio
import time

import pytest
import torch

from cluster.router import ClusterRouter
from cluster.serving_api import GenerateRequest
from cluster.spec import parse_spec
from engine import LLM, SamplingParams
from tests.cluster_helpers import assert_cluster_empty
from tests.exactness import assert_greedy_equal
from tests.prompts import token_prompts

pytestmark = [pytest.mark.slow, pytest.mark.faults]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LENGTHS = [40, 60, 80, 100, 120, 140]
MODEL = "smollm2-135m"


def local_2d():
    pool = {"resources": {"num_cpus": 0.5}, "kv": {"page_size": 16, "num_pages": 128}, "max_model_len": 1024}
    return parse_spec({"model": MODEL, "dtype": "float32", "mode": "disaggregated",
                       "pools": {"prefill": {**pool, "replicas": 1, "resources": {"num_cpus": 1.0}},
                                 "decode": {**pool, "replicas": 2}},
                       "kv_transfer": {"failure_policy": "recompute"},
                       "server": {"max_queued_requests": 64, "request_timeout_s": 300.0}})


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    alone = LLM(model=MODEL, dtype="float32", page_size=16, num_pages=256, keep_logits=True)
    prompts = token_prompts(alone.tokenizer, LENGTHS)
    outs = alone.generate(prompts, PARAMS)
    return prompts, [o.token_ids for o in outs], [torch.stack(o.logits) for o in outs]


def test_a_decode_actor_killed_mid_stream_resumes_on_the_other(ray_session, reference):
    import ray

    prompts, ref, logits = reference
    router = ClusterRouter.from_spec(local_2d())

    async def main():
        try:
            gens = [router.generate(GenerateRequest(f"r{i}", p, PARAMS, model=MODEL, return_timeline=True))
                    for i, p in enumerate(prompts)]
            outs = [[await g.__anext__()] for g in gens]  # every request has streamed its first token
            victim = max(router.workers["decode"], key=lambda w: len(w.flights))
            moved = len(victim.flights)
            assert moved > 0
            t0 = time.monotonic()
            ray.kill(victim.handle.actor, no_restart=True)

            async def rest(g, out):
                out += [d async for d in g]
            await asyncio.gather(*(rest(g, o) for g, o in zip(gens, outs)))
            took = time.monotonic() - t0
            toks = [[t for d in out for t in d.new_token_ids] for out in outs]
            for out, t in zip(outs, toks):
                assert out[-1].finished and sum(d.finished for d in out) == 1
                assert "".join(d.new_text for d in out) == router.tokenizer().decode(t)
            assert_greedy_equal(ref, toks, logits)
            resumed = sum("recovered" in out[-1].timeline for out in outs)
            assert 0 < resumed <= moved and not victim.alive
            await assert_cluster_empty(router, timeout_s=30)
            led = router.ledger
            assert led.admitted == led.completed == len(prompts) and led.balanced(0) and led.workers_lost == 1
            print(f"decode actor killed: {resumed} of {len(prompts)} requests resumed; all done {took:.1f} s later")
        finally:
            await router.shutdown()
    asyncio.run(main())
