"""`start_cluster(spec)`: a spec -> a running `ClusterRouter` over Ray actors; `RayPools`: the pools' actors
on Ray -- placement, start, replacing a lost one, stopping them all (the router's `Spawner`).

Order: `ray_session.init_ray(address)` (a private local Ray on loopback with a per-cluster token, or join
an existing one) -> per pool its placement groups (`placement.place_pool`: `pool.placement` pack = one
group of `replicas` bundles, each every rank's `resources`; strict_pack = a STRICT_PACK group per replica, a
bundle per rank; on nodes offering the pool's `accelerator_type`; a pool Ray cannot place within
`reliability.placement_timeout_s` fails with a `PlacementError`) -> one `actors.WorkerActor` per replica
slot (each building its worker on its own `WorkerLoop` thread with the step watchdog's bound, `step_bound`) -> wait
until every worker is ready -> `actors.RayHandle`s -> `ClusterRouter` (`router_config`: the spec's
deadlines and `reliability`), which holds the `RayPools` as its spawner.
Healing (recovery.py): a lost worker's slot gets a fresh actor (`RayPools.replace`): the old actor is
killed for good (it may be hung: its resources go back to the slot's placement bundle), a new one starts
on the same bundle (placed again first if its node died: `placement.wait_placed`) with the same options,
and the router takes it once its `ready()` answers.
Resizing (scaling.py): `add` starts a replica in a new slot -- a bundle freed by an earlier removal, else
a placement group of its own (one replica's bundles; Ray must place it within `place_timeout_s`,
`reliability.placement_timeout_s`) -- and `remove` kills a drained replica's actor and frees its slot (its
own group removed, a start group's bundle kept for the next `add`).
`close()` (the router's shutdown, last) kills every actor, removes the placement groups and, if this
process started Ray, shuts Ray down: nothing is left in Ray.
Autoscaling (`attach_autoscaler`, when `autoscaling.enabled`): the router gets an `autoscaler.Autoscaler`
over the planner's model of the spec; on a multi-node Ray it asks `ray.autoscaler.sdk.request_resources`
for what its targets need.
The step watchdog's bound (`step_bound`): `reliability.step_timeout_s` when the spec sets it, else
`STEP_BOUND_FACTOR` x the slowest step the latency profile of the spec's model and dtype predicts for the
pool's limits (a prefill chunk of max_num_batched_tokens; a decode step of max_num_seqs sequences at
max_model_len; both for colocated), and never below `STEP_BOUND_FLOOR_S` (that floor alone without a
profile).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from cluster.ray_session import init_ray, shutdown_ray
from cluster.serving.actors import RayHandle, _actor, actor_options, kv_configs
from cluster.serving.autoscale_capacity import capacity_for_spec
from cluster.serving.autoscale_policy import Policy
from cluster.serving.autoscaler import Autoscaler, autoscale_config, resource_requester
from cluster.serving.placement import place_pool, wait_placed
from cluster.serving.router import ClusterRouter, RouterConfig
from cluster.serving_api import BackendUnavailableError

STEP_BOUND_FLOOR_S = 15.0  # a step of any worker may take this long before the watchdog calls it hung
STEP_BOUND_FACTOR = 30.0  # x the profile's slowest predicted step (a shared, oversubscribed CPU is slow)


def router_config(spec, config) -> RouterConfig:
    """The router's settings from the spec and the resolved model's `ModelConfig` (pure: no Ray)."""
    pools = spec.pools_in_use()
    serving = [p for n, p in pools.items() if n != "prefill"]
    max_len = min(min(p.max_model_len or config.max_position, config.max_position) for p in pools.values())
    prefill = pools.get("prefill")
    return RouterConfig(spec.mode, spec.model, config.vocab_size, max_len,
                        min(p.kv.num_pages * p.kv.page_size for p in serving),
                        prefill.kv.num_pages * prefill.kv.page_size if prefill is not None else None,
                        spec.server.max_queued_requests, spec.server.request_timeout_s,
                        **spec.reliability.router_options(), **spec.routing.router_options(),
                        max_replicas={n: p.max_replicas or max(p.replicas, 8) for n, p in pools.items()})


def step_bound(spec, name: str, max_position: int, profiles: list | None = None) -> float:
    """The step watchdog's bound for pool `name`, seconds (module map). `profiles`: candidate latency
    profiles (default: every one under deploy/profiles/)."""
    if spec.reliability.step_timeout_s is not None:
        return spec.reliability.step_timeout_s
    pool = spec.pools_in_use()[name]
    coeffs = _coeffs(spec, profiles)
    if coeffs is None:
        return STEP_BOUND_FLOOR_S
    seqs, tokens = pool.max_num_seqs, pool.max_num_batched_tokens
    context = seqs * min(pool.max_model_len or max_position, max_position)
    pa, pb, pc = coeffs.prefill
    da, db, dc = coeffs.decode
    prefill, decode = pa + pb * tokens + pc * tokens * tokens, da + db * context + dc * seqs
    worst = {"prefill": prefill, "decode": decode}.get(name, prefill + decode)
    return max(STEP_BOUND_FLOOR_S, STEP_BOUND_FACTOR * worst)


def _coeffs(spec, profiles):
    """TP-1 fitted coefficients of a profile of the spec's model and dtype, or None."""
    from cluster.planner.errors import BadConfigError
    from cluster.planner.inputs.paths import deploy_dir
    from cluster.planner.latency.profiles import load_profile

    if profiles is None:
        profiles = []
        for path in sorted((deploy_dir() / "profiles").glob("*.json")):
            try:
                profiles.append(load_profile(str(path), serving=False))
            except BadConfigError:
                continue
    for p in profiles:
        if p.model == spec.model and p.dtype == spec.dtype and 1 in p.coeffs:
            return p.coeffs[1]
    return None


