"""Where a pool's replicas go on Ray: their bundles, their placement groups and the bounded wait for both.
Called by `ray_pools.RayPools` (start, scale-up, replacement); imports ray lazily, as the room's other
Ray modules do.

    bundle(pool, ranks)          Ray resources of `ranks` ranks of one replica: CPU, GPU, `custom` and the
                                 share of `accelerator_type:<T>` a pool naming a type asks for (spec_sections)
    place_pool(name, pool, s)    (groups, per replica its (group, bundle index) or None: unplaced), in order:
      1. until the deadline (now + s, `reliability.placement_timeout_s`): some alive node must be able to
         hold one replica's bundle. What none offers -- the accelerator type, a custom resource, GPUs, room
         -- is logged at once (an autoscaler may be booting such a node) and, past the deadline, raised:
         `PlacementError` naming the spec key, the type, and the types the cluster's nodes do offer
      2. the placement groups (pack: one SPREAD group, a bundle of every rank's resources per replica;
         strict_pack: a STRICT_PACK group per replica, a bundle per rank), ready within what is left of
         the deadline, else removed again and `PlacementError` (nothing of the pool is left in Ray)
    wait_placed(name, pool, group, s)  a slot's group is placed (again: Ray re-places the bundles of a dead
                                 node on nodes that offer the same resources, so on the same type) within
                                 s, else `PlacementError`; a replacement's actor starts only then
A bundle carries the accelerator type's resource, so every actor placed in it -- the first, a replacement
on the same bundle, a scale-up's in a group of its own -- runs on a node of that type.
"""
from __future__ import annotations

import difflib
import logging
import time

from cluster.serving_api import BackendUnavailableError
from cluster.spec_sections import ACCELERATOR_PREFIX

log = logging.getLogger("pdserve.placement")
POLL_S = 0.25  # how often the cluster's nodes are read while waiting for one that fits


