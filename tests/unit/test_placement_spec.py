"""A pool on a machine type (issue 26): `resources.accelerator_type` in the spec, what `pdserve validate` says
about it, the Ray resources it asks for (actor options, placement bundles) and `placement.shortfall`, which
judges a cluster's nodes (plain resource dicts here, as `ray.nodes()` reports them) before Ray is asked to
place anything. The Ray half runs in tests/integration/test_placement_ray_tiny.py."""
from __future__ import annotations

import pytest

from cluster import cli
from cluster.serving import actors, placement
from cluster.spec import SpecError, parse_spec


def spec(prefill: dict | None = None, decode: dict | None = None, **top):
    pools = {"prefill": {"resources": prefill or {}}, "decode": {"resources": decode or {}}}
    return parse_spec({"model": "smollm2-135m", "pools": pools, **top})


def problems(**kw) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as info:
        spec(**kw)
    return [(p.key, p.reason) for p in info.value.problems]


def test_a_pool_asks_for_its_type_as_ray_does():
    s = spec({"num_cpus": 0.5, "accelerator_type": "H100"}, {"num_cpus": 0.5, "accelerator_type": "A100-80G",
                                                             "custom": {"spot": 1}})
    pre, dec = s.pools.prefill, s.pools.decode
    # Ray's convention (`.options(accelerator_type=...)`): a token share of the node resource
    assert pre.resources.actor_options() == {"num_cpus": 0.5, "num_gpus": 0.0,
                                             "resources": {"accelerator_type:H100": 0.001}}
    assert actors.actor_options(dec, s)["resources"] == {"spot": 1.0, "accelerator_type:A100-80G": 0.001}
    assert placement.bundle(pre) == {"CPU": 0.5, "accelerator_type:H100": 0.001}
    assert "on H100" in pre.describe() and "on A100-80G" in dec.describe()
    assert spec().pools.decode.resources.accelerator_type is None
    assert "accelerator_type:" not in str(actors.actor_options(spec().pools.decode, spec()))


def test_every_rank_of_a_packed_replica_carries_the_type():
    s = parse_spec({"model": "smollm2-135m", "pools": {
        "prefill": {"tensor_parallel": 3, "resources": {"num_cpus": 0.5, "accelerator_type": "L40S"}},
        "decode": {"tensor_parallel": 3, "placement": "strict_pack",
                   "resources": {"num_cpus": 0.5, "accelerator_type": "L40S"}}}})
    pre, dec = s.pools.prefill, s.pools.decode
    assert placement.bundle(pre, pre.degree) == {"CPU": 1.5, "accelerator_type:L40S": 0.003}
    assert actors.actor_options(pre, s)["resources"] == {"accelerator_type:L40S": 0.003}
    assert actors.actor_options(dec, s)["resources"] == {"accelerator_type:L40S": 0.001}  # bundle 0 of its group


@pytest.mark.parametrize("name", ["", "H 100", "A100/80G", "-H100", "accelerator_type:H100", "x" * 65])
def test_a_bad_type_name_is_refused_naming_the_key(name):
    (key, reason), = problems(decode={"accelerator_type": name})
    assert key == "pools.decode.resources.accelerator_type" and "Ray's name" in reason, (key, reason)


def test_a_type_that_is_not_a_string_and_a_type_named_twice_are_refused():
    (key, reason), = problems(prefill={"accelerator_type": 100})
    assert key == "pools.prefill.resources.accelerator_type" and "string" in reason, reason
    (key, reason), = problems(prefill={"accelerator_type": "H100", "custom": {"accelerator_type:A100": 1}})
    assert key == "pools.prefill.resources.accelerator_type" and "name the type once" in reason, reason
    assert spec({"custom": {"accelerator_type:A100": 1}})  # Ray's raw resource alone: a custom resource


def test_the_placement_bound_is_a_reliability_key():
    assert spec().reliability.placement_timeout_s == 60.0
    assert spec(reliability={"placement_timeout_s": 2.5}).reliability.placement_timeout_s == 2.5
    (key, reason), = problems(reliability={"placement_timeout_s": 0})
    assert key == "reliability.placement_timeout_s" and "greater than 0" in reason


def test_validate_checks_the_type_offline(tmp_path, capsys):
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    pools = "pools: {prefill: {resources: {accelerator_type: H100}}, decode: {resources: {accelerator_type: %s}}}\n"
    good.write_text("model: smollm2-135m\n" + pools % "A100")
    bad.write_text("model: smollm2-135m\n" + pools % "'A100 40G'")
    assert cli.main(["validate", str(good), "--skip-model"]) == 0
    assert "on H100" in capsys.readouterr().out
    assert cli.main(["validate", str(bad), "--skip-model"]) == 2
    assert "pools.decode.resources.accelerator_type: 'A100 40G' is not an accelerator type" in capsys.readouterr().err


