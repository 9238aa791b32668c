"""`ClusterRouter` over real workers on a tiny random Llama, in this process (no Ray): each worker runs on its
own `WorkerLoop` thread and KV moves over the in-process fake transport. Disaggregated (two decode workers)
and colocated output is greedy-equal to one `engine.LLM`; a decode worker short of pages preempts and
recomputes without losing or repeating a streamed token; a failed transfer is recomputed or ends with a
typed error per policy; deadline and disconnect free both sides; per-request KV bytes and peak pages reach
timelines and histograms; kivi4 pools equal one kivi4 engine. Every test ends with every worker empty."""
from __future__ import annotations

import asyncio

import pytest

from cluster.http.metrics import FrontendMetrics
from cluster.serving_api import BackendUnavailableError, GenerateRequest
from cluster.serving.worker_loop import start_local
from engine import SamplingParams
from engine.kv_cache.spec import KVPageSpec
from engine.llm import LLM
from engine.loader import load_config
from kv_transfer.fake_transport import FakeTransport
from tests.cluster_helpers import TinyCluster, assert_cluster_empty, greedy_reference
from tests.cluster_helpers import collect as collect_stream
from tests.exactness import assert_greedy_equal
from tests.prompts import CLUSTER_PROMPTS

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = CLUSTER_PROMPTS + [[100, 3], list(range(200, 230))]
PAGE = 4
# This file's cluster: 64 decode pages (256 tokens, every request fits), requests up to 256 tokens.
SHAPE = dict(page_size=PAGE, decode_pages=64, max_model_len=256, drain_timeout_s=0.2)
N_COLOCATED = 2


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return greedy_reference(tiny_dir, PROMPTS, GREEDY, PAGE)


def cluster(tiny_dir, mode="disaggregated", n_decode=2, policy="fail", fault=None, **shape):
    """Disaggregated: one prefill worker and `n_decode` decode workers (`policy` on a failed transfer, `fault`
    the fake transport's hook); colocated: `N_COLOCATED` replicas. `shape`: `TinyCluster` fields."""
    s = TinyCluster(tiny_dir, **{**SHAPE, **shape})
    transport = FakeTransport(fault)
    if mode == "disaggregated":
        pools = {"prefill": [start_local("prefill", "prefill-0", lambda: s.prefill(transport))],
                 "decode": [start_local("decode", f"decode-{i}", lambda: s.decode(transport, policy))
                            for i in range(n_decode)]}
    else:
        pools = {"colocated": [start_local("colocated", f"colocated-{i}", s.colocated) for i in range(N_COLOCATED)]}
    return s.router(mode, pools)


async def collect(router, rid, prompt, params=GREEDY, **kw):
    return await collect_stream(router, rid, prompt, params, "tiny", **kw)


async def collect_all(router, prompts=PROMPTS, **kw):
    """Every prompt at once (ids r0, r1, ...): [(token ids, deltas)] in prompt order."""
    return await asyncio.gather(*(collect(router, f"r{i}", p, **kw) for i, p in enumerate(prompts)))


def run(coro):
    return asyncio.run(coro)


def test_disaggregated_router_is_greedy_equal_and_spreads_over_decode_workers(tiny_dir, reference):
    async def main():
        router = cluster(tiny_dir)
        try:
            results = await collect_all(router)
            assert_greedy_equal(reference, [toks for toks, _ in results])
            for toks, deltas in results:
                assert "".join(d.new_text for d in deltas) == router.tokenizer().decode(toks)
                assert deltas[-1].finished and deltas[-1].finish_reason == "length"
                assert deltas[-1].completion_tokens == len(toks) and sum(not d.finished for d in deltas) >= 1
            stats = await assert_cluster_empty(router)
            assert all(stats[f"decode-{i}"].num_steps > 0 for i in range(2)), "one decode worker got nothing"
        finally:
            await router.shutdown()
    run(main())


