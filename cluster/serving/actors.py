"""Ray actors for the workers (`WorkerActor`) and their handles (`RayHandle`). With `ray_pools.py`
(placement, `start_cluster`, replacing a lost actor), the only modules of the serving path that import ray
(starting Ray: `cluster/ray_session.py`); neither is imported by the router (`ray_pools` imports it).

Order: `init_ray(address)` (cluster/ray_session.py: a private local Ray on loopback with a per-cluster
token, or join an existing one) -> placement groups per pool (`ray_pools.py`) -> one `WorkerActor` per
replica, each building its worker on its own `WorkerLoop` thread (one torch thread unless `num_threads`
says otherwise; the step watchdog's bound from `ray_pools.step_bound`; a tensor/pipeline-parallel engine
starts its rank processes as the actor's children, engine/parallel/launcher.py, which exit with it) ->
`RayHandle`s (the router's async handle interface) -> `ClusterRouter`.
Restarts: Ray restarts a dead actor `reliability.actor_max_restarts` times (`actor_options`), but never
retries a call on the new incarnation (max_task_retries 0): a retried `drain` would hide the death from the
router, which must see it to recover the requests the old incarnation held. The router takes a restarted
actor back as a new worker record (`RayHandle.reincarnation`: the restarted actor's `ready()`, whose info
carries a fresh random `incarnation`); the lost record stays dead (recovery.py, "Healing"). Without
restarts (the default) the router's `RayPools` starts a fresh actor in the lost one's slot.
Test hooks on `WorkerActor`, called by fault tests on the actor handle and never by the router, a spec or
HTTP: `slow_steps(delay_s)` (a slow worker), `hang_steps()` (every later step blocks: a hung worker, for
the step watchdog) and `rss_bytes()` (memory under repeated faults).

Deltas flow back by long polling: the router keeps one `drain(timeout_s)` call outstanding per actor; the
actor (a threaded actor: Ray runs its methods on a small thread pool) answers as soon as its step loop
published events, with the latest stats. One round trip per step and no router actor to keep alive.
Typed errors cross the actor boundary as (class, attributes, message) and are rebuilt on the router side:
pdserve errors have constructors Ray's exception pickling cannot call, and only pdserve error classes are
ever rebuilt.
"""
from __future__ import annotations

import asyncio
import gc
import importlib
import os
import threading
import time
import uuid
from typing import Any

from cluster.serving.worker_loop import DECODE_METHODS, PREFILL_METHODS, WorkerLoop
from cluster.serving_api import BackendUnavailableError
from engine.engine_config import EngineConfig
from engine.errors import PdserveError


class WorkerActor:
    """One prefill, decode or colocated worker in its own process (wrapped by `ray.remote` in `_actor`)."""

    def __init__(self, kind: str, name: str, engine: EngineConfig, kv: dict, num_threads: int = 1,
                 step_timeout_s: float | None = None):
        import torch

        torch.set_num_threads(num_threads)  # one process per worker, one thread each (2-core machines)
        engine = EngineConfig.of(engine).with_options(num_threads=num_threads)
        methods = PREFILL_METHODS if kind == "prefill" else DECODE_METHODS
        incarnation = uuid.uuid4().hex  # new on every (re)start: the router tells a restarted actor apart
        self.step_delay_s = 0.0  # fault tests only (`slow_steps`); a restarted incarnation starts at 0
        self.step_gate = threading.Event()  # fault tests only (`hang_steps`): steps wait while it is clear
        self.step_gate.set()
        self.loop = WorkerLoop(lambda: self._delayable(_build(kind, engine, kv)), methods, name,
                               lambda worker: {**_info(worker), "incarnation": incarnation}, step_timeout_s)

    def ready(self, timeout_s: float) -> dict:
        return self.loop.wait_ready(timeout_s)

    # Test hooks, called from test code on the actor handle: the router never calls them (its commands go
    # through `call` and the worker's allow-list) and neither a spec nor HTTP can reach them.
    def slow_steps(self, delay_s: float) -> None:
        """Every later step of the worker first sleeps `delay_s` (a slow or overloaded machine; 0 = off)."""
        self.step_delay_s = float(delay_s)

    def hang_steps(self) -> None:
        """Every later step of the worker blocks for good (a hung kernel): only the step watchdog sees it."""
        self.step_gate.clear()

    def rss_bytes(self) -> int:
        """This actor process's resident memory after a full collection (memory under repeated faults)."""
        gc.collect()
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _delayable(self, worker):
        step = worker.step

        def delayed_step():
            self.step_gate.wait()
            if self.step_delay_s > 0:
                time.sleep(self.step_delay_s)
            return step()
        worker.step = delayed_step  # (on the instance: the worker classes stay untouched)
        return worker

    def call(self, method: str, *args) -> tuple[str, Any]:
        try:
            return "ok", self.loop.call(method, *args)
        except PdserveError as e:
            return "error", (type(e).__module__, type(e).__qualname__, _plain(vars(e)), str(e))

    def drain(self, timeout_s: float):
        return self.loop.drain(timeout_s)

    def stop(self) -> None:
        self.loop.stop()


