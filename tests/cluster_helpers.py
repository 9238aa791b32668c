"""Helpers for router tests (in-process workers and Ray): collect a stream, the cluster leak check, serving a
backend over HTTP on the test's own event loop, a steady load of callers (`Load`), the tiny Llama's greedy
reference, the in-process tiny cluster's workers and router (`TinyCluster`), and a multi-node Ray on this
machine (`ray_test_cluster`)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import shutil
import socket
import tempfile
import time
from pathlib import Path

from cluster.serving.router import ClusterRouter, RouterConfig
from cluster.serving_api import GenerateRequest
from decode_worker.worker import DecodeWorker
from engine.tokenizer import Tokenizer
from kv_transfer.config import ReceiverConfig, SenderConfig
from prefill_worker.worker import PrefillWorker
from tests.tiny_models import TINY


async def collect(router, rid, prompt, params, model, **kw):
    """(token ids streamed, the deltas) of one request; each token must appear once."""
    deltas = [d async for d in router.generate(GenerateRequest(rid, prompt, params, model=model, **kw))]
    assert deltas and deltas[-1].finished and sum(d.finished for d in deltas) == 1
    return [t for d in deltas for t in d.new_token_ids], deltas


async def assert_cluster_empty(router, timeout_s: float = 10.0) -> dict:
    """Every worker: no pages, reservations, requests or transfers left (cleanup calls are asynchronous,
    so this waits up to `timeout_s`); the router holds no request. Returns the workers' final stats."""
    left = await router.leftovers(timeout_s)
    assert not left, f"workers still hold state: {left}"
    return await router.worker_stats()