def test_decode_preemption_recomputes_without_losing_or_repeating_tokens(tiny_dir, reference):
    async def main():  # 14 pages of 4 tokens: the six requests need ~50 pages at their longest
        router = cluster(tiny_dir, decode_pages=14, n_decode=1, max_model_len=56)
        try:
            results = await collect_all(router)
            assert_greedy_equal(reference, [toks for toks, _ in results])
            stats = await assert_cluster_empty(router)
            assert stats["decode-0"].num_preemptions > 0
            assert (await router.stats()).preemptions > 0
        finally:
            await router.shutdown()
    run(main())


def test_colocated_router_is_greedy_equal(tiny_dir, reference):
    async def main():
        router = cluster(tiny_dir, mode="colocated")
        try:
            results = await collect_all(router, return_timeline=True)
            assert_greedy_equal(reference, [toks for toks, _ in results])
            for _, deltas in results:  # queue and prefill separate on a colocated replica too
                t = deltas[-1].timeline
                order = ["queued", "prefill_start", "prefill_end", "first_token", "finish"]  # (engine_added races)
                assert [t[e] for e in order] == sorted(t[e] for e in order), t
                assert "kv_bytes" not in t and t["kv_pages"] > 0  # nothing crossed a wire
            await assert_cluster_empty(router)
        finally:
            await router.shutdown()
    run(main())


def _corrupt_first_chunk(index, frame):
    if frame.WhichOneof("kind") == "chunk" and frame.chunk.token_start == 0 and frame.chunk.layer == 0:
        frame.chunk.payload = bytes(len(frame.chunk.payload))  # checksum mismatch: DATA_LOSS
    return [frame]


def test_failed_transfer_is_recomputed_on_the_decode_worker(tiny_dir, reference):
    async def main():
        router = cluster(tiny_dir, policy="recompute", fault=_corrupt_first_chunk)
        try:
            results = await collect_all(router, PROMPTS[:3])
            assert_greedy_equal(reference[:3], [toks for toks, _ in results])
            stats = await assert_cluster_empty(router)
            assert sum(s.num_transfer_failures for n, s in stats.items() if n.startswith("decode")) == 3
        finally:
            await router.shutdown()
    run(main())


def test_failed_transfer_under_policy_fail_is_a_typed_error(tiny_dir):
    async def main():
        router = cluster(tiny_dir, policy="fail", fault=_corrupt_first_chunk, n_decode=1)
        try:
            with pytest.raises(BackendUnavailableError, match="transfer failed"):
                await collect(router, "r0", PROMPTS[0])
            await assert_cluster_empty(router)
        finally:
            await router.shutdown()
    run(main())


def test_deadline_and_disconnect_free_both_sides(tiny_dir):
    async def main():
        router = cluster(tiny_dir, n_decode=1, decode_pages=128, max_model_len=512)
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        try:
            # 0.1 s: 400 tokens of the tiny model took 0.3 s or less on a fast machine (a flaky "length")
            toks, deltas = await collect(router, "late", PROMPTS[0], long, deadline_s=0.1)
            assert deltas[-1].finish_reason == "timeout" and len(toks) < 400
            gen = router.generate(GenerateRequest("gone", PROMPTS[1], long, model="tiny"))
            assert (await gen.__anext__()).new_token_ids  # a token streamed, then the client goes away
            await gen.aclose()
            gen = router.generate(GenerateRequest("stopped", PROMPTS[2], long, model="tiny"))
            await gen.__anext__()
            await router.abort("stopped")
            assert [d.finish_reason async for d in gen][-1] == "abort"
            await assert_cluster_empty(router)
        finally:
            await router.shutdown()
    run(main())


def test_a_request_that_ends_at_its_first_token_frees_its_decode_reservation(tiny_dir, reference):
    async def main():
        router = cluster(tiny_dir, n_decode=1)
        try:
            toks, deltas = await collect(router, "one", PROMPTS[0], SamplingParams(max_tokens=1, temperature=0.0))
            assert toks == reference[0][:1] and deltas[-1].finish_reason == "length"
            await assert_cluster_empty(router)
        finally:
            await router.shutdown()
    run(main())