@dataclass
class _Slot:
    name: str  # the worker's name, kept by every actor the slot gets
    actor: Any
    bundle: tuple | None  # (placement group, bundle index), or None: unplaced
    group: Any = None  # a placement group of its own (a slot added by a resize), removed with the slot


class RayPools:
    """Every pool's actors on Ray, slot by slot (module map)."""

    def __init__(self, spec, kv: dict, num_threads: int, ready_timeout_s: float, max_position: int,
                 owns_ray: bool = False):
        self.spec, self.kv, self.num_threads, self.ready_timeout_s = spec, kv, num_threads, ready_timeout_s
        self.max_position, self.owns_ray = max_position, owns_ray
        self.slots: dict[str, list[_Slot]] = {}
        self.groups: list = []  # the pools' placement groups from the start
        self.free: dict[str, list[tuple]] = {}  # pool -> bundles of those groups whose replica was removed
        self.place_timeout_s = spec.reliability.placement_timeout_s  # a pool Ray cannot place fails this soon

    def start_pool(self, name: str, pool) -> list[Any]:
        """Place `pool` and start an actor per replica (not yet ready); the actors."""
        groups, bundles = place_pool(name, pool, self.place_timeout_s)
        self.groups += groups
        slots = self.slots.setdefault(name, [])
        for i, bundle in enumerate(bundles):
            slots.append(_Slot(f"{name}-{i}", self._actor(name, f"{name}-{i}", bundle), bundle))
        return [s.actor for s in slots]

    def _actor(self, name: str, worker: str, bundle):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pool = self.spec.pools_in_use()[name]
        engine = self.spec.engine_config(name)
        if pool.resources.num_gpus > 0:
            engine = engine.with_options(device="cuda")  # TP/PP ranks: cuda:rank of the GPUs the actor sees
        opts = actor_options(pool, self.spec)
        if bundle is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(*bundle)  # (group, bundle index)
        bound = step_bound(self.spec, name, self.max_position)
        return _actor().options(**opts).remote(name, worker, engine, self.kv, self.num_threads, bound)

    def handles(self) -> dict[str, list[RayHandle]]:
        """Wait until every actor is ready; their handles, by pool."""
        import ray

        infos = {name: ray.get([s.actor.ready.remote(self.ready_timeout_s) for s in slots],
                               timeout=self.ready_timeout_s) for name, slots in self.slots.items()}
        return {name: [RayHandle(s.name, s.actor, infos[name][i]) for i, s in enumerate(slots)]
                for name, slots in self.slots.items()}

    async def replace(self, pool: str, old: RayHandle) -> RayHandle:
        """Kill `old`'s actor for good and start a fresh one on its slot's bundle; its handle once ready."""
        import ray

        slot = next((s for s in self.slots.get(pool, []) if s.name == old.name), None)
        if slot is None:
            raise BackendUnavailableError(f"pools.{pool}: no slot named {old.name!r}")
        ray.kill(slot.actor, no_restart=True)  # (it may be hung; its bundle's resources come back)
        if slot.bundle is not None:  # (its node may be gone: Ray re-places the bundle, on the same type)
            await asyncio.to_thread(wait_placed, pool, self.spec.pools_in_use()[pool], slot.bundle[0],
                                    self.place_timeout_s)
        slot.actor = self._actor(pool, slot.name, slot.bundle)
        try:
            info = await asyncio.wait_for(slot.actor.ready.remote(self.ready_timeout_s), self.ready_timeout_s + 5)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
            raise BackendUnavailableError(f"worker {slot.name}: its replacement did not start: "
                                          f"{type(e).__name__}: {e}") from None
        return RayHandle(slot.name, slot.actor, info)

    async def add(self, pool: str) -> RayHandle:
        """A new slot in `pool` (a free bundle of its start, else a placement group of its own) and a ready
        actor there; on failure nothing of it is left (the actor killed, its group removed)."""
        import ray

        taken = [int(s.name.rsplit("-", 1)[1]) for s in self.slots.get(pool, [])]
        slot = _Slot(f"{pool}-{max(taken, default=-1) + 1}", None, None)
        if self.free.get(pool):
            slot.bundle = self.free[pool].pop()
        else:
            one = self.spec.pools_in_use()[pool].model_copy(update={"replicas": 1})
            groups, bundles = await asyncio.to_thread(place_pool, pool, one, self.place_timeout_s)
            slot.group, slot.bundle = (groups[0] if groups else None), bundles[0]
        slot.actor = self._actor(pool, slot.name, slot.bundle)
        self.slots.setdefault(pool, []).append(slot)
        try:
            info = await asyncio.wait_for(slot.actor.ready.remote(self.ready_timeout_s), self.ready_timeout_s + 5)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
            self._drop(pool, slot)
            raise BackendUnavailableError(f"worker {slot.name} did not start: {type(e).__name__}: {e}") from None
        return RayHandle(slot.name, slot.actor, info)

    async def remove(self, pool: str, handle: RayHandle) -> None:
        slot = next((s for s in self.slots.get(pool, []) if s.name == handle.name), None)
        if slot is not None:
            await asyncio.to_thread(self._drop, pool, slot)

    def _drop(self, pool: str, slot: _Slot) -> None:
        """Kill the slot's actor and free the slot: its own group removed, a start group's bundle kept."""
        import ray

        ray.kill(slot.actor, no_restart=True)
        self.slots[pool].remove(slot)
        if slot.group is not None:
            ray.util.remove_placement_group(slot.group)
        elif slot.bundle is not None:
            self.free.setdefault(pool, []).append(slot.bundle)

    async def close(self) -> None:
        await asyncio.to_thread(self.close_sync)

    def close_sync(self) -> None:
        """Kill every actor, remove the placement groups, shut down the Ray this process started."""
        import ray

        for slots in self.slots.values():
            for s in slots:
                ray.kill(s.actor)  # a TP/PP actor's rank processes see their socket close and exit
        for g in self.groups + [s.group for slots in self.slots.values() for s in slots if s.group is not None]:
            ray.util.remove_placement_group(g)
        self.slots, self.groups, self.free = {}, [], {}
        if self.owns_ray:
            shutdown_ray()  # (the token file goes with it)


