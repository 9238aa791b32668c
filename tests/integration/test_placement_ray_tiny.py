"""Acceptance (issue 26, placement): pools on machine types. A multi-node Ray on this machine
(`tests.cluster_helpers.ray_test_cluster`: a head with no CPU, one node labelled as an H100 machine and one as
an A100 machine, by the node resource Ray gives a node of that accelerator type, `accelerator_type:<T>`) serves
a heterogeneous disaggregated spec as `pdserve plan` writes it (spec_writer), in Splitwise's HA shape -- prompts on
H100, tokens on A100 -- with a tiny
random Llama (marker `faults`: a real Ray cluster). Checked:
- each pool's actors run on the node of its type, and stay there: a scale-up's new decode replica and the
  replacement of a killed decode actor land on the A100 node too;
- concurrent requests before and after are greedy-equal to one float32 `engine.LLM`;
- a spec naming a type no node offers fails with `PlacementError` naming the key, the type and the types
  the nodes offer, once `reliability.placement_timeout_s` has passed -- not a hang (the test's own limit is
  a generous multiple of the bound, a hang detector, not a timing assertion) -- leaving nothing behind;
- `pdserve validate --ray-address` names the same key against the running cluster's nodes;
- leak checks: the workers hold nothing at the end; after each router is gone, every CPU and accelerator
  share is free again in Ray and no placement group is left.
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from cluster import cli
from cluster.planner.inputs.hardware import load_hardware
from cluster.ray_session import init_ray, shutdown_ray
from cluster.serving.placement import PlacementError
from cluster.serving.ray_pools import start_cluster
from cluster.spec import parse_spec
from engine import SamplingParams
from tests.cluster_helpers import assert_cluster_empty, collect, greedy_reference, ray_test_cluster
from tests.exactness import assert_greedy_equal
from tests.prompts import COUNT, MIXED, SHORT

pytestmark = pytest.mark.faults
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [MIXED, SHORT, COUNT[:30]]
TYPES = {"prefill": load_hardware("h100-80g-sxm").accelerator_type,  # Splitwise-HA: "H100" and "A100"
         "decode": load_hardware("a100-80g").accelerator_type}
BOUND_S = 2.0  # reliability.placement_timeout_s of the specs here


@pytest.fixture(scope="module")
def cluster():
    """(Cluster, {accelerator type: id of the node offering it}); the head offers no CPU and no type, so
    every actor must go to a typed node. Each node has room for two replicas of 0.5 CPU."""
    nodes = {t: {"num_cpus": 1, "resources": {f"accelerator_type:{t}": 1}} for t in TYPES.values()}
    with ray_test_cluster(nodes, head_cpus=0) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return greedy_reference(tiny_dir, PROMPTS, GREEDY, page_size=8)


def hetero_spec(model_dir, address: str, types: dict[str, str]):
    """What `pdserve plan` writes for a heterogeneous design (`spec_writer.plan_spec`: each pool's
    `accelerator_type` is its phase's hardware type), made servable on this CPU machine: the tiny model,
    half a CPU and no GPU per rank, small KV pages; this cluster's address and a short placement bound."""
    from cluster.planner.emit.spec_writer import plan_spec
    from cluster.planner.latency.base import Parallel
    from cluster.planner.search.plans import PhaseChoice, Plan

    choices = (PhaseChoice("prefill", Parallel(1, 1), 512, 4096, 8, 40.0),
               PhaseChoice("decode", Parallel(1, 1), 0, 4096, 8, 90.0))
    plan = Plan("disaggregated", "independent", tuple((c, 1) for c in choices), 2, 1e9)
    data = plan_spec(plan, str(model_dir), "float32", nodes=1, cpu=False, max_len=128, ttft_ms=250, tpot_ms=100,
                     accelerators=types)
    for name, pool in data["pools"].items():
        assert pool["resources"]["accelerator_type"] == types[name]  # the planner wrote each pool's type
        pool.update(max_replicas=2, kv={"page_size": 8, "num_pages": 64},
                    resources={**pool["resources"], "num_cpus": 0.5, "num_gpus": 0})
    data.update(kv_transfer={"failure_policy": "fail"},  # a decode token only from KV that arrived
                reliability={"placement_timeout_s": BOUND_S}, ray={"address": address})
    return parse_spec(data)


def _nothing_left(address: str) -> None:
    """Every CPU and accelerator share is free again and no placement group is left (a driver of its own)."""
    import ray

    init_ray(address)
    try:
        end = time.monotonic() + 30
        while True:
            total, free = ray.cluster_resources(), ray.available_resources()
            held = {k: v - free.get(k, 0.0) for k, v in total.items()
                    if (k == "CPU" or k.startswith("accelerator_type:")) and free.get(k, 0.0) < v - 1e-9}
            groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
            if not held and not groups:
                return
            assert time.monotonic() < end, f"left in Ray: resources held {held}; placement groups {groups}"
            time.sleep(0.2)
    finally:
        shutdown_ray()


def _groups_on_their_types(node_of: dict[str, str]) -> int:
    """Every bundle of every live placement group asks for one accelerator type and sits on the node
    offering it (what keeps a replica there, whichever node Ray would have picked otherwise); how many groups."""
    import ray

    groups = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
    for g in groups:
        for i, res in g["bundles"].items():
            (kind,) = [k.removeprefix("accelerator_type:") for k in res if k.startswith("accelerator_type:")]
            assert g["bundles_to_node_id"][i] == node_of[kind], (g, node_of)
    return len(groups)


async def _until(cond, what, timeout_s=60.0):
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.05)


