"""The spec's reliability knobs (issue 8): `reliability` (heartbeat and call timeouts, max_recoveries, Ray
actor restarts) and `kv_transfer.push_timeout_s` -- each bad value a row naming the key, and the wiring
from the spec to where each knob acts: `RouterConfig` (`ray_pools.router_config`), the Ray actor options
(`actors.actor_options`, and `RayPools.start_pool` with a fake actor class, which also gets the step
watchdog's bound: `ray_pools.step_bound`, from the spec or the latency profile), the KV sender's push deadline
(`actors.kv_configs`), and a router built from that config declaring a silent worker dead at the spec's
bound on an injected clock. No Ray cluster, no model: fakes only."""
from __future__ import annotations

import asyncio
import dataclasses
import types
from pathlib import Path

import pytest

from cluster.serving import actors, ray_pools
from cluster.serving.router import ClusterRouter
from cluster.spec import SpecError, load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[2]
BASE = {"model": "m", "pools": {"prefill": {}, "decode": {"replicas": 2}}}
MODEL = types.SimpleNamespace(vocab_size=100, max_position=2048)  # what router_config reads of ModelConfig


def spec(**sections):
    return parse_spec({**BASE, **sections})


# ---- validation: every row a SpecError naming the key and why ----------------------------------------
BAD = {  # name: (sections, key the error names, words of the reason)
    "heartbeat below 1 s": ({"reliability": {"heartbeat_timeout_s": 0.5}}, "reliability.heartbeat_timeout_s",
                            "greater than or equal to 1"),
    "heartbeat negative": ({"reliability": {"heartbeat_timeout_s": -3.0}}, "reliability.heartbeat_timeout_s",
                           "greater than or equal to 1"),
    "heartbeat over an hour": ({"reliability": {"heartbeat_timeout_s": 4000.0}},
                               "reliability.heartbeat_timeout_s", "less than or equal to 3600"),
    "heartbeat a string": ({"reliability": {"heartbeat_timeout_s": "30"}}, "reliability.heartbeat_timeout_s",
                           "expected a number (got a string)"),
    "heartbeat not below the request deadline": (
        {"reliability": {"heartbeat_timeout_s": 60.0}, "server": {"request_timeout_s": 60.0}},
        "reliability.heartbeat_timeout_s", "must be below server.request_timeout_s"),
    "call timeout zero": ({"reliability": {"call_timeout_s": 0.0}}, "reliability.call_timeout_s", "greater than 0"),
    "call timeout not below the request deadline": (
        {"reliability": {"call_timeout_s": 200.0}}, "reliability.call_timeout_s", "below server.request_timeout_s"),
    "max_recoveries negative": ({"reliability": {"max_recoveries": -1}}, "reliability.max_recoveries",
                                "greater than or equal to 0"),
    "max_recoveries absurd": ({"reliability": {"max_recoveries": 1000}}, "reliability.max_recoveries",
                              "less than or equal to 16"),
    "max_recoveries a float": ({"reliability": {"max_recoveries": 1.5}}, "reliability.max_recoveries",
                               "expected an integer"),
    "actor restarts negative (Ray's forever)": ({"reliability": {"actor_max_restarts": -1}},
                                                "reliability.actor_max_restarts", "greater than or equal to 0"),
    "actor restarts absurd": ({"reliability": {"actor_max_restarts": 101}}, "reliability.actor_max_restarts",
                              "less than or equal to 100"),
    "task retries are not a knob": ({"reliability": {"max_task_retries": 3}}, "reliability.max_task_retries",
                                    "unknown key"),
    "misspelt key": ({"reliability": {"heartbeat_timeout": 5.0}}, "reliability.heartbeat_timeout",
                     "did you mean 'heartbeat_timeout_s'"),
    "reliability a list": ({"reliability": [1, 2]}, "reliability", "expected a mapping"),
    "push timeout zero": ({"kv_transfer": {"push_timeout_s": 0.0}}, "kv_transfer.push_timeout_s", "greater than 0"),
    "push timeout absurd": ({"kv_transfer": {"push_timeout_s": 1e9}}, "kv_transfer.push_timeout_s",
                            "less than or equal to 3600"),
    "request deadline zero": ({"server": {"request_timeout_s": 0.0}}, "server.request_timeout_s", "greater than 0"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_reliability_value_names_the_key(name):
    sections, key, words = BAD[name]
    with pytest.raises(SpecError) as err:
        spec(**sections)
    assert any(p.key == key and words in p.reason for p in err.value.problems), str(err.value)


def test_defaults_blank_section_and_yaml(tmp_path):
    rel = spec().reliability
    assert (rel.heartbeat_timeout_s, rel.call_timeout_s, rel.max_recoveries, rel.actor_max_restarts) == (30.0, 30.0,
                                                                                                       2, 0)
    assert spec(reliability=None).reliability == rel  # `reliability:` alone means its defaults
    path = tmp_path / "s.yaml"
    path.write_text("model: m\npools: {prefill: {}, decode: {}}\nserver: {request_timeout_s: 20.0}\n"
                    "reliability:\n  heartbeat_timeout_s: 5.0\n  call_timeout_s: 2.5\n  max_recoveries: 0\n"
                    "  actor_max_restarts: 3\nkv_transfer: {push_timeout_s: 15.0}\n")
    s = load_spec(path)
    assert (s.reliability.heartbeat_timeout_s, s.reliability.max_recoveries, s.kv_transfer.push_timeout_s) == (5.0, 0,
                                                                                                               15.0)


# ---- wiring: the spec's values reach where they act ----------------------------------------------------
TUNED = {"reliability": {"heartbeat_timeout_s": 4.0, "call_timeout_s": 1.5, "max_recoveries": 5,
                         "actor_max_restarts": 2},
         "server": {"request_timeout_s": 9.0, "max_queued_requests": 7}, "kv_transfer": {"push_timeout_s": 11.0}}


def test_router_config_carries_deadlines_and_recovery_limits():
    cfg = ray_pools.router_config(spec(**TUNED), MODEL)
    assert (cfg.heartbeat_timeout_s, cfg.call_timeout_s, cfg.max_recoveries) == (4.0, 1.5, 5)
    assert cfg.rejoin_restarted  # actor_max_restarts 2: the router takes restarted actors back
    assert (cfg.request_timeout_s, cfg.max_queued_requests, cfg.vocab_size, cfg.mode) == (9.0, 7, 100,
                                                                                          "disaggregated")
    default = ray_pools.router_config(spec(), MODEL)
    assert (default.heartbeat_timeout_s, default.call_timeout_s, default.max_recoveries) == (30.0, 30.0, 2)
    assert not default.rejoin_restarted
    assert default.replace_lost and (default.replace_backoff_s, default.replace_backoff_max_s) == (1.0, 60.0)
    off = ray_pools.router_config(spec(reliability={"replace_lost_workers": False, "replace_backoff_s": 3.0,
                                                    "replace_backoff_max_s": 2.0}), MODEL)
    assert not off.replace_lost and (off.replace_backoff_s, off.replace_backoff_max_s) == (3.0, 3.0)
    assert default.max_replicas == {"prefill": 8, "decode": 8}  # a resize's bound: max(replicas, 8)
    sized = ray_pools.router_config(spec(pools={"prefill": {}, "decode": {"replicas": 2, "max_replicas": 3}}), MODEL)
    assert sized.max_replicas == {"prefill": 8, "decode": 3}


def test_kv_sender_push_deadline_comes_from_the_spec():
    assert actors.kv_configs(spec(**TUNED))["sender"].call_timeout_s == 11.0
    assert actors.kv_configs(spec())["sender"].call_timeout_s == 120.0


def test_actor_options_restart_the_actor_but_never_retry_its_calls():
    s = spec(**TUNED)
    opts = actors.actor_options(s.pools.decode, s)
    assert opts["max_restarts"] == 2 and opts["max_task_retries"] == 0 and opts["num_cpus"] == 1.0
    assert actors.actor_options(spec().pools.decode, spec())["max_restarts"] == 0


class _FakeActorClass:
    """Stands in for `ray.remote(WorkerActor)`: records the options each actor is created with."""

    def __init__(self):
        self.created = []

    def options(self, **opts):
        return types.SimpleNamespace(remote=lambda *args: self.created.append((opts, args)) or len(self.created))


def test_start_pool_creates_each_actor_with_the_restart_policy_and_the_step_bound(monkeypatch):
    fake = _FakeActorClass()
    monkeypatch.setattr(ray_pools, "_actor", lambda: fake)
    no_bundle = {"resources": {"num_cpus": 0.0}}  # no placement group: nothing asks a Ray cluster
    tuned = {**TUNED, "reliability": {**TUNED["reliability"], "step_timeout_s": 7.5}}
    s = spec(pools={"prefill": no_bundle, "decode": {**no_bundle, "replicas": 2}}, **tuned)
    pools = ray_pools.RayPools(s, {}, 1, 1.0, 2048)
    assert pools.start_pool("decode", s.pools.decode) == [1, 2] and pools.groups == [] and len(fake.created) == 2
    assert [slot.name for slot in pools.slots["decode"]] == ["decode-0", "decode-1"]
    for opts, args in fake.created:
        assert opts["max_restarts"] == 2 and opts["max_task_retries"] == 0 and args[0] == "decode"
        assert args[-1] == 7.5  # the step watchdog's bound, as the spec sets it


def test_the_step_bound_comes_from_the_latency_profile_of_the_model_else_a_floor():
    from cluster.planner.latency.base import Coeffs

    prof = types.SimpleNamespace(model="m", dtype="bfloat16", coeffs={1: Coeffs((0.05, 2e-4, 0.0), (0.06, 1e-4, 1e-4))})
    s = spec(pools={"prefill": {"max_num_batched_tokens": 512}, "decode": {"max_num_seqs": 32, "max_model_len": 1024}})
    prefill = ray_pools.step_bound(s, "prefill", 2048, [prof])
    decode = ray_pools.step_bound(s, "decode", 2048, [prof])
    assert prefill == ray_pools.STEP_BOUND_FLOOR_S  # 30 x (0.05 + 0.1024) s is below the floor
    assert decode == pytest.approx(ray_pools.STEP_BOUND_FACTOR * (0.06 + 1e-4 * 32 * 1024 + 1e-4 * 32))
    other = types.SimpleNamespace(model="another", dtype="bfloat16", coeffs=prof.coeffs)
    assert ray_pools.step_bound(s, "decode", 2048, [other]) == ray_pools.STEP_BOUND_FLOOR_S  # no profile of m
    fixed = spec(reliability={"step_timeout_s": 2.0})
    assert ray_pools.step_bound(fixed, "decode", 2048, [prof]) == 2.0


class _Handle:
    """A worker handle whose event long-poll either returns every `drain` call or hangs forever."""

    def __init__(self, name: str, hang: bool):
        self.name, self.info, self.hang, self.closed = name, {"address": f"{name}:1"}, hang, False

    async def call(self, method, *args):
        return None

    async def drain(self, timeout_s):
        if self.hang:
            await asyncio.Event().wait()
        await asyncio.sleep(timeout_s)
        return [], None

    async def close(self):
        self.closed = True


def test_router_from_the_spec_declares_a_silent_worker_dead_at_the_spec_bound():
    cfg = dataclasses.replace(ray_pools.router_config(spec(**TUNED), MODEL), drain_timeout_s=0.01)
    now = [0.0]
    pools = {"prefill": [_Handle("prefill-0", False)],
             "decode": [_Handle("decode-0", True), _Handle("decode-1", False)]}

    async def main():
        router = ClusterRouter(cfg, pools, tokenizer=None, page_size=16, clock=lambda: now[0])
        try:
            router._ensure_started()
            await asyncio.sleep(0.05)  # every poller has started (and stamped its worker at clock 0)
            now[0] = cfg.heartbeat_timeout_s - 0.5  # silent, but not yet past the bound
            await asyncio.sleep(0.3)
            assert all(w.alive for ws in router.workers.values() for w in ws) and router.ledger.workers_lost == 0
            now[0] = cfg.heartbeat_timeout_s + 0.01  # past it: the hung one (last seen at 0) is dead
            await asyncio.sleep(0.3)
            hung, healthy = router.workers["decode"]
            assert not hung.alive and hung.handle.closed and healthy.alive and router.workers["prefill"][0].alive
            assert router.ledger.workers_lost == 1 and router.ledger.balanced(0)
        finally:
            await router.shutdown()

    asyncio.run(main())


def test_the_default_specs_heal_and_derive_their_step_bound_from_the_shipped_profile():
    for path in ("deploy/local.yaml", "deploy/local-2d.yaml", "deploy/colocated.yaml"):
        s = load_spec(ROOT / path)
        cfg = ray_pools.router_config(s, types.SimpleNamespace(vocab_size=49152, max_position=8192))
        assert cfg.replace_lost and s.reliability.step_timeout_s is None, path  # no extra keys needed
        for name in s.pools_in_use():
            bound = ray_pools.step_bound(s, name, 8192)
            assert ray_pools.STEP_BOUND_FLOOR_S <= bound <= 600, (path, name, bound)
    decode = ray_pools.step_bound(load_spec(ROOT / "deploy/local.yaml"), "decode", 8192)
    assert decode > ray_pools.STEP_BOUND_FLOOR_S  # 32 sequences at 4096 tokens: above the floor on this profile