def test_timelines_and_transfer_totals_cover_both_workers(tiny_dir, reference):
    """Every phase of a disaggregated request is stamped, in causal order; KV totals reach the stats; each
    request's KV bytes shipped and peak pages held reach its timeline and the frontend's histograms."""
    chains = [["queued", "reserved", "prefill_end", "first_token", "finish"],
              ["reserved", "prefill_start", "prefill_end", "transfer_done", "finish"],
              ["prefill_end", "transfer_commit", "decode_admitted", "finish"]]  # (threads race across chains)

    async def main():
        router = cluster(tiny_dir, n_decode=1)
        try:
            results = await collect_all(router, return_timeline=True)
            assert_greedy_equal(reference, [toks for toks, _ in results])
            m = load_config(tiny_dir)
            per_token = m.num_layers * KVPageSpec(m.num_layers, m.num_kv_heads, m.head_dim, PAGE,
                                                  "float32").bytes_per_token_layer()
            metrics = FrontendMetrics()
            for (toks, deltas), prompt in zip(results, PROMPTS):
                t = deltas[-1].timeline
                # KV of the whole prompt (raw pages); a page per 4 tokens of prompt + outputs but the last
                assert t["kv_bytes"] == per_token * len(prompt), (t["kv_bytes"], len(prompt))
                assert t["kv_pages"] == -(-(len(prompt) + len(toks) - 1) // PAGE), (t["kv_pages"], len(prompt))
                metrics.observe_finished("length", len(prompt), len(toks), t)
                assert {e for c in chains for e in c} | {"transfer_start", "prefill_submitted"} <= set(t), sorted(t)
                for c in chains:
                    assert [t[e] for e in c] == sorted(t[e] for e in c), {e: t[e] for e in c}
                assert t["transfer_start"] == t["prefill_start"]
                assert all(d.timeline is None for d in deltas[:-1])
            stats = await assert_cluster_empty(router)
            p, d = stats["prefill-0"], stats["decode-0"]
            assert p.transfers_done == d.transfers_committed == len(PROMPTS) and p.transfers_failed == 0
            assert p.kv_bytes_sent == d.kv_bytes_received > 0 and p.kv_transfer_seconds > 0
            extra = (await router.stats()).extra
            assert extra["kv_transfer_bytes"] == p.kv_bytes_sent
            per_request = [d[-1].timeline for _, d in results]
            assert sum(t["kv_bytes"] for t in per_request) == p.kv_bytes_sent
            text = metrics.render().decode()
            assert f"pdserve_request_kv_bytes_count {float(len(PROMPTS))}" in text
            assert f"pdserve_request_kv_bytes_sum {float(p.kv_bytes_sent)}" in text
            assert f"pdserve_request_kv_pages_sum {float(sum(t['kv_pages'] for t in per_request))}" in text
        finally:
            await router.shutdown()
    run(main())


def test_kivi4_disaggregated_equals_kivi4_on_one_engine(tiny_dir):
    """kivi4 pools: whole pages ship, each decode worker recomputes the tail of a prompt ending inside a
    page; the output equals one kivi4 engine's, and each request's kv_bytes counts its whole pages only."""
    alone = LLM(model=str(tiny_dir), dtype="float32", num_pages=128, page_size=PAGE, kv_storage="kivi4")
    want = [o.token_ids for o in alone.generate(PROMPTS, GREEDY)]
    m = load_config(tiny_dir)
    per_token = m.num_layers * KVPageSpec(m.num_layers, m.num_kv_heads, m.head_dim, PAGE,
                                          "float32", "kivi4").bytes_per_token_layer()

    async def main():
        router = cluster(tiny_dir, storage="kivi4")
        try:
            results = await collect_all(router, return_timeline=True)
            assert_greedy_equal(want, [toks for toks, _ in results])
            for (_, deltas), prompt in zip(results, PROMPTS):
                assert deltas[-1].timeline["kv_bytes"] == per_token * (len(prompt) - len(prompt) % PAGE)
            await assert_cluster_empty(router)
        finally:
            await router.shutdown()
    run(main())
