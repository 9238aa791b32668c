"""Acceptance: a multi-node Ray cluster on one machine (`ray.cluster_utils.Cluster`: a head with no pool
resources, a node carrying `{prefill: 1}` and one carrying `{decode: 1}`, each its own raylet, all on
127.0.0.1, Ray token auth on with one token file that every node reads, as docs/security.md asks
of a multi-node cluster). A spec shaped like deploy/multinode.yaml (custom resources per pool, a KV auth
token from the environment of every node; loopback, so no TLS) joins it by its GCS address, with the
cluster's token from the environment. Checked:
- each actor runs on the node that carries its pool's custom resource, prefill and decode on different nodes;
- 4 concurrent SmolLM2 (float32) requests are greedy-equal to one `engine.LLM`. Their KV must cross nodes
  over gRPC: failure policy "fail" (no recompute fallback), so a decode token exists only if the prefill
  node's KV arrived; no transfer failed;
- the workers end with nothing held (leak check); the router shuts down the Ray connection, the test
  shuts down the cluster it started and restores the environment;
- a driver without the token is refused by the cluster (init_ray raises a typed error naming the variables).
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from cluster.ray_session import init_ray
from cluster.serving.ray_pools import start_cluster
from cluster.serving_api import BackendUnavailableError
from cluster.spec import parse_spec
from engine import LLM, SamplingParams
from tests.cluster_helpers import assert_cluster_empty, collect, ray_test_cluster
from tests.exactness import assert_greedy_equal
from tests.prompts import token_prompts

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
LENGTHS = [24, 57, 90, 123]
TOKEN_ENV = "PDSERVE_KV_TOKEN"  # the KV plane's shared token, as deploy/multinode.yaml reads it on each node


@pytest.fixture(scope="module")
def cluster():
    """(Cluster, {pool: id of the node carrying its resource}); the head carries neither."""
    with ray_test_cluster({pool: {"num_cpus": 1, "resources": {pool: 1}} for pool in ("prefill", "decode")},
                          env={TOKEN_ENV: "multinode-test-token"}) as c:
        yield c


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    alone = LLM(model=MODEL, dtype="float32", page_size=16, num_pages=64, keep_logits=True)
    prompts = token_prompts(alone.tokenizer, LENGTHS)
    outs = alone.generate(prompts, PARAMS)
    return prompts, [o.token_ids for o in outs], [torch.stack(o.logits) for o in outs]


def multinode_spec(address: str):
    def pool(kind: str) -> dict:
        return {"replicas": 1, "resources": {"num_cpus": 1, "custom": {kind: 1}}, "max_num_seqs": 8,
                "kv": {"page_size": 16, "num_pages": 64}, "max_model_len": 512}

    return parse_spec({"model": MODEL, "dtype": "float32", "mode": "disaggregated",
                       "pools": {"prefill": pool("prefill"), "decode": pool("decode")},
                       "kv_transfer": {"host": "127.0.0.1", "auth_token": {"env": TOKEN_ENV},
                                       "failure_policy": "fail"},
                       "server": {"request_timeout_s": 300.0}, "ray": {"address": address}})


def test_pools_on_their_nodes_and_kv_crosses_nodes(cluster, reference):
    import ray

    c, nodes = cluster
    prompts, ref, logits = reference
    router = start_cluster(multinode_spec(c.address))

    async def main():
        try:
            carriers = {pool: [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(pool)]
                        for pool in ("prefill", "decode")}
            assert carriers == {pool: [node_id] for pool, node_id in nodes.items()}, carriers
            placed = {pool: [w.handle.info["node_id"] for w in ws] for pool, ws in router.workers.items()}
            assert placed == carriers and nodes["prefill"] != nodes["decode"], (placed, carriers)
            assert router.workers["decode"][0].handle.info["address"].startswith("127.0.0.1:")
            results = await asyncio.gather(*(collect(router, f"mn-{i}", p, PARAMS, MODEL)
                                             for i, p in enumerate(prompts)))
            assert_greedy_equal(ref, [toks for toks, _ in results], logits)
            stats = await assert_cluster_empty(router)
            assert stats["decode-0"].num_transfer_failures == 0, stats["decode-0"]
            assert stats["decode-0"].num_steps > 0 and stats["prefill-0"].num_steps > 0, stats
        finally:
            await router.shutdown()
    asyncio.run(main())
    assert not ray.is_initialized(), "the router joined Ray by address: its shutdown disconnects"


def test_a_driver_without_the_token_is_refused(cluster, monkeypatch):
    c, _ = cluster
    monkeypatch.setenv("RAY_AUTH_TOKEN", "not-the-cluster-token")  # takes precedence over the token file
    # a refused driver retries its GCS connection once a second, 20 times by default: once says the same
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "1")
    with pytest.raises(BackendUnavailableError, match="RAY_AUTH_TOKEN_PATH"):
        init_ray(c.address)
    import ray

    assert not ray.is_initialized()
