"""Live resizing on the in-process cluster (tiny random Llama, real workers on `WorkerLoop` threads, the fake KV
transport, `LocalPools` as the spawner; no Ray): decode and colocated pools go 1 -> 2 -> 1 replicas under
steady load -- no request fails, every output is greedy-equal to one `engine.LLM`, the new worker takes
work, the drained one finishes (or, with no drain time, hands off) what it held and leaves with nothing
behind, the ledger balances. Bad resizes (below 1, above max_replicas, an unknown pool, not an integer,
one under way) raise a typed error and change nothing; over HTTP the admin endpoint answers 400/401 and
`pdserve scale` resizes."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import httpx
import pytest

from cluster import cli
from cluster.serving.scaling import ScaleError
from cluster.serving.worker_loop import LocalPools
from cluster.serving_api import GenerateRequest
from engine import SamplingParams
from kv_transfer.fake_transport import FakeTransport
from tests.cluster_helpers import Load, TinyCluster, assert_cluster_empty, greedy_reference
from tests.exactness import assert_greedy_equal
from tests.prompts import CLUSTER_PROMPTS

PAGE = 4
MAX_REPLICAS = 2  # each test grows a pool to 2 and back to 1
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = CLUSTER_PROMPTS


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return greedy_reference(tiny_dir, PROMPTS, GREEDY, PAGE)


def cluster(tiny_dir, mode="disaggregated", **cfg):
    """One replica per pool, each pool allowed `MAX_REPLICAS`; `LocalPools` starts the new ones."""
    shape, transport = TinyCluster(tiny_dir, page_size=PAGE), FakeTransport(None)
    factories = {"prefill": lambda: shape.prefill(transport), "decode": lambda: shape.decode(transport),
                 "colocated": shape.colocated}
    names = ("prefill", "decode") if mode == "disaggregated" else ("colocated",)
    spawner = LocalPools({n: factories[n] for n in names})
    pools = {n: [spawner.start(n, f"{n}-0")] for n in names}
    cfg = {"max_replicas": {n: MAX_REPLICAS for n in names}, **cfg}
    return shape.router(mode, pools, spawner=spawner, **cfg), spawner


@pytest.mark.parametrize("mode,pool,drain_s", [("disaggregated", "decode", 30.0), ("disaggregated", "decode", 0.0),
                                               ("colocated", "colocated", 30.0), ("colocated", "colocated", 0.0)])
def test_a_pool_grows_and_shrinks_under_steady_load_without_a_failed_request(tiny_dir, reference, mode, pool,
                                                                            drain_s):
    async def main():
        router, spawner = cluster(tiny_dir, mode, scale_drain_s=drain_s)
        try:
            load = Load(router, PROMPTS, GREEDY)
            await load.wait_for(3)
            out = await router.scale(pool, 2)
            assert out == {"pool": pool, "replicas": 2, "added": [f"{pool}-1"], "removed": []}
            old, new = router.workers[pool]
            assert new.alive and router.health()["pools"][pool] == {**router.health()["pools"][pool], "live": 2,
                                                                    "target": 2, "degraded": False}
            seen = len(load.outputs)
            await load.wait_for(seen + 8)
            took_work = (await new.handle.call("stats")).num_steps
            assert took_work > 0, "the new worker never ran a step"
            end = time.monotonic() + 30
            while not new.flights:  # it holds requests when it is told to leave
                assert time.monotonic() < end
                await asyncio.sleep(0.005)
            held = len(new.flights)
            out = await router.scale(pool, 1)  # the newest leaves
            assert out == {"pool": pool, "replicas": 1, "added": [], "removed": [f"{pool}-1"]}
            assert router.workers[pool] == [old] and new.state == "gone" and not new.handle.loop.alive
            assert all(h.name != f"{pool}-1" for h in spawner.started)  # nothing of it is left
            await load.wait_for(len(load.outputs) + 4)
            await load.stop()
            for i, toks in load.outputs:
                assert_greedy_equal([reference[i]], [toks])
            await assert_cluster_empty(router)
            led = router.ledger
            assert led.balanced(0) and led.failed == 0 and led.completed == len(load.outputs), led
            assert led.workers_lost == 0 and router.health()["status"] == "ok"
            assert (led.recovered > 0) == (drain_s == 0.0)  # no drain time: what it held was handed off
            print(f"{pool} 1 -> 2 -> 1 (drain {drain_s} s): {len(load.outputs)} requests, none failed; the "
                  f"leaving worker held {held}, {led.recovered} handed off")
        finally:
            await router.shutdown()
    asyncio.run(main())


def test_a_placement_that_lands_on_a_worker_while_it_leaves_is_handed_off(tiny_dir, reference):
    """The scaler's race (seen in CI): a request placed on the newest worker before a resize to 1 reaches it
    only after the drain found it empty (its add and the emptiness check cross). The worker must still leave,
    and the request finish elsewhere, greedy-equal."""
    async def main():
        router, _ = cluster(tiny_dir, "colocated", scale_drain_s=0.0)
        try:
            await router.scale("colocated", 2)
            old, new = router.workers["colocated"]
            router.prefix.pick_colocated = lambda ws, hashes, n: new if new in ws else ws[0]
            asked, gate, call = asyncio.Event(), asyncio.Event(), new.handle.call

            async def crossing(method, *args):
                if method == "add_request":
                    asked.set()
                    await gate.wait()
                elif method == "stats" and new.state == "draining" and not gate.is_set():
                    reply = await call(method, *args)  # (taken before the add lands, read after)
                    gate.set()
                    while not new.flights:
                        await asyncio.sleep(0.005)
                    return reply
                return await call(method, *args)

            new.handle.call = crossing
            req = GenerateRequest("late", PROMPTS[0], GREEDY, model=router.model_name)
            run = asyncio.ensure_future(collect(router.generate(req)))
            await asked.wait()  # (placed on `new`, not yet there)
            out = await router.scale("colocated", 1)
            assert out["removed"] == ["colocated-1"] and router.workers["colocated"] == [old]
            toks = await run
            assert_greedy_equal([reference[0]], [toks])
            await assert_cluster_empty(router)
            assert router.ledger.recovered == 1 and router.ledger.failed == 0
        finally:
            await router.shutdown()
    asyncio.run(main())


async def collect(stream):
    out = [d async for d in stream]
    assert out[-1].finished and out[-1].finish_reason == "length", out[-1]
    return [t for d in out for t in d.new_token_ids]


BAD = {  # name: (pool, replicas, field, words)
    "below 1": ("decode", 0, "replicas", "outside [1, 2]"),
    "negative": ("decode", -3, "replicas", "outside [1, 2]"),
    "above max_replicas": ("decode", 3, "replicas", "max_replicas is 2"),
    "an unknown pool": ("colocated", 1, "pool", "not a pool of this cluster"),
    "not an integer": ("decode", 1.5, "replicas", "must be an integer"),
    "a bool": ("decode", True, "replicas", "must be an integer"),
}


def test_bad_resizes_raise_a_typed_error_naming_the_field_and_change_nothing(tiny_dir):
    async def main():
        router, spawner = cluster(tiny_dir)
        try:
            before = [(w.name, w.state) for ws in router.workers.values() for w in ws], len(spawner.started)
            for name, (pool, n, field, words) in BAD.items():
                with pytest.raises(ScaleError) as err:
                    await router.scale(pool, n)
                assert err.value.field == field and words in str(err.value), (name, str(err.value))
            grow = asyncio.ensure_future(router.scale("decode", 2))
            await asyncio.sleep(0)  # (it has started: the pool is busy)
            with pytest.raises(ScaleError, match="under way"):
                await router.scale("decode", 1)
            await grow
            await router.scale("decode", 1)
            after = [(w.name, w.state) for ws in router.workers.values() for w in ws], len(spawner.started)
            assert after == before and router.pools["decode"].target == 1
        finally:
            await router.shutdown()
    asyncio.run(main())


@contextlib.asynccontextmanager
async def serving_with_key(backend, key):
    import uvicorn

    from cluster.server import _config

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(_config(backend, "127.0.0.1", 0, key, 1 << 20, "warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


def test_the_admin_endpoint_needs_the_key_checks_its_body_and_pdserve_scale_resizes(tiny_dir, monkeypatch, capsys):
    async def main():
        router, _ = cluster(tiny_dir, "colocated")
        try:
            async with serving_with_key(router, "s3cret") as url, httpx.AsyncClient(base_url=url) as c:
                path, auth = "/v1/pdserve/admin/scale", {"Authorization": "Bearer s3cret"}
                r = await c.post(path, json={"pool": "colocated", "replicas": 2})
                assert r.status_code == 401 and len(router.workers["colocated"]) == 1
                for body, param in (({"pool": "colocated", "replicas": 0}, "replicas"),
                                    ({"pool": "decode", "replicas": 1}, "pool"),
                                    ({"pool": "colocated", "replicas": "2"}, "replicas"),
                                    ({"pool": "colocated"}, "replicas"),
                                    ({"pool": "colocated", "replicas": 2, "force": True}, "force")):
                    r = await c.post(path, json=body, headers=auth)
                    assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
                assert len(router.workers["colocated"]) == 1 and router.pools["colocated"].target == 1
                monkeypatch.setenv("PDSERVE_API_KEY", "s3cret")
                rc = await asyncio.to_thread(cli.main, ["scale", url, "--pool", "colocated", "--replicas", "2"])
                assert rc == 0 and "pool colocated has 2 replica(s) (added: colocated-1" in capsys.readouterr().out
                assert len(router.workers["colocated"]) == 2
                rc = await asyncio.to_thread(cli.main, ["scale", url, "--pool", "colocated", "--replicas", "9"])
                assert rc == 2 and "replicas: 9 is outside [1, 2]" in capsys.readouterr().err
                monkeypatch.delenv("PDSERVE_API_KEY")
                rc = await asyncio.to_thread(cli.main, ["scale", url, "--pool", "colocated", "--replicas", "1"])
                assert rc == 2 and "401" in capsys.readouterr().err and len(router.workers["colocated"]) == 2
                r = await c.post(path, json={"pool": "colocated", "replicas": 1}, headers=auth)
                assert r.status_code == 200 and r.json()["removed"] == ["colocated-1"]
        finally:
            await router.shutdown()
    asyncio.run(main())
