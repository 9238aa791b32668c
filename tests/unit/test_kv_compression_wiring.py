"""KV compression wired end to end: the YAML `kv.storage` / `kv.eviction` of a pool -> engine kwargs (and
the checks: one storage format across the pools, eviction only where prompts are prefilled), and the
per-request `pdserve.kv_eviction` option -> SamplingParams (typed 400s for bad values)."""
from __future__ import annotations

import pytest

from cluster.http.openai_schema import parse_request, sampling_params
from cluster.spec import SpecError, parse_spec
from engine import InvalidRequestError


def _spec(prefill: dict, decode: dict | None = None, mode: str = "disaggregated") -> dict:
    if mode == "colocated":
        return {"model": "smollm2-135m", "mode": mode, "pools": {"colocated": prefill}}
    return {"model": "smollm2-135m", "pools": {"prefill": prefill, "decode": decode or {}}}


def test_pool_kv_sections_become_engine_kwargs():
    kv = {"storage": "int8", "eviction": {"method": "streaming", "budget": 512, "sinks": 8}}
    s = parse_spec(_spec({"kv": kv}, {"kv": {"storage": "int8"}}))
    pre, dec = s.engine_kwargs("prefill"), s.engine_kwargs("decode")
    assert pre["kv_storage"] == dec["kv_storage"] == "int8" and "kv_eviction" not in dec
    assert pre["kv_eviction"] == {"method": "streaming", "budget": 512.0, "min_prompt": 256, "window": 32,
                                  "pool": 7, "sinks": 8, "slack": 16}
    co = parse_spec(_spec({"kv": {"eviction": {}}}, mode="colocated")).engine_kwargs("colocated")
    assert co["kv_eviction"]["method"] == "snapkv" and co["kv_storage"] == "raw"



def test_a_pool_becomes_a_frozen_engine_config():
    """What a worker is built from: one `EngineConfig` per pool (Ray pickles it to the actor), the same
    settings as the pool's keywords; a dict with a name the config lacks is a TypeError naming it."""
    import pickle

    from engine import EngineConfig

    s = parse_spec(_spec({"kv": {"storage": "int8"}, "max_num_seqs": 7}, {"kv": {"storage": "int8"}}))
    cfg = s.engine_config("prefill")
    assert isinstance(cfg, EngineConfig) and cfg == EngineConfig(**s.engine_kwargs("prefill"))
    assert cfg.kv_storage == "int8" and cfg.max_num_seqs == 7 and pickle.loads(pickle.dumps(cfg)) == cfg
    assert EngineConfig.of(cfg) is cfg and EngineConfig.of({"max_num_seqs": 7}).max_num_seqs == 7
    with pytest.raises(TypeError, match="max_seqs"):
        EngineConfig.of({"max_seqs": 7})


@pytest.mark.parametrize("prefill, decode, key", [
    ({"kv": {"storage": "int8"}}, {}, "pools.decode.kv.storage"),
    ({"kv": {"storage": "int4"}}, {}, "pools.prefill.kv.storage"),
    ({}, {"kv": {"eviction": {}}}, "pools.decode.kv.eviction"),
    ({"kv": {"eviction": {"pool": 4}}}, {}, "pools.prefill.kv.eviction.pool"),
    ({"kv": {"eviction": {"budget": 0}}}, {}, "pools.prefill.kv.eviction.budget"),
    ({"kv": {"eviction": {"method": "h3o"}}}, {}, "pools.prefill.kv.eviction.method"),
])
def test_bad_kv_sections_name_the_key(prefill, decode, key):
    with pytest.raises(SpecError) as info:
        parse_spec(_spec(prefill, decode))
    assert key in [p.key for p in info.value.problems], info.value


def test_request_option_reaches_sampling_params():
    def params(option):
        body = {"model": "m", "prompt": "hi", "pdserve": {"kv_eviction": option}}
        return sampling_params(parse_request(body, "completion"), 0, 16)
    assert params("off").kv_eviction == "off"
    assert params({"budget": 0.5, "method": "snapkv"}).kv_eviction == {"budget": 0.5, "method": "snapkv"}
    assert sampling_params(parse_request({"model": "m", "prompt": "hi"}, "completion"), 0, 16).kv_eviction is None
    for bad in ("on", {"budget": 0}, {"method": "h3o"}, {"windw": 3}):
        with pytest.raises(InvalidRequestError, match="pdserve.kv_eviction"):
            params(bad)