A100 = {"CPU": 1.0, "accelerator_type:A100": 1.0, "node:127.0.0.1": 1.0, "memory": 1e9}
H100 = {"CPU": 1.0, "accelerator_type:H100": 1.0, "node:127.0.0.1": 1.0}
HEAD = {"node:__internal_head__": 1.0, "object_store_memory": 1e8}


def test_nodes_of_the_type_fit_and_the_others_do_not():
    s = spec({"num_cpus": 0.5, "accelerator_type": "A100"}, {"num_cpus": 0.5, "accelerator_type": "H100"})
    assert placement.offered_types([HEAD, A100, H100]) == ["A100", "H100"]
    assert placement.shortfall("prefill", s.pools.prefill, [HEAD, A100, H100]) is None
    key, why = placement.shortfall("decode", s.pools.decode, [HEAD, A100])
    assert key == "pools.decode.resources.accelerator_type", key
    assert "'H100'" in why and "accelerator_type:H100" in why and "offer: A100" in why, why


def test_a_missing_type_names_what_the_nodes_offer_and_a_likely_typo():
    s = spec(decode={"accelerator_type": "h100"})
    key, why = placement.shortfall("decode", s.pools.decode, [HEAD, A100, H100])
    assert key == "pools.decode.resources.accelerator_type" and "did you mean 'H100'" in why, why
    _, why = placement.shortfall("decode", s.pools.decode, [HEAD])
    assert "offer: no accelerator type" in why, why


def test_other_shortfalls_name_their_own_key():
    s = spec({"custom": {"prefill": 1}}, {"num_gpus": 1, "accelerator_type": "H100"})
    key, why = placement.shortfall("prefill", s.pools.prefill, [A100])
    assert key == "pools.prefill.resources.custom.prefill" and "'prefill'" in why, why
    assert placement.shortfall("decode", s.pools.decode, [H100])[0] == "pools.decode.resources.num_gpus"
    big = spec(decode={"num_cpus": 2, "accelerator_type": "H100"})  # the type is there, the room is not
    key, why = placement.shortfall("decode", big.pools.decode, [H100, {"CPU": 4.0}])
    assert key == "pools.decode.resources" and "holds one replica" in why and "node:" not in why, why


def test_a_placement_error_is_a_503_naming_the_key():
    from cluster.serving_api import BackendUnavailableError

    err = placement.PlacementError("pools.decode.resources.accelerator_type", "no node offers 'H100'")
    assert isinstance(err, BackendUnavailableError) and err.key == "pools.decode.resources.accelerator_type"
    assert str(err).startswith("pools.decode.resources.accelerator_type: no node")


def test_serve_prints_a_placement_error_and_exits_1(tmp_path, monkeypatch, capsys):
    from cluster import launch
    from cluster.serving import ray_pools

    def unplaceable(spec):
        raise placement.PlacementError("pools.decode.resources.accelerator_type", "no node offers 'H100'")
    monkeypatch.setattr(ray_pools, "start_cluster", unplaceable)
    path = tmp_path / "spec.yaml"
    path.write_text("model: smollm2-135m\npools: {prefill: {}, decode: {resources: {accelerator_type: H100}}}\n")
    assert launch.serve(str(path)) == 1
    err = capsys.readouterr().err
    assert "cannot place the pools" in err and "pools.decode.resources.accelerator_type: no node" in err, err


def test_the_wait_ends_when_a_node_of_the_type_joins_or_fails_at_the_bound(monkeypatch, caplog):
    """`place_pool`'s first step with the cluster's nodes faked: an autoscaler's node joining on the third
    look ends the wait (one warning, at the first); a node that never joins ends it in `PlacementError`."""
    s = spec(decode={"num_cpus": 0.5, "accelerator_type": "H100"})
    looks = iter([[HEAD, A100], [HEAD, A100], [HEAD, A100, H100]])
    monkeypatch.setattr(placement, "POLL_S", 0.001)
    monkeypatch.setattr(placement, "alive_nodes", lambda: next(looks))
    placement._wait_for_a_node("decode", s.pools.decode, float("inf"), 60.0)
    assert next(looks, None) is None
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "pdserve.placement"]
    assert "waiting up to" in warning and "'H100'" in warning, warning
    monkeypatch.setattr(placement, "alive_nodes", lambda: [HEAD, A100])
    with pytest.raises(placement.PlacementError) as info:
        placement._wait_for_a_node("decode", s.pools.decode, 0.0, 2.0)
    assert info.value.key == "pools.decode.resources.accelerator_type"
    assert "placement_timeout_s, 2 s" in str(info.value) and "offer: A100" in str(info.value), info.value
