"""Hub ids in the cluster spec, `pdserve validate` and `pdserve plan` (offline; tiny configs in a temporary
HF_HOME laid out by tests/hub_cache.py).

`model: org/name` with `revision:` beside it; `org/name@rev` and a token written into the spec are refused
naming the fix; `validate` never downloads: an id whose config is not cached passes with a note, a cached
config is checked (architecture, heads, layers); the planner writes the model's Hub id, reads a Hub id as
`--model`, and asks for `--spec-model` when the config it was given names nothing servable.
"""
from __future__ import annotations

import json

import pytest

from cluster import cli
from cluster.planner.emit.spec_writer import model_notes, spec_model
from cluster.planner.errors import PlannerError
from cluster.planner.inputs.models import known_models, load_model
from cluster.spec import SpecError, load_spec, parse_spec
from tests.hub_cache import hub_env, lay_out
from tests.tiny_models import hf_config

POOLS = {"prefill": {}, "decode": {}}
OPT = {"model_type": "opt", "architectures": ["OPTForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
       "num_attention_heads": 4, "ffn_dim": 128, "vocab_size": 256, "max_position_embeddings": 512}


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    hub_env(monkeypatch, tmp_path / "hf", offline=False)  # online: validate must still never ask the Hub
    import huggingface_hub

    def no_network(*args, **kwargs):
        raise AssertionError("validate asked the Hub")

    for name in ("hf_hub_download", "snapshot_download", "model_info", "repo_info"):
        monkeypatch.setattr(huggingface_hub, name, no_network)
    return tmp_path / "hf"


def _problems(data) -> dict[str, str]:
    with pytest.raises(SpecError) as err:
        parse_spec(data)
    return {p.key: p.reason for p in err.value.problems}


def _write(tmp_path, text: str):
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return str(path)


def _config_dir(tmp_path, name: str, config: dict):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


# ---- the spec ---------------------------------------------------------------------------------
def test_a_hub_id_and_its_revision_reach_the_engine():
    spec = parse_spec({"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "revision": "v1.0", "pools": POOLS})
    assert spec.engine_kwargs("decode")["revision"] == "v1.0"
    assert "HuggingFaceTB/SmolLM2-135M-Instruct at v1.0" in spec.summary()
    assert "revision" not in parse_spec({"model": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                         "pools": POOLS}).engine_kwargs("decode")


@pytest.mark.parametrize("data, key, reason", [
    ({"model": "meta-llama/Meta-Llama-3-8B@main"}, "model", "`revision: REV`"),
    ({"model": "smollm2-135m", "revision": "main"}, "revision", "Hub ids (org/name) only"),
    ({"model": "/models/llama.gguf", "revision": "main"}, "revision", "Hub ids (org/name) only"),
    ({"model": "meta-llama/Meta-Llama-3-8B", "revision": ""}, "revision", "at least 1 character"),
])
def test_model_name_problems_name_the_fix(data, key, reason):
    assert reason in _problems({**data, "pools": POOLS})[key]


@pytest.mark.parametrize("key", ["hf_token", "token", "HF_TOKEN", "huggingface_token", "use_auth_token"])
def test_a_token_in_the_spec_is_refused_without_echoing_it(key):
    reason = _problems({"model": "meta-llama/Meta-Llama-3-8B", key: "hf_s3cretvalue", "pools": POOLS})[key]
    assert "export HF_TOKEN" in reason and "hf_s3cretvalue" not in reason


# ---- pdserve validate -------------------------------------------------------------------------
def test_validate_an_uncached_id_checks_its_shape_and_notes_the_rest(hf_home, tmp_path, capsys):
    path = _write(tmp_path, "model: facebook/opt-13b\npools: {prefill: {}, decode: {tensor_parallel: 7}}\n")
    assert cli.main(["validate", path]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok: disaggregated facebook/opt-13b") and "note: " in out
    assert "not in the Hugging Face cache" in out and "pdserve serve" in out
    bad = _write(tmp_path, "model: facebook/opt--13b\npools: {prefill: {}, decode: {}}\n")
    assert cli.main(["validate", bad]) == 2
    assert "model: model 'facebook/opt--13b': not a valid Hugging Face Hub id" in capsys.readouterr().err


def test_validate_checks_a_cached_config(hf_home, tmp_path, capsys):
    """tiny llama: 4 heads, 2 KV heads -- tensor_parallel 3 divides neither, so the cached config was read."""
    lay_out(hf_home, "pdserve-test/tiny", _config_dir(tmp_path, "tiny", hf_config("llama").to_dict()),
            files=("config.json",))
    ok = _write(tmp_path, "model: pdserve-test/tiny\npools: {prefill: {}, decode: {tensor_parallel: 2}}\n")
    assert cli.main(["validate", ok]) == 0
    assert "config.json from the Hugging Face cache" in capsys.readouterr().out
    bad = _write(tmp_path, "model: pdserve-test/tiny\npools: {prefill: {}, decode: {tensor_parallel: 3}}\n")
    assert cli.main(["validate", bad]) == 2
    assert f"{bad}: pools.decode.tensor_parallel: " in capsys.readouterr().err
    missing_rev = _write(tmp_path, "model: pdserve-test/tiny\nrevision: v2\npools: {prefill: {}, decode: {}}\n")
    assert cli.main(["validate", missing_rev]) == 0
    assert "pdserve-test/tiny at revision v2 is not in the Hugging Face cache" in capsys.readouterr().out


def test_validate_refuses_a_cached_unsupported_architecture(hf_home, tmp_path, capsys):
    lay_out(hf_home, "facebook/opt-13b", _config_dir(tmp_path, "opt", OPT), files=("config.json",))
    path = _write(tmp_path, "model: facebook/opt-13b\npools: {prefill: {}, decode: {}}\n")
    assert cli.main(["validate", path]) == 2
    err = capsys.readouterr().err
    assert "model: model 'facebook/opt-13b': architecture 'OPTForCausalLM (opt)' is not supported" in err
    assert "LlamaForCausalLM (llama)" in err


# ---- pdserve plan -----------------------------------------------------------------------------
def test_every_model_file_names_a_hub_id_and_an_architecture():
    for name in known_models():
        m = load_model(name)
        assert m.hf_id and "/" in m.hf_id and m.architecture.endswith("ForCausalLM"), name
        assert load_model(m.hf_id.upper()).name == name  # a Hub id is a --model too (case-insensitive)
        assert spec_model(None, m) == m.hf_id and spec_model("smollm2-135m", m) == "smollm2-135m"
    assert model_notes(load_model("opt-13b")) and "OPTForCausalLM" in model_notes(load_model("opt-13b"))[0]
    assert not model_notes(load_model("llama-3-8b")) and not model_notes(load_model("qwen2.5-7b"))


def test_a_planned_config_json_names_what_serves_it(tmp_path):
    cfg = hf_config("llama").to_dict()
    bare = _config_dir(tmp_path, "bare", cfg)
    with pytest.raises(PlannerError, match="--spec-model"):
        spec_model(None, load_model(str(bare)))
    with_weights = _config_dir(tmp_path, "weights", cfg)
    (with_weights / "model.safetensors").write_bytes(b"")
    assert spec_model(None, load_model(str(with_weights))) == str(with_weights.absolute())
    snapshot = lay_out(tmp_path / "hf", "pdserve-test/tiny", bare, files=("config.json",))
    assert spec_model(None, load_model(str(snapshot / "config.json"))) == "pdserve-test/tiny"


def test_the_planned_cpu_spec_validates_as_written(hf_home, tmp_path, capsys):
    profile = {"name": "synthetic-cpu", "model": "smollm2-135m", "dtype": "bfloat16", "hardware": "cpu-local",
               "tp": {"1": {"prefill": [0.02, 1.1e-3, 1e-8], "decode": [0.03, 2e-7, 2e-3]}}}
    (tmp_path / "p.json").write_text(json.dumps(profile))
    out = str(tmp_path / "plan.yaml")
    assert cli.main(["plan", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--hardware", "cpu-local",
                     "--gpus-per-node", "2", "--input-len", "uniform:100:300", "--output-len", "20", "--rate", "1",
                     "--ttft-ms", "1500", "--tpot-ms", "150", "--profile", str(tmp_path / "p.json"),
                     "--out", out]) == 0
    capsys.readouterr()
    assert load_spec(out).model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert cli.main(["validate", out]) == 0
    assert capsys.readouterr().out.startswith("ok: ")
