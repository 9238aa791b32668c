"""The YAML cluster spec (`cluster.spec`) and `pdserve validate`.

Every example in deploy/ loads and fits SmolLM2 (9 heads, 3 KV heads, 30 layers, 8192 positions: a
literal `ModelConfig`, so the table stays fast; one slow test pins it to the real config). A table of
malformed or inconsistent specs asserts that the dotted key and the reason both appear in the message.
The CLI is driven through `cluster.cli.main`.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from cluster import cli
from cluster import spec_model
from cluster.spec import ClusterSpec, SpecError, load_spec, parse_spec, resolve_model_config
from engine.config import ModelConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
EXAMPLES = ("local.yaml", "local-2d.yaml", "colocated.yaml", "multinode.yaml", "local-2p2d.yaml", "local-2p2d-prefix.yaml")
SMOLLM2 = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, max_position=8192,
                      tie_word_embeddings=True, qkv_bias=False)
MINIMAL = "model: smollm2-135m\npools: {prefill: {replicas: 1}, decode: {replicas: 1}}\n"


def write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def spec_error(tmp_path: Path, text: str) -> SpecError:
    """The SpecError of a file, from loading or from the model check `validate` runs next."""
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, text)).check_against_model(SMOLLM2)
    return info.value


# ---- the examples ------------------------------------------------------------------------------
def test_deploy_holds_the_examples():
    data = {"hardware.yaml"}  # the planner's hardware table: data beside the specs, not a spec
    assert sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name not in data) == sorted(EXAMPLES)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_loads_and_fits_smollm2(name):
    spec = load_spec(DEPLOY / name)
    spec.check_against_model(SMOLLM2)
    assert spec.model == "smollm2-135m" and spec.dtype == "bfloat16"
    for pool in spec.pools_in_use():
        assert pool in spec.summary()


def test_prefix_example_differs_from_its_baseline_only_in_prefix_caching():
    base, pfx = load_spec(DEPLOY / "local-2p2d.yaml"), load_spec(DEPLOY / "local-2p2d-prefix.yaml")
    assert all(p.kv.prefix_caching for p in pfx.pools_in_use().values()) and pfx.routing.prefix_aware
    assert not any(p.kv.prefix_caching for p in base.pools_in_use().values())
    for name in ("prefill", "decode"):
        a, b = base.engine_kwargs(name), pfx.engine_kwargs(name)
        assert {k: v for k, v in b.items() if k != "enable_prefix_caching"} == \
            {k: v for k, v in a.items() if k != "enable_prefix_caching"}


def test_examples_say_what_the_issue_asks():
    local, two_d = load_spec(DEPLOY / "local.yaml"), load_spec(DEPLOY / "local-2d.yaml")
    colocated, multi = load_spec(DEPLOY / "colocated.yaml"), load_spec(DEPLOY / "multinode.yaml")
    assert {n: p.replicas for n, p in local.pools_in_use().items()} == {"prefill": 1, "decode": 1}
    assert {n: p.replicas for n, p in two_d.pools_in_use().items()} == {"prefill": 1, "decode": 2}
    # the 2-core machine: the replicas of each local example ask for at most 2 CPUs in all
    for spec in (local, two_d, colocated):
        assert sum(p.replicas * p.resources.num_cpus for p in spec.pools_in_use().values()) <= 2
        assert spec.ray.address == "local" and spec.server.host == "127.0.0.1"
    assert colocated.mode == "colocated" and colocated.pools.colocated.replicas == 2
    assert multi.ray.address == "auto"
    assert multi.pools.prefill.resources.custom == {"prefill": 1}
    assert multi.pools.decode.resources.actor_options() == {"num_cpus": 1, "num_gpus": 0, "resources": {"decode": 1}}
    assert multi.kv_transfer.auth_token.env == "PDSERVE_KV_TOKEN" and multi.kv_transfer.tls.mutual
    assert multi.server.api_key.env == "PDSERVE_API_KEY"


def test_defaults_fit_a_laptop_and_models_are_frozen():
    spec = parse_spec({"model": "smollm2-135m", "pools": {"prefill": {}, "decode": {}}})
    pool = spec.pools.decode
    assert (spec.dtype, spec.mode, spec.ray.address) == ("bfloat16", "disaggregated", "local")
    assert (spec.server.host, spec.server.port, spec.kv_transfer.failure_policy) == ("127.0.0.1", 8000, "fail")
    assert (pool.replicas, pool.tensor_parallel, pool.pipeline_parallel, pool.resources.num_cpus) == (1, 1, 1, 1)
    assert spec.engine_kwargs("decode") == {"model": "smollm2-135m", "dtype": "bfloat16", "page_size": 16,
                                            "num_pages": 1024, "max_num_seqs": 32, "max_num_batched_tokens": 512,
                                            "max_model_len": None, "kv_storage": "raw"}
    with pytest.raises(ValidationError):
        pool.replicas = 3


def test_a_blank_section_means_its_defaults(tmp_path):
    spec = load_spec(write(tmp_path, "model: smollm2-135m\npools:\n  prefill:\n  decode:\n    kv:\nserver:\n"))
    assert spec.pools.prefill.replicas == 1 and spec.pools.decode.kv.num_pages == 1024
    assert spec.server.port == 8000 and spec.server.api_key is None


def test_constructing_in_code_runs_the_same_cross_checks():
    with pytest.raises(ValidationError, match="required in disaggregated mode"):
        ClusterSpec(model="smollm2-135m")


# ---- malformed and inconsistent specs ----------------------------------------------------------
BAD = {
    "unknown key, suggestion": ("model: smollm2-135m\npools: {prefill: {replica: 1}, decode: {}}\n",
                                "pools.prefill.replica", "unknown key 'replica' (did you mean 'replicas'?)"),
    "key at the wrong level": (MINIMAL + "replicas: 2\n", "replicas", "belongs under 'pools.prefill'"),
    "unknown key, no close match": (MINIMAL + "zzz: 1\n", "zzz", "allowed keys here: model, revision, dtype"),
    "wrong type": ("model: smollm2-135m\npools: {prefill: {}, decode: {max_num_seqs: two}}\n",
                   "pools.decode.max_num_seqs", "expected an integer (got a string)"),
    "section not a mapping": ("model: smollm2-135m\npools: [prefill, decode]\n", "pools",
                              "expected a mapping (got a list)"),
    "negative replicas": ("model: smollm2-135m\npools: {prefill: {replicas: -1}, decode: {}}\n",
                          "pools.prefill.replicas", "greater than or equal to 1 (got -1)"),
    "missing model": ("pools: {prefill: {}, decode: {}}\n", "model", "required key is missing"),
    "bad dtype": (MINIMAL + "dtype: bf16\n", "dtype", "did you mean 'bfloat16'?"),
    "tp not dividing heads": ("model: smollm2-135m\npools: {prefill: {tensor_parallel: 2}, decode: {}}\n",
                              "pools.prefill.tensor_parallel", "2 does not divide the model's 9 query heads"),
    "pp beyond the layers": ("model: smollm2-135m\npools: {prefill: {}, decode: {pipeline_parallel: 31}}\n",
                             "pools.decode.pipeline_parallel", "31 stages for the model's 30 layers"),
    "tp not dividing intermediate_size": ("model: smollm2-135m\npools: {prefill: {tensor_parallel: 9}, decode: {}}\n",
                                          "pools.prefill.tensor_parallel", "intermediate_size 1536; use one of 1, 3"),
    "tp with pp": ("model: smollm2-135m\npools: {prefill: {tensor_parallel: 3, pipeline_parallel: 2}, decode: {}}\n",
                   "pools.prefill.pipeline_parallel", "stages of several tensor-parallel ranks (not supported"),
    "speculative with tp": ("model: smollm2-135m\npools: {prefill: {}, decode: {tensor_parallel: 3, speculative: {}}}\n",
                            "pools.decode.speculative", "draft-verify decoding"),
    "kv pages too few for the model": ("model: smollm2-135m\npools: {prefill: {}, decode: {kv: {num_pages: 10}}}\n",
                                       "pools.decode.kv.num_pages", "cannot hold one 8192-token sequence"),
    "kv pages too few for max_model_len": (
        "model: smollm2-135m\npools: {prefill: {}, decode: {max_model_len: 4096, kv: {num_pages: 10}}}\n",
        "pools.decode.kv.num_pages", "raise num_pages to >= 256"),
    "max_model_len beyond the model": ("model: smollm2-135m\npools: {prefill: {max_model_len: 9000}, decode: {}}\n",
                                       "pools.prefill.max_model_len", "exceeds the model's 8192 positions"),
    "server beyond loopback without api key": (MINIMAL + "server: {host: 0.0.0.0}\n", "server.api_key",
                                               "required because server.host '0.0.0.0' is not loopback"),
    "kv beyond loopback without token": (MINIMAL + "kv_transfer: {host: 10.1.2.3}\n", "kv_transfer.auth_token",
                                         "is not loopback"),
    "literal secret": (MINIMAL + "server: {api_key: s3cr3t-value}\n", "server.api_key",
                       "literal secrets are refused"),
    "secret with two sources": (MINIMAL + "kv_transfer: {auth_token: {env: A, file: /b}}\n",
                                "kv_transfer.auth_token", "exactly one of env: NAME or file: PATH"),
    "secret env not a name": (MINIMAL + "server: {api_key: {env: 'my key'}}\n", "server.api_key.env",
                              "not an environment variable name"),
    "tls without key": (MINIMAL + "kv_transfer: {tls: {cert_file: a.crt}}\n", "kv_transfer.tls.key_file",
                        "required key is missing"),
    "both pools missing": ("model: smollm2-135m\n", "pools.decode", "required in disaggregated mode"),
    "colocated with prefill pool": ("model: smollm2-135m\nmode: colocated\npools: {colocated: {}, prefill: {}}\n",
                                    "pools.prefill", "not used in colocated mode"),
    "colocated without its pool": ("model: smollm2-135m\nmode: colocated\n", "pools.colocated",
                                   "required in colocated mode"),
    "colocated with kv_transfer": ("model: smollm2-135m\nmode: colocated\npools: {colocated: {}}\n"
                                   "kv_transfer: {failure_policy: fail}\n", "kv_transfer", "no effect in colocated"),
    "disaggregated with colocated pool": (MINIMAL.replace("}}", "}, colocated: {}}"), "pools.colocated",
                                          "only used in colocated mode"),
    "bad ray address": (MINIMAL + "ray: {address: 'http://head'}\n", "ray.address", "not a Ray address"),
    "ray port out of range": (MINIMAL + "ray: {address: 'ray://head:70000'}\n", "ray.address", "not a Ray address"),
    "bad failure policy": (MINIMAL + "kv_transfer: {failure_policy: retry}\n", "kv_transfer.failure_policy",
                           "must be one of fail, recompute"),
    "host with a port": (MINIMAL + "server: {host: '127.0.0.1:80'}\n", "server.host", "carries a port"),
    "port out of range": (MINIMAL + "server: {port: 70000}\n", "server.port", "less than or equal to 65535"),
    "reserved ray resource": ("model: smollm2-135m\npools: {prefill: {resources: {custom: {GPU: 1}}}, decode: {}}\n",
                              "pools.prefill.resources.custom.GPU", "use num_gpus"),
    "zero custom resource": ("model: smollm2-135m\npools: {prefill: {}, decode: {resources: {custom: {decode: 0}}}}\n",
                             "pools.decode.resources.custom.decode", "must be > 0"),
    "non-positive slo": (MINIMAL + "slo: {ttft_ms: 0}\n", "slo.ttft_ms", "greater than 0"),
    "yaml syntax error": ("model: smollm2-135m\npools:\n  prefill: {replicas: 1\n", "line 4, column 1",
                          "YAML syntax error"),
    "yaml bad indentation": ("model: smollm2-135m\n  mode: colocated\n", "line 2, column 7", "YAML syntax error"),
    "duplicate key": (MINIMAL + "model: other\n", "line 3, column 1",
                      "duplicate key 'model' (first defined on line 1)"),
    "top-level list": ("- model: smollm2-135m\n", "", "the top level must be a mapping of keys"),
    "empty file": ("# nothing\n", "", "the file is empty"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_spec_names_the_key_and_the_reason(tmp_path, case):
    text, key, reason = BAD[case]
    err = spec_error(tmp_path, text)
    matching = [p for p in err.problems if p.key == key and reason in p.reason]
    assert matching, f"expected '{key}: ...{reason}...' in:\n{err}"
    assert f"{key}: " in str(err) if key else reason in str(err)


def test_literal_secret_is_never_echoed(tmp_path):
    err = spec_error(tmp_path, MINIMAL + "server: {host: 0.0.0.0, api_key: s3cr3t-value}\n")
    assert "s3cr3t" not in str(err)


def test_every_problem_is_reported_at_once(tmp_path):
    err = spec_error(tmp_path, "model: smollm2-135m\nmode: disagregated\npools: {prefill: {replicas: 0}, decode: {}}\n"
                               "ray: {address: nowhere}\n")
    assert {p.key for p in err.problems} == {"mode", "pools.prefill.replicas", "ray.address"}
    assert "did you mean 'disaggregated'?" in str(err)


def test_model_problems_cover_every_pool(tmp_path):
    err = spec_error(tmp_path, "model: smollm2-135m\npools: {prefill: {tensor_parallel: 2, pipeline_parallel: 7}, "
                               "decode: {tensor_parallel: 4}}\n")
    assert [p.key for p in err.problems] == ["pools.prefill.tensor_parallel", "pools.prefill.pipeline_parallel",
                                             "pools.decode.tensor_parallel"]


def test_unreadable_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "missing.yaml")


# ---- pdserve validate --------------------------------------------------------------------------
@pytest.fixture
def fake_model(monkeypatch):
    """`validate` resolves the model; the unit tests hand it SmolLM2's config without loading anything."""
    monkeypatch.setattr(spec_model, "resolve_model_config", lambda spec: SMOLLM2)


