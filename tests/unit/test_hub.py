"""Hugging Face Hub ids in the engine (engine/hub.py), offline: tiny random models laid out as a Hub cache in
a temporary HF_HOME (tests/hub_cache.py) with HF_HUB_OFFLINE=1. Served by id == served by directory
(greedy, float32); revisions pick snapshots; every resolution error is typed, names the id and the fix.
The Hub's own answers (gated, no such repository, no such revision) are huggingface_hub's typed errors
raised by a fake download function: nothing here touches the network.
"""
from __future__ import annotations

import json

import pytest

from engine import LLM, SamplingParams
from engine.errors import (GatedModelError, HubModelError, HubRepoNotFoundError, ModelNotCachedError,
                           UnknownModelError, UnknownRevisionError, UnsupportedArchitectureError)
from engine.loader import resolve_model
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.hub_cache import hub_env, hub_http_error, lay_out
from tests.tiny_models import INIT_RANGE, write_tiny

REPO = "pdserve-test/tiny-llama"
OPT_CONFIG = {"model_type": "opt", "architectures": ["OPTForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "ffn_dim": 128, "vocab_size": 256, "max_position_embeddings": 512}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_other(tmp_path_factory):
    return write_tiny("llama", tmp_path_factory.mktemp("tiny") / "llama-seed1", seed=1, initializer_range=INIT_RANGE)


@pytest.fixture
def hf_home(tmp_path, monkeypatch):
    hub_env(monkeypatch, tmp_path / "hf")
    return tmp_path / "hf"


def _greedy(llm, prompts):
    outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert_engine_empty(llm)
    return outs


def test_served_by_id_equals_served_by_directory(tiny_dir, hf_home):
    lay_out(hf_home, REPO, tiny_dir)
    prompts = [[5, 6, 7, 8, 9, 10], [40, 41, 42], list(range(100, 130))]
    by_dir = LLM(model=str(tiny_dir), dtype="float32", num_pages=64)
    by_id = LLM(model=REPO, dtype="float32", num_pages=64)
    assert_greedy_equal(_greedy(by_dir, prompts), _greedy(by_id, prompts))
    assert by_id.model_dir.parent.name == "snapshots" and by_id.model_name == REPO
    assert by_id.fingerprint == by_dir.fingerprint  # both ends of a KV transfer agree on the weights


def test_revision_picks_the_snapshot(tiny_dir, tiny_other, hf_home):
    main = lay_out(hf_home, REPO, tiny_dir, commit="a" * 40, refs=("main",))
    v1 = lay_out(hf_home, REPO, tiny_other, commit="b" * 40, refs=("v1",))
    assert resolve_model(REPO) == main
    assert resolve_model(REPO, "v1") == v1 and resolve_model(REPO, "b" * 40) == v1
    prompts = [list(range(3, 40))]
    assert _greedy(LLM(model=REPO, revision="v1", dtype="float32", num_pages=64), prompts) == \
        _greedy(LLM(model=str(tiny_other), dtype="float32", num_pages=64), prompts)


def test_local_directory_wins_over_a_hub_id_of_the_same_name(tiny_dir, hf_home, monkeypatch):
    monkeypatch.chdir(tiny_dir.parent.parent)
    local = f"{tiny_dir.parent.name}/{tiny_dir.name}"  # e.g. "tiny0/llama": shaped like org/name, and a folder here
    assert resolve_model(local).resolve() == tiny_dir.resolve()


def test_not_cached_offline_names_the_id_and_the_fix(hf_home, tiny_dir):
    with pytest.raises(ModelNotCachedError) as err:
        resolve_model("pdserve-test/absent")
    msg = str(err.value)
    assert "'pdserve-test/absent'" in msg and "HF_HUB_OFFLINE" in msg and "hf download pdserve-test/absent" in msg
    lay_out(hf_home, REPO, tiny_dir, commit="c" * 40)
    with pytest.raises(ModelNotCachedError) as err:
        resolve_model(REPO, "v9")
    msg = str(err.value)
    assert "'v9'" in msg and "main -> ccccccc" in msg and f"hf download {REPO} --revision v9" in msg


def test_unsupported_architecture_fails_before_any_weights(hf_home, tmp_path):
    src = tmp_path / "opt"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(OPT_CONFIG))
    lay_out(hf_home, "facebook/opt-tiny", src, files=("config.json",))  # no weights, no tokenizer in the cache
    with pytest.raises(UnsupportedArchitectureError) as err:
        LLM(model="facebook/opt-tiny")
    msg = str(err.value)
    assert "'facebook/opt-tiny'" in msg and "OPTForCausalLM" in msg
    assert all(a in msg for a in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"))


def test_a_repository_without_safetensors_is_refused(hf_home, tiny_dir, tmp_path):
    src = tmp_path / "bin-only"
    src.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (src / name).write_bytes((tiny_dir / name).read_bytes())
    (src / "pytorch_model.bin").write_bytes(b"not loaded")
    lay_out(hf_home, "pdserve-test/bin-only", src, files=("config.json", "tokenizer.json", "tokenizer_config.json",
                                                           "pytorch_model.bin"))
    with pytest.raises(HubModelError, match="safetensors only"):
        resolve_model("pdserve-test/bin-only")


@pytest.mark.parametrize("name, revision, message", [
    (f"{REPO}@v1", None, "revision 'REV'"),
    ("pdserve-test/two--dashes", None, "not a valid Hugging Face Hub id"),
    (REPO, "", "revision is empty"),
])
def test_malformed_ids_are_typed_errors(hf_home, name, revision, message):
    with pytest.raises(UnknownModelError, match=message):
        resolve_model(name, revision)


def test_revision_on_a_local_model_is_refused(tiny_dir):
    with pytest.raises(UnknownModelError, match="Hub ids"):
        resolve_model(str(tiny_dir), "main")


@pytest.mark.parametrize("hf_error, status, ours, fix", [
    ("GatedRepoError", 403, GatedModelError, "export HF_TOKEN"),
    ("RepositoryNotFoundError", 404, HubRepoNotFoundError, "check the spelling"),
    ("RevisionNotFoundError", 404, UnknownRevisionError, "give a branch, tag or commit"),
])
def test_hub_answers_become_typed_errors_naming_the_fix(hf_home, monkeypatch, hf_error, status, ours, fix):
    import huggingface_hub

    hub_env(monkeypatch, hf_home, offline=False)

    def answer(repo_id, *args, **kwargs):
        raise hub_http_error(hf_error, status, repo_id)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", answer)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", answer)
    with pytest.raises(ours) as err:
        resolve_model("meta-llama/Meta-Llama-3-8B-Instruct", "nope" if ours is UnknownRevisionError else None)
    msg = str(err.value)
    assert "'meta-llama/Meta-Llama-3-8B-Instruct'" in msg and fix in msg and err.value.field == "model"
    if ours is GatedModelError:
        assert "HF_TOKEN is unset" in msg and "https://huggingface.co/meta-llama/Meta-Llama-3-8B-Instruct" in msg
        monkeypatch.setenv("HF_TOKEN", "hf_secretvalue123")
        with pytest.raises(GatedModelError) as err:
            resolve_model("meta-llama/Meta-Llama-3-8B-Instruct")
        assert "not been granted access" in str(err.value) and "hf_secretvalue123" not in str(err.value)
    if ours is UnknownRevisionError:
        assert "'nope'" in msg