async def _greedy(router, reference, tag):
    outs = await asyncio.gather(*(collect(router, f"{tag}-{i}", p, GREEDY, router.model_name)
                                  for i, p in enumerate(PROMPTS)))
    assert_greedy_equal(reference, [toks for toks, _ in outs])


def test_each_pool_runs_on_its_type_through_scale_up_and_replacement(cluster, tiny_dir, reference):
    import ray

    c, node_of = cluster
    router = start_cluster(hetero_spec(tiny_dir, c.address, TYPES))

    def placed():
        return {pool: sorted(w.handle.info["node_id"] for w in ws if w.alive) for pool, ws in router.workers.items()}

    async def main():
        try:
            assert placed() == {"prefill": [node_of["H100"]], "decode": [node_of["A100"]]}, (placed(), node_of)
            assert _groups_on_their_types(node_of) == 2  # one per pool
            await _greedy(router, reference, "start")
            assert (await router.scale("decode", 2))["added"] == ["decode-1"]  # a placement group of its own
            assert placed()["decode"] == [node_of["A100"]] * 2, (placed(), node_of)
            assert _groups_on_their_types(node_of) == 3
            old = router.workers["decode"][0]
            ray.kill(old.handle.actor, no_restart=True)
            await _until(lambda: router.ledger.workers_replaced == 1, "the killed decode actor is replaced")
            fresh = next(w for w in router.workers["decode"] if w.name == old.name and w.alive)
            assert fresh.handle.actor is not old.handle.actor and fresh.handle.info["node_id"] == node_of["A100"]
            await _until(lambda: router.health()["status"] == "ok", "healthy again")
            assert _groups_on_their_types(node_of) == 3  # (the replacement reuses its slot's bundle)
            await _greedy(router, reference, "healed")
            await assert_cluster_empty(router, timeout_s=30)
            stats = await router.worker_stats()
            assert all(s.num_transfer_failures == 0 for n, s in stats.items() if n.startswith("decode")), stats
            led = router.ledger
            assert led.balanced(0) and (led.completed, led.failed) == (2 * len(PROMPTS), 0), led
        finally:
            await router.shutdown()
    asyncio.run(main())
    assert not ray.is_initialized()
    _nothing_left(c.address)


def test_a_type_no_node_offers_fails_within_the_bound_and_leaves_nothing(cluster, tiny_dir):
    import ray

    c, _ = cluster
    spec = hetero_spec(tiny_dir, c.address, {"prefill": "H100", "decode": "L40S"})  # prefill placed first
    outcome: list = []

    def start():
        try:
            outcome.append(start_cluster(spec))
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            outcome.append(e)
    runner = threading.Thread(target=start, daemon=True)
    runner.start()
    runner.join(timeout=BOUND_S + 120)  # a hang detector only: start_cluster returns or raises long before
    assert not runner.is_alive(), "start_cluster hangs on a type no node offers"
    (err,) = outcome
    assert isinstance(err, PlacementError), err
    assert err.key == "pools.decode.resources.accelerator_type", err
    assert "'L40S'" in str(err) and "offer: A100, H100" in str(err) and "placement_timeout_s" in str(err), err
    assert not ray.is_initialized(), "a failed start disconnects the Ray it joined"
    _nothing_left(c.address)


def test_validate_with_a_ray_address_checks_the_types_against_the_nodes(cluster, tiny_dir, tmp_path, capsys):
    import ray
    import yaml

    c, _ = cluster
    codes = {}
    for types in (TYPES, {"prefill": "H100", "decode": "h100"}):
        spec = hetero_spec(tiny_dir, c.address, types).model_dump(mode="json", exclude_defaults=True)
        path = tmp_path / f"{types['decode']}.yaml"
        path.write_text(yaml.safe_dump(spec))
        codes[types["decode"]] = cli.main(["validate", str(path), "--skip-model", "--ray-address", c.address])
    out = capsys.readouterr()
    assert codes == {"A100": 0, "h100": 2}, (codes, out)
    assert "pools.decode.resources.accelerator_type: no node of the Ray cluster offers accelerator type 'h100'" \
        in out.err and "did you mean 'H100'" in out.err, out.err
    assert not ray.is_initialized()