def start_cluster(spec, num_cpus: float | None = None, num_threads: int = 1,
                  ready_timeout_s: float = 600.0, transport: Any = "grpc", capacity: Any = None) -> ClusterRouter:
    """Start (or join) Ray, place every pool, wait until each worker is ready, return the router.
    `transport`: a name in `kv_transfer.contract.TRANSPORTS`, or (fault tests) a transport object that
    pickles to plain data, such as `kv_transfer.fault_transport.FaultyTransport`. `capacity`: the autoscaler's
    `CapacityModel` (tests); None: the planner's, when `autoscaling.enabled`."""
    from cluster.spec import resolve_model_config
    from engine.loader import resolve_model
    from engine.tokenizer import Tokenizer

    config = resolve_model_config(spec)
    spec.check_against_model(config)
    pools = spec.pools_in_use()  # TP/PP degrees and what they cannot run with: check_against_model above
    owns_ray = init_ray(spec.ray.address, num_cpus)
    kv = {**(kv_configs(spec) if spec.mode == "disaggregated" else {}), "transport": transport}
    ray_pools = RayPools(spec, kv, num_threads, ready_timeout_s, config.max_position, owns_ray)
    try:
        for name, pool in pools.items():
            ray_pools.start_pool(name, pool)
        handles = ray_pools.handles()
    except BaseException:
        ray_pools.close_sync()
        raise
    serving = [p for n, p in pools.items() if n != "prefill"]
    tokenizer = Tokenizer(resolve_model(spec.model, spec.revision))
    router = ClusterRouter(router_config(spec, config), handles, tokenizer, serving[0].kv.page_size, spawner=ray_pools)
    attach_autoscaler(router, spec, capacity)
    return router


def attach_autoscaler(router: ClusterRouter, spec, capacity: Any = None) -> None:
    """With `autoscaling.enabled`, the router gets its `Autoscaler` (autoscaler.py): the planner's capacity
    model of the spec, the router's resize path, and on a multi-node Ray `ray.autoscaler.sdk`."""
    if not spec.autoscaling.enabled:
        return
    from ray.autoscaler import sdk

    cfg = autoscale_config(spec)
    router.requests.keep_s = max(router.requests.keep_s, cfg.window_s)
    policy = Policy(cfg, capacity if capacity is not None else capacity_for_spec(spec))
    router.autoscaler = Autoscaler(cfg, policy, router.requests, router.scale,
                                   lambda: {p: m.target for p, m in router.pools.items()}, time.monotonic,
                                   resource_requester(spec, sdk), lambda: unsettled(router))


def unsettled(router: ClusterRouter) -> frozenset:
    """Pools whose members are not yet all live and taking work at their target (a resize under way)."""
    return frozenset(p for p, m in router.pools.items()
                     if len(m.placeable_or_empty()) != m.target or len(m.live()) != m.target)