@contextlib.asynccontextmanager
async def serving(backend, max_body_bytes: int = 1 << 20):
    """uvicorn for `backend` on this event loop (127.0.0.1, a free port); yields the base URL. Running on
    the caller's loop lets a test drive the router (leak checks, shutdown) between HTTP calls."""
    import uvicorn

    from cluster.server import _config

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(_config(backend, "127.0.0.1", 0, None, max_body_bytes, "warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), task.exception()
            await asyncio.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        sock.close()


class Load:
    """`clients` callers, each sending `prompts` one after another (greedy `params`, every one must finish
    "length") until `stop()`; `outputs` keeps (prompt index, token ids) of each finished request."""

    def __init__(self, router, prompts, params, clients=3):
        self.router, self.prompts, self.params, self.outputs, self.stopped = router, prompts, params, [], False
        self.tasks = [asyncio.ensure_future(self._client(c)) for c in range(clients)]

    async def _client(self, c):
        k = 0
        while not self.stopped:
            i = (c + k) % len(self.prompts)
            req = GenerateRequest(f"c{c}-{k}", self.prompts[i], self.params, model=self.router.model_name)
            out = [d async for d in self.router.generate(req)]
            assert out[-1].finished and out[-1].finish_reason == "length", out[-1]
            self.outputs.append((i, [t for d in out for t in d.new_token_ids]))
            k += 1

    async def wait_for(self, n, timeout_s=60.0):
        """Until `n` requests have finished (a caller that failed fails this at once)."""
        end = time.monotonic() + timeout_s
        while len(self.outputs) < n:
            failed = [t for t in self.tasks if t.done()]
            if failed:
                await failed[0]  # (raises its error)
            assert time.monotonic() < end, f"{len(self.outputs)} of {n} requests within {timeout_s} s"
            await asyncio.sleep(0.02)

    async def stop(self):
        self.stopped = True
        await asyncio.gather(*self.tasks)  # (a failed request raises here)


def greedy_reference(model_dir, prompts, params, page_size: int) -> list[list[int]]:
    """Each prompt's tokens from one float32 engine.LLM alone: what every cluster path must reproduce."""
    from engine import LLM

    alone = LLM(model=str(model_dir), dtype="float32", num_pages=128, page_size=page_size)
    return [o.token_ids for o in alone.generate(prompts, params)]


MODEL_NAME = "tiny"  # the name the routers of the tiny cluster serve


@dataclasses.dataclass(frozen=True)
class TinyCluster:
    """The in-process cluster over the tiny Llama that the router, fault, heal, scale and prefix tests build
    (workers on `WorkerLoop` threads, KV over one fake transport): the workers' engine settings and the
    router's limits, each by name; a test changes one with `dataclasses.replace`. `prefill`, `decode` and
    `colocated` build one worker (a test may pass its own subclass); `router` the router over started pools."""
    model_dir: Path | str
    page_size: int = 4  # tokens a KV page holds: small, so every prompt spans several pages
    max_model_len: int = 128  # prompt + output tokens
    prefill_pages: int = 64  # KV pages of a prefill worker
    decode_pages: int = 96  # KV pages of a decode or colocated worker
    prefill_budget: int = 32  # tokens one prefill step takes (max_num_batched_tokens): longer prompts chunk
    kv_chunk_bytes: int = 1024  # bytes of KV a chunk carries: one layer of a prompt ships in several
    storage: str = "raw"  # KV storage format of every pool
    prefix_caching: bool = False
    max_queued_requests: int = 64
    request_timeout_s: float = 60.0
    drain_timeout_s: float = 0.1  # the router's long poll for a worker's events

    def engine_kwargs(self, num_pages: int, **kw) -> dict:
        return dict(model=str(self.model_dir), dtype="float32", page_size=self.page_size, num_pages=num_pages,
                    max_model_len=self.max_model_len, kv_storage=self.storage,
                    enable_prefix_caching=self.prefix_caching, **kw)

    def prefill(self, transport, cls=PrefillWorker):
        return cls(self.engine_kwargs(self.prefill_pages, max_num_batched_tokens=self.prefill_budget),
                   SenderConfig(chunk_bytes=self.kv_chunk_bytes), transport)

    def decode(self, transport, policy: str = "fail", cls=DecodeWorker):
        """`policy`: what the worker does when a transfer fails ("fail" or "recompute")."""
        return cls(self.engine_kwargs(self.decode_pages), ReceiverConfig(), transport, policy)

    def colocated(self, cls=DecodeWorker):
        return cls(self.engine_kwargs(self.decode_pages), serve_kv=False)

    def router_config(self, mode: str, **cfg) -> RouterConfig:
        """`cfg`: any other `RouterConfig` field (timeouts, recoveries, replicas, prefix routing)."""
        limits = dict(max_queued_requests=self.max_queued_requests, request_timeout_s=self.request_timeout_s,
                      drain_timeout_s=self.drain_timeout_s)
        prefill_tokens = self.prefill_pages * self.page_size if mode == "disaggregated" else None
        return RouterConfig(mode, MODEL_NAME, TINY["vocab_size"], self.max_model_len,
                            self.decode_pages * self.page_size, prefill_tokens, **{**limits, **cfg})

    def router(self, mode: str, pools: dict, spawner=None, clock=None, **cfg) -> ClusterRouter:
        """The router over `pools` ({pool: started worker handles}); `spawner` starts replacements and new
        replicas, `clock` replaces the monotonic clock (tests that move time)."""
        extra = {"spawner": spawner} if spawner is not None else {}
        if clock is not None:
            extra["clock"] = clock
        return ClusterRouter(self.router_config(mode, **cfg), pools, Tokenizer(self.model_dir), self.page_size,
                             **extra)


# A pool of the tiny Llama on the local Ray of 2 CPUs: half a CPU per actor (four actors fit), 64 pages of 8.
TINY_RAY_POOL = {"resources": {"num_cpus": 0.5}, "kv": {"page_size": 8, "num_pages": 64}, "max_model_len": 128}


def tiny_ray_spec(model_dir, mode: str = "disaggregated", pools: dict | None = None, **sections):
    """A spec serving the tiny Llama (float32) on Ray: each pool of `mode` is `TINY_RAY_POOL` updated by
    `pools[name]` (replicas, max_replicas); `sections`: other top-level spec sections (server, reliability)."""
    from cluster.spec import parse_spec

    names = ("prefill", "decode") if mode == "disaggregated" else ("colocated",)
    pools = {n: {**TINY_RAY_POOL, **(pools or {}).get(n, {})} for n in names}
    return parse_spec({"model": str(model_dir), "dtype": "float32", "mode": mode, "pools": pools, **sections})


# Every node's processes inherit these (set before the nodes start): loopback-only Ray and Ray token auth (the
# token file: RAY_AUTH_TOKEN_PATH, set by `ray_test_cluster`).
RAY_TEST_ENV = {"RAY_AUTH_MODE": "token", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
ADDRESS_FILE = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"  # Cluster() overwrites it


@contextlib.contextmanager
def ray_test_cluster(nodes: dict[str, dict], head_cpus: float = 1, env: dict[str, str] | None = None):
    """A multi-node Ray on this machine (`ray.cluster_utils.Cluster`): a head with `head_cpus` CPUs and no other
    resource, and a node per entry of `nodes` ({label: `Cluster.add_node` keyword arguments}), each its own
    raylet, all on 127.0.0.1 with Ray token auth on and one token file every node reads; `env` is set for
    every node too. Yields (cluster, {label: node id}). Shuts down only what it started (the driver first,
    then the cluster), then restores the environment and Ray's current-cluster file."""
    env = {**RAY_TEST_ENV, **(env or {})}
    saved_env = {k: os.environ.get(k) for k in (*env, "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")}
    saved_address = ADDRESS_FILE.read_text() if ADDRESS_FILE.is_file() else None
    temp = tempfile.mkdtemp(prefix="pdmn-")  # short: Ray's unix sockets live under it (108-byte cap)
    token = Path(temp) / "ray_token"  # mkdtemp: 0700
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    os.environ.update(env, RAY_AUTH_TOKEN_PATH=str(token))
    os.environ.pop("RAY_AUTH_TOKEN", None)
    try:
        import ray
        from ray.cluster_utils import Cluster

        from cluster.ray_session import reload_ray_auth

        assert not ray.is_initialized(), "another test left Ray connected"
        reload_ray_auth()  # this process may have cached another cluster's token
        where = {"node_ip_address": "127.0.0.1", "temp_dir": temp}
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": head_cpus, "include_dashboard": False,
                                                          **where})
        try:
            yield c, {label: c.add_node(**kw, **where).node_id for label, kw in nodes.items()}
        finally:
            ray.shutdown()  # (a router normally did); the driver must be gone before its node is removed
            c.shutdown()
    finally:
        shutil.rmtree(temp, ignore_errors=True)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if saved_address is not None:
            ADDRESS_FILE.write_text(saved_address)
