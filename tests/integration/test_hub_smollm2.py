"""SmolLM2-135M served by its Hugging Face Hub id, offline: the bundled model's converted files laid out as
`HuggingFaceTB/SmolLM2-135M-Instruct` in a temporary HF_HOME (tests/hub_cache.py), HF_HUB_OFFLINE=1.

By id == by the bundled name (greedy, float32, assert_greedy_equal; the chat template comes from the
snapshot). The spec `pdserve plan` writes for the CPU names the id, validates as written with the cached
config checked, and serves: each pool's engine loads from the spec's engine settings, the serving one
behind the HTTP frontend answers a request for the id with the reference's tokens.
"""
from __future__ import annotations

import json

import pytest
import torch

from cluster import cli
from cluster.client import Client
from cluster.local_backend import LocalEngineBackend
from cluster.server import BackgroundServer
from cluster.spec import load_spec
from engine import LLM, SamplingParams
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.hub_cache import hub_env, lay_out
from tests.prompts import token_prompts

pytestmark = pytest.mark.slow
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
NEW = 24
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
CHAT = [{"role": "user", "content": "Name three colors of the rainbow."}]
PROFILE = {"name": "synthetic-cpu", "model": "smollm2-135m", "dtype": "float32", "hardware": "cpu-local",
           "tp": {"1": {"prefill": [0.02, 1.1e-3, 1e-8], "decode": [0.03, 2e-7, 2e-3]}}}


@pytest.fixture(scope="module")
def reference():
    llm = LLM("smollm2-135m", dtype="float32", num_pages=256, keep_logits=True)
    prompts = token_prompts(llm.tokenizer, [8, 40, 120]) + [llm.tokenizer.apply_chat_template(CHAT)]
    outs = llm.generate(prompts, GREEDY)
    assert_engine_empty(llm)
    return prompts, [o.token_ids for o in outs], [torch.stack(o.logits) for o in outs]


@pytest.fixture
def hf_home(tmp_path, monkeypatch, smollm2_dir):
    hub_env(monkeypatch, tmp_path / "hf")
    lay_out(tmp_path / "hf", REPO, smollm2_dir)
    return tmp_path / "hf"


def test_served_by_id_equals_the_bundled_name(reference, hf_home):
    prompts, ref, logits = reference
    llm = LLM(REPO, dtype="float32", num_pages=256)
    assert llm.tokenizer.apply_chat_template(CHAT) == prompts[-1]  # the template read from the snapshot
    assert_greedy_equal(ref, [o.token_ids for o in llm.generate(prompts, GREEDY)], logits)
    assert_engine_empty(llm)


def test_the_planned_cpu_spec_validates_and_serves_by_id(reference, hf_home, tmp_path, capsys):
    prompts, ref, logits = reference
    (tmp_path / "p.json").write_text(json.dumps(PROFILE))
    out = str(tmp_path / "plan.yaml")
    assert cli.main(["plan", "--model", "smollm2-135m", "--hardware", "cpu-local", "--gpus-per-node", "2",
                     "--input-len", "uniform:100:300", "--output-len", "20", "--rate", "1", "--ttft-ms", "1500",
                     "--tpot-ms", "150", "--dtype", "float32", "--profile", str(tmp_path / "p.json"),
                     "--out", out]) == 0
    capsys.readouterr()
    assert cli.main(["validate", out]) == 0  # as written, with the cached config checked
    assert "config.json from the Hugging Face cache" in capsys.readouterr().out
    spec = load_spec(out)
    assert spec.model == REPO
    for name in spec.pools_in_use():
        if name == "prefill":  # loads by id from the spec's settings (it serves behind a decode pool)
            LLM(**spec.engine_kwargs(name)).close()
            continue
        llm = LLM(**spec.engine_kwargs(name))
        backend = LocalEngineBackend(llm)  # the served name defaults to the id the spec gives
        srv = BackgroundServer(backend).start()
        try:
            client = Client(srv.base_url)
            assert client.models() == [REPO]
            got = [client.complete(p, model=REPO, max_tokens=NEW, temperature=0,
                                   pdserve={"ignore_eos": True, "return_token_ids": True}).choices[0].token_ids
                   for p in prompts]
        finally:
            srv.stop()
            backend.close()
        assert_greedy_equal(ref, got, logits)
        assert_engine_empty(llm)
