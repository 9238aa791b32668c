"""YAML for prefix caching and prefix-aware routing: `pools.<name>.kv.prefix_caching` (default off) reaches
the engine as `enable_prefix_caching`; combinations that cannot work yet are `SpecError`s naming the key;
`routing` reaches `RouterConfig` (prefix_routing default None = on where the workers cache)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.serving.ray_pools import router_config
from cluster.spec import SpecError, parse_spec

EVICT = {"method": "streaming", "budget": 12}


def spec(**over):
    data = {"model": "smollm2-135m", "pools": {"prefill": {}, "decode": {}}}
    data.update(over)
    return parse_spec(data)


def test_prefix_caching_is_off_by_default_and_reaches_the_engine_per_pool():
    assert "enable_prefix_caching" not in spec().engine_kwargs("prefill")
    s = spec(pools={"prefill": {"kv": {"prefix_caching": True}}, "decode": {"kv": {"prefix_caching": True}}})
    assert s.engine_kwargs("prefill")["enable_prefix_caching"] is True
    assert s.engine_kwargs("decode")["enable_prefix_caching"] is True
    s = spec(pools={"prefill": {"kv": {"prefix_caching": True}}, "decode": {}})  # one side only is fine
    assert "enable_prefix_caching" not in s.engine_kwargs("decode")
    col = parse_spec({"model": "m", "mode": "colocated", "pools": {"colocated": {"kv": {"prefix_caching": True}}}})
    assert col.engine_kwargs("colocated")["enable_prefix_caching"] is True


@pytest.mark.parametrize("data,key", [
    ({"pools": {"prefill": {"kv": {"prefix_caching": True, "eviction": EVICT}}, "decode": {}}},
     "pools.prefill.kv.prefix_caching"),
    ({"pools": {"prefill": {"kv": {"eviction": EVICT}}, "decode": {"kv": {"prefix_caching": True}}}},
     "pools.decode.kv.prefix_caching"),
    ({"routing": {"prefix_aware": True}}, "routing.prefix_aware"),
    ({"pools": {"prefill": {"kv": {"prefix_caching": "yes"}}, "decode": {}}}, "pools.prefill.kv.prefix_caching"),
    ({"routing": {"cache_weight": -1.0}}, "routing.cache_weight"),
    ({"routing": {"prefix": True}}, "routing.prefix"),
])
def test_what_cannot_work_yet_is_a_spec_error_naming_the_key(data, key):
    with pytest.raises(SpecError) as e:
        spec(**data)
    assert key in str(e.value), str(e.value)


def test_routing_reaches_the_router_config():
    cfg = SimpleNamespace(vocab_size=100, max_position=2048)  # what router_config reads of a ModelConfig
    r = router_config(spec(), cfg)
    assert (r.prefix_routing, r.prefix_cache_weight, r.decode_load_tokens, r.prefix_refresh_s) == (None, 1.0, 64.0, 5.0)
    s = spec(pools={"prefill": {"kv": {"prefix_caching": True}}, "decode": {}},
             routing={"prefix_aware": False, "cache_weight": 2.0, "decode_load_tokens": 8.0, "refresh_s": 0.0})
    r = router_config(s, cfg)
    assert (r.prefix_routing, r.prefix_cache_weight, r.decode_load_tokens, r.prefix_refresh_s) == (False, 2.0, 8.0, 0.0)