def test_validate_ok(fake_model, capsys):
    assert cli.main(["validate", str(DEPLOY / "local-2d.yaml")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok: disaggregated smollm2-135m") and "decode 2 replicas" in out


@pytest.mark.parametrize("text, key", [
    ("model: smollm2-135m\npools: {prefill: {replica: 1}, decode: {}}\n", "pools.prefill.replica"),
    ("model: smollm2-135m\npools: {prefill: {}, decode: {tensor_parallel: 2}}\n", "pools.decode.tensor_parallel"),
])
def test_validate_bad_file_exits_2_naming_the_key(fake_model, tmp_path, capsys, text, key):
    path = write(tmp_path, text)
    assert cli.main(["validate", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and f"{path}: {key}: " in captured.err


def test_validate_skip_model_checks_the_file_alone(tmp_path, capsys):
    path = write(tmp_path, "model: not-a-model\npools: {prefill: {}, decode: {tensor_parallel: 2}}\n")
    assert cli.main(["validate", "--skip-model", str(path)]) == 0
    assert "model not checked" in capsys.readouterr().out


def test_unknown_model_is_a_spec_error_on_model(tmp_path):
    spec = load_spec(write(tmp_path, MINIMAL.replace("smollm2-135m", str(tmp_path / "nope"))))
    with pytest.raises(SpecError) as info:
        resolve_model_config(spec)
    assert info.value.problems[0].key == "model"


@pytest.mark.slow
def test_literal_config_matches_the_real_smollm2(smollm2_dir):
    from engine.loader import load_config

    real = load_config(smollm2_dir)
    assert (real.num_heads, real.num_kv_heads, real.num_layers, real.max_position) == \
           (SMOLLM2.num_heads, SMOLLM2.num_kv_heads, SMOLLM2.num_layers, SMOLLM2.max_position)


def test_tp_may_replicate_kv_heads_but_must_split_query_heads():
    """9 query / 3 KV heads with intermediate 1152: tp 9 replicates each KV head on 3 ranks (allowed); 12 / 4
    at tp 6 neither splits nor replicates the KV heads evenly (rejected, naming what works)."""
    import dataclasses

    spec = parse_spec({"model": "m", "pools": {"prefill": {}, "decode": {"tensor_parallel": 9}}})
    spec.check_against_model(dataclasses.replace(SMOLLM2, intermediate_size=1152))  # no SpecError
    odd = dataclasses.replace(SMOLLM2, num_heads=12, num_kv_heads=4)
    bad = parse_spec({"model": "m", "pools": {"prefill": {}, "decode": {"tensor_parallel": 6}}})
    with pytest.raises(SpecError) as info:
        bad.check_against_model(odd)
    assert "pools.decode.tensor_parallel" in str(info.value) and "use one of 1, 2, 4, 12" in str(info.value)
