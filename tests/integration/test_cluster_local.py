"""Acceptance: SmolLM2 (float32) served through a real local Ray (2 CPUs, started here, shut down at the end)
by `ClusterRouter` is greedy-equal to one `engine.LLM`:
- disaggregated (1 prefill + 2 decode actors, KV over loopback gRPC): one request, then 16 at once;
- colocated (2 engine replicas): 16 at once;
- a decode worker with so few pages that its scheduler preempts (counter asserted) and recomputes;
- over HTTP (Python client, openai SDK): greedy-equal single and 16 concurrent; bad requests (400/404/413/
  429) get OpenAI error bodies while streamed requests finish intact.
The colocated and the preemption tests start their own cluster; the disaggregated, bad-input and HTTP-client
tests share one (`disaggregated`, started after the other two have shut theirs down: the 2 CPUs hold one
cluster at a time), each test leaving it empty for the next. Every test ends with every worker reporting no
pages, reservations, requests or transfers."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json

import pytest
import torch

from cluster.serving.ray_pools import start_cluster
from cluster.spec import parse_spec
from engine import LLM, SamplingParams
from tests.cluster_helpers import assert_cluster_empty, collect, serving
from tests.exactness import assert_greedy_equal
from tests.prompts import token_prompts

pytestmark = pytest.mark.slow
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
LENGTHS = [20 + 13 * i for i in range(16)]  # 20 .. 215 tokens of real text
TIGHT = [64, 48, 48, 32, 64, 16]  # whole pages: 10 pages fill at once, the first decode step needs more
MODEL = "smollm2-135m"


def spec(mode: str, **pools):
    return parse_spec({"model": MODEL, "dtype": "float32", "mode": mode, "pools": pools,
                       "server": {"max_queued_requests": 64, "request_timeout_s": 300.0}})


def pool(replicas=1, cpus=1.0, pages=128, max_len=1024, **kw):
    return {"replicas": replicas, "resources": {"num_cpus": cpus}, "kv": {"page_size": 16, "num_pages": pages},
            "max_model_len": max_len, **kw}


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    alone = LLM(model=MODEL, dtype="float32", page_size=16, num_pages=256, keep_logits=True)
    out = {}
    for name, lengths in (("many", LENGTHS), ("tight", TIGHT)):
        prompts = token_prompts(alone.tokenizer, lengths)
        outs = alone.generate(prompts, PARAMS)
        out[name] = (prompts, [o.token_ids for o in outs], [torch.stack(o.logits) for o in outs])
    del alone
    return out


async def serve_all(router, prompts, prefix):
    """Token ids of each request; the streamed text pieces add up to the text of those tokens."""
    results = await asyncio.gather(*(collect(router, f"{prefix}{i}", p, PARAMS, MODEL) for i, p in enumerate(prompts)))
    for toks, deltas in results:
        assert "".join(d.new_text for d in deltas) == router.tokenizer().decode(toks)
    return [toks for toks, _ in results]


def test_colocated_16_concurrent(ray_session, reference):
    prompts, ref, logits = reference["many"]
    router = start_cluster(spec("colocated", colocated=pool(replicas=2)))

    async def main():
        try:
            assert_greedy_equal(ref, await serve_all(router, prompts, "co-"), logits)
            await assert_cluster_empty(router)
        finally:
            await router.shutdown()
    asyncio.run(main())


def test_decode_preemption_keeps_the_output(ray_session, reference):
    prompts, ref, logits = reference["tight"]
    router = start_cluster(spec("disaggregated", prefill=pool(),
                                          decode=pool(pages=10, max_len=160)))

    async def main():
        try:
            assert_greedy_equal(ref, await serve_all(router, prompts, "tight-"), logits)
            stats = await assert_cluster_empty(router)
            assert stats["decode-0"].num_preemptions > 0, stats["decode-0"]
        finally:
            await router.shutdown()
    asyncio.run(main())


@pytest.fixture(scope="module")
def disaggregated(ray_session):
    """(router, event loop): 1 prefill (16 sequences a batch) + 2 decode actors, shared by the tests below
    (after the two above: this fixture lives until the module ends). One loop for its life: the router's
    tasks are bound to the loop they started on."""
    router = start_cluster(spec("disaggregated", prefill=pool(max_num_seqs=16), decode=pool(replicas=2, cpus=0.5)))
    loop = asyncio.new_event_loop()
    yield router, loop
    loop.run_until_complete(router.shutdown())
    loop.close()


@contextlib.contextmanager
def queue_limit(router, limit: int):
    """The shared router refuses (429) past `limit` queued requests for a while: its spec allows 64, which the
    16-at-once tests need, and a burst past 64 would cost 64 prefills."""
    saved = router.cfg
    router.cfg = dataclasses.replace(saved, max_queued_requests=limit)
    try:
        yield
    finally:
        router.cfg = saved


def test_disaggregated_single_and_16_concurrent(disaggregated, reference):
    prompts, ref, logits = reference["many"]
    router, loop = disaggregated

    async def main():
        one = await serve_all(router, prompts[:1], "one-")
        assert_greedy_equal(ref[:1], one, logits[:1])
        before = await router.worker_stats()
        many = await serve_all(router, prompts, "many-")
        assert_greedy_equal(ref, many, logits)
        stats = await assert_cluster_empty(router)
        assert all(stats[f"decode-{i}"].num_steps > before[f"decode-{i}"].num_steps for i in range(2)), stats
    loop.run_until_complete(main())


def test_http_bad_input_over_the_cluster_harms_no_one(disaggregated, reference):
    """Over HTTP in front of the disaggregated cluster: 400 (bad value, unsupported feature, internal
    field), 404 (unknown model), 413 (oversized body) and 429 (a burst past the queue limit, 2 here) get
    OpenAI error bodies while three streamed requests run to the reference output; nothing leaks."""
    import httpx

    prompts, ref, logits = reference["many"]
    router, loop = disaggregated
    bad = [(400, {"max_tokens": -1}), (400, {"tools": [{"type": "function"}]}),
           (400, {"pdserve": {"reservation_id": "r-1"}}), (404, {"model": "no-such-model"}),
           (413, {"prompt": "x" * 70_000})]

    async def stream(client, i, started: asyncio.Event):
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 16, "temperature": 0, "stream": True,
                "pdserve": {"ignore_eos": True, "return_token_ids": True}}
        ids = []
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
                    started.set()
        return ids

    async def main():
        async with serving(router, max_body_bytes=64 * 1024) as url, \
                httpx.AsyncClient(base_url=url, timeout=300) as client:
            good = []
            for i in range(3):  # one at a time, so none of them counts as queued when the burst comes
                started = asyncio.Event()
                good.append(asyncio.create_task(stream(client, i, started)))
                await asyncio.wait_for(started.wait(), 120)
            for status, extra in bad:
                r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", **extra})
                assert r.status_code == status, (status, extra, r.text)
                assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
            with queue_limit(router, 2):
                burst = await asyncio.gather(*(client.post("/v1/completions", json={
                    "model": MODEL, "prompt": prompts[-1], "max_tokens": 2, "temperature": 0})
                    for _ in range(8)))
            codes = sorted(r.status_code for r in burst)
            assert 429 in codes and set(codes) <= {200, 429}, codes
            assert all(r.json()["error"]["type"] for r in burst if r.status_code == 429)
            assert_greedy_equal(ref[:3], await asyncio.gather(*good), logits[:3])
        await assert_cluster_empty(router)
    loop.run_until_complete(main())


def test_http_clients_over_the_disaggregated_cluster(disaggregated, reference):
    """The Python client (sync and async, streamed and not) and the openai SDK over HTTP in front of the
    disaggregated cluster: one request at a time, then 16 at once, greedy-equal to the engine alone."""
    openai = pytest.importorskip("openai")
    from cluster.client import AsyncClient, Client

    prompts, ref, logits = reference["many"]
    router, loop = disaggregated
    opts = dict(max_tokens=PARAMS.max_tokens, temperature=0, pdserve={"ignore_eos": True, "return_token_ids": True})

    def singles(url):
        client = Client(url)
        plain = client.complete(prompts[0], **opts)
        streamed = list(client.complete(prompts[1], stream=True, **opts))
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        one = sdk.completions.create(model=MODEL, prompt=prompts[2], max_tokens=PARAMS.max_tokens, temperature=0,
                                     extra_body={"pdserve": opts["pdserve"]})
        assert "".join(c.text for c in streamed) == router.tokenizer().decode(_ids(streamed))
        return [plain.choices[0].token_ids, _ids(streamed), one.choices[0].token_ids]

    async def many(url):
        async with AsyncClient(url) as ac:
            async def one(i):
                if i % 2:
                    return _ids([c async for c in await ac.complete(prompts[i], stream=True, **opts)])
                return (await ac.complete(prompts[i], **opts)).choices[0].token_ids
            return await asyncio.gather(*(one(i) for i in range(16)))

    async def main():
        async with serving(router) as url:  # a new app: its request metrics count these requests only
            async with AsyncClient(url) as ac:
                moved = _scrape(await ac.metrics())  # the KV totals are the shared backend's, since it started
            assert_greedy_equal(ref[:3], await asyncio.to_thread(singles, url), logits[:3])
            assert_greedy_equal(ref, await many(url), logits)
            async with AsyncClient(url) as ac:
                metrics = _scrape(await ac.metrics())
        for total in ("pdserve_kv_transfer_bytes", "pdserve_kv_transfer_seconds"):  # these requests moved KV
            assert metrics[total] > moved[total], (total, moved[total], metrics[total])
        for phase in ("queue", "prefill", "transfer", "handoff", "ttft", "decode"):  # every request stamped
            assert metrics[f'pdserve_request_phase_seconds_count{{phase="{phase}"}}'] == 19, phase
        await assert_cluster_empty(router)
    loop.run_until_complete(main())


def _scrape(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line[:1] not in "#")}


def _ids(chunks) -> list[int]:
    return [t for c in chunks for t in (c.token_ids or [])]