class PlacementError(BackendUnavailableError):
    """Ray cannot place a pool's replicas within the placement bound; `key` is the spec key to change
    (e.g. pools.decode.resources.accelerator_type)."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


def bundle(pool, ranks: int = 1) -> dict[str, float]:
    """Ray resources of `ranks` ranks of one replica (`resources` are per rank)."""
    r = pool.resources
    b = {"CPU": r.num_cpus, "GPU": r.num_gpus, **r.ray_custom()}
    return {k: float(v) * ranks for k, v in b.items() if v > 0}


def _replica_bundle(pool) -> dict[str, float]:
    """What one node must hold for one replica: every rank (pack), or one rank (strict_pack's bundles)."""
    return bundle(pool, 1 if pool.placement == "strict_pack" else pool.degree)


def alive_nodes() -> list[dict[str, float]]:
    """The total resources of each alive node of the Ray this process is connected to."""
    import ray

    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


def offered_types(nodes: list[dict[str, float]]) -> list[str]:
    """Accelerator types the nodes offer (their `accelerator_type:<T>` resources), sorted."""
    return sorted({k.removeprefix(ACCELERATOR_PREFIX) for n in nodes for k in n if k.startswith(ACCELERATOR_PREFIX)})


def shortfall(name: str, pool, nodes: list[dict[str, float]]) -> tuple[str, str] | None:
    """(spec key, why) when no node in `nodes` can hold one replica of `pool`; None when one can."""
    need = _replica_bundle(pool)
    if not need or any(all(n.get(k, 0.0) >= v for k, v in need.items()) for n in nodes):
        return None
    r, at = pool.resources, f"pools.{name}.resources"
    if r.accelerator_type and not any(n.get(ACCELERATOR_PREFIX + r.accelerator_type) for n in nodes):
        types = offered_types(nodes)
        close = difflib.get_close_matches(r.accelerator_type, types, n=1, cutoff=0.5) + \
            [t for t in types if t.lower() == r.accelerator_type.lower()]
        hint = f"; did you mean {close[-1]!r}?" if close else ""
        return (f"{at}.accelerator_type", f"no node of the Ray cluster offers accelerator type "
                f"{r.accelerator_type!r} (node resource {ACCELERATOR_PREFIX}{r.accelerator_type}); its nodes "
                f"offer: {', '.join(types) or 'no accelerator type'}{hint}")
    for k in r.custom:
        if not any(n.get(k) for n in nodes):
            return (f"{at}.custom.{k}", f"no node of the Ray cluster offers the resource {k!r} "
                                        f"(`ray start --resources` on the nodes meant for pool {name})")
    if r.num_gpus and not any(n.get("GPU") for n in nodes):
        return (f"{at}.num_gpus", "no node of the Ray cluster has a GPU")
    return (at, f"no node of the Ray cluster holds one replica ({need}, placement {pool.placement}); "
                f"its nodes have {[_own(n) for n in nodes]}")


def _own(node: dict[str, float]) -> dict[str, float]:
    """A node's resources worth showing (not Ray's memory figures or its per-node `node:<ip>` label)."""
    return {k: v for k, v in node.items() if not k.startswith("node:") and "memory" not in k}


def _wait_for_a_node(name: str, pool, deadline: float, timeout_s: float) -> None:
    """Step 1 of `place_pool` (module map)."""
    warned = False
    while (short := shortfall(name, pool, alive_nodes())) is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PlacementError(short[0], f"{short[1]} (waited reliability.placement_timeout_s, {timeout_s:g} s, "
                                           f"for one to join)")
        if not warned:
            log.warning("%s: %s; waiting up to %.0f s for such a node (reliability.placement_timeout_s)",
                        *short, left)
            warned = True
        time.sleep(min(POLL_S, left))


def place_pool(name: str, pool, timeout_s: float) -> tuple[list, list]:
    """The pool's placement groups and per replica the (group, bundle index) its actor goes to (module map)."""
    import ray
    from ray.util.placement_group import placement_group

    deadline = time.monotonic() + timeout_s
    if _replica_bundle(pool):  # (none: nothing to ask a Ray cluster)
        _wait_for_a_node(name, pool, deadline, timeout_s)
    if pool.placement == "strict_pack" and pool.degree > 1:
        one = bundle(pool)
        groups = [placement_group([one] * pool.degree, strategy="STRICT_PACK")
                  for _ in range(pool.replicas)] if one else []
        slots = [(g, 0) for g in groups]
    else:
        one = bundle(pool, pool.degree)
        groups = [placement_group([one] * pool.replicas, strategy="SPREAD")] if one else []
        slots = [(groups[0], i) for i in range(pool.replicas)] if groups else []
    try:
        if groups:  # (none: nothing to ask a Ray cluster)
            ray.get([g.ready() for g in groups], timeout=max(deadline - time.monotonic(), 0.1))
    except ray.exceptions.GetTimeoutError:
        for g in groups:
            ray.util.remove_placement_group(g)
        raise PlacementError(f"pools.{name}", f"Ray cannot place {pool.replicas} replica(s) of {pool.degree} "
                                              f"rank(s) x {bundle(pool)} ({pool.placement}) within reliability."
                                              f"placement_timeout_s ({timeout_s:g} s); free: "
                                              f"{_own(ray.available_resources())}") from None
    return groups, slots or [None] * pool.replicas


def wait_placed(name: str, pool, group, timeout_s: float) -> None:
    """Step of a replacement (module map): `group` placed within `timeout_s`, else `PlacementError`."""
    from ray.util import placement_group_table

    deadline = time.monotonic() + timeout_s
    while (state := placement_group_table(group).get("state")) != "CREATED":
        if time.monotonic() >= deadline:
            short = shortfall(name, pool, alive_nodes())
            key, why = short or (f"pools.{name}", f"its placement group is {state}")
            raise PlacementError(key, f"{why}: the replacement's bundle was not placed again within "
                                      f"reliability.placement_timeout_s ({timeout_s:g} s)")
        time.sleep(POLL_S)