def _build(kind: str, engine: EngineConfig, kv: dict):
    if kind == "prefill":
        from prefill_worker.worker import PrefillWorker

        return PrefillWorker(engine, kv.get("sender"), kv.get("transport", "grpc"))
    from decode_worker.worker import DecodeWorker

    return DecodeWorker(engine, kv.get("receiver"), kv.get("transport", "grpc"),
                        kv.get("failure_policy", "fail"), serve_kv=kind == "decode")


def _info(worker) -> dict:
    """What `ready()` returns: the worker's KV receiver address (decode) and the Ray node it landed on."""
    import ray

    address = getattr(worker, "address", None)
    if address and address.startswith(("0.0.0.0:", "[::]:")):  # listening on every interface: say which
        address = f"{ray.util.get_node_ip_address()}:{address.rsplit(':', 1)[1]}"
    runner = getattr(getattr(worker, "llm", None), "runner", None)
    return {"address": address, "node_id": ray.get_runtime_context().get_node_id(),
            "prefix": getattr(worker, "prefix_info", None),  # prefix caching: the router's page naming
            "rank_pids": list(getattr(runner, "pids", []))}  # TP/PP: the engine's rank processes


def _plain(attrs: dict) -> dict:
    return {k: v for k, v in attrs.items() if isinstance(v, (str, int, float, bool, type(None)))}


def _rebuild(module: str, qualname: str, attrs: dict, message: str) -> PdserveError:
    cls = getattr(importlib.import_module(module), qualname, None)
    if not (isinstance(cls, type) and issubclass(cls, PdserveError)):
        return BackendUnavailableError(f"{qualname}: {message}")
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(attrs)
    return err


_ACTOR = None


def _actor():
    global _ACTOR
    if _ACTOR is None:
        import ray

        _ACTOR = ray.remote(max_concurrency=16)(WorkerActor)  # threads: drain blocks while calls run
    return _ACTOR


class RayHandle:
    """A `WorkerActor` behind the router's async handle interface."""

    def __init__(self, name: str, actor, info: dict):
        self.name, self.actor, self.info = name, actor, info

    async def call(self, method: str, *args) -> Any:
        status, value = await self._ray(self.actor.call.remote(method, *args))
        if status == "error":
            raise _rebuild(*value)
        return value

    async def drain(self, timeout_s: float):
        return await self._ray(self.actor.drain.remote(timeout_s))

    async def reincarnation(self, timeout_s: float = 600.0) -> "RayHandle":
        """After this actor was lost: a handle carrying the info of the incarnation that answers `ready()`.
        This one call is retried through the restart (measured on Ray 2.60: a plain call to a restarting
        actor raises ActorUnavailableError, one with task retries waits for the new incarnation); an actor
        out of restarts raises ActorDiedError at once -> BackendUnavailableError (dead for good)."""
        import ray

        ready = self.actor.ready.options(max_task_retries=-1)
        while True:
            try:
                return RayHandle(self.name, self.actor, await ready.remote(timeout_s))
            except ray.exceptions.ActorUnavailableError:
                await asyncio.sleep(0.5)
            except ray.exceptions.RayError as e:
                raise BackendUnavailableError(f"worker {self.name} is gone: {type(e).__name__}") from None

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self._ray(self.actor.stop.remote()), 60)
        except (PdserveError, asyncio.TimeoutError):
            pass

    async def _ray(self, ref):
        import ray

        try:
            return await ref
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, PdserveError):
                raise cause from None
            raise BackendUnavailableError(f"worker {self.name}: {type(cause or e).__name__}: {cause or e}") from None
        except ray.exceptions.RayError as e:  # actor died, node lost
            raise BackendUnavailableError(f"worker {self.name} is gone: {type(e).__name__}") from None


# ---- the cluster -------------------------------------------------------------------------------
def kv_configs(spec) -> dict:
    """Sender/receiver settings of the KV plane from the spec's `kv_transfer` section."""
    from kv_transfer.config import ReceiverConfig, SenderConfig, TLSConfig

    kt = spec.kv_transfer
    auth = {}
    if kt.auth_token is not None:
        auth = {"token_env": kt.auth_token.env} if kt.auth_token.env else {"token_file": kt.auth_token.file}
    tls = TLSConfig(kt.tls.cert_file, kt.tls.key_file, kt.tls.ca_file, kt.tls.server_name) if kt.tls else None
    return {"sender": SenderConfig(tls=tls, call_timeout_s=kt.push_timeout_s, **auth),
            "receiver": ReceiverConfig(host=kt.host, tls=tls, **auth), "failure_policy": kt.failure_policy}


def actor_options(pool, spec) -> dict[str, Any]:
    """`WorkerActor.options(...)` for one replica of `pool`: its resources and the spec's restart policy.
    `resources` are per rank: under pack the actor holds every rank's (its children compute with them,
    and a GPU actor must see all their GPUs); under strict_pack one rank's, bundle 0 of its group."""
    n = pool.degree if pool.placement == "pack" else 1
    opts = pool.resources.actor_options()
    opts = {"num_cpus": opts["num_cpus"] * n, "num_gpus": opts["num_gpus"] * n,
            "resources": {k: v * n for k, v in opts["resources"].items()}}
    return {**opts, **spec.reliability.actor_options()}
