"""vLLM's sampling fields, sent at the top level over HTTP, do what vLLM's server does (issue 22): ignore_eos,
min_tokens, top_k, min_p, repetition_penalty, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, max_completion_tokens, stream_options.continuous_usage_stats.

A tiny random Llama whose EOS is rewired to a token its own greedy output contains (at index K), and whose
tokenizer marks that token special, so EOS, min_tokens and skip_special_tokens all show in 12 tokens. A real
uvicorn on 127.0.0.1 in front of `LocalEngineBackend`; every test ends with the engine empty.
"""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from cluster.local_backend import LocalEngineBackend
from cluster.server import BackgroundServer
from engine import SamplingParams
from engine.llm import LLM
from tests.conftest import assert_engine_empty
from tests.prompts import MIXED
from tests.tiny_models import write_tiny_llama

PROMPT = MIXED[:6]
N = 12
TEMPLATE = "{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}t5"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from tokenizers import AddedToken, Tokenizer

    d = write_tiny_llama(tmp_path_factory)  # its own copy: the test changes its files
    ref = LLM(model=str(d), dtype="float32", num_pages=64).generate(
        [PROMPT], SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True))[0].token_ids
    k = next(i for i in range(2, N - 4) if ref[i] not in ref[:i])
    eos = ref[k]
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, eos_token_id=eos)))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{eos}", "chat_template": TEMPLATE}))
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(f"t{eos}", special=True)])
    tok.save(str(d / "tokenizer.json"))
    llm = LLM(model=str(d), dtype="float32", num_pages=128, max_num_seqs=8)
    backend = LocalEngineBackend(llm, model_name="tiny")
    srv = BackgroundServer(backend).start()
    yield srv, ref, k
    srv.stop()
    backend.close()
    assert_engine_empty(llm)


@pytest.fixture(autouse=True)
def _empty_after(served):
    yield
    llm = served[0].app.state.pdserve.backend.llm
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and llm.has_unfinished():
        time.sleep(0.01)
    assert_engine_empty(llm)


def post(srv, body: dict, chat: bool = False) -> dict:
    body = {"model": "tiny", "max_tokens": N, "temperature": 0, **body}
    body.setdefault("pdserve", {})["return_token_ids"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": "t9 t10"}]
    else:
        body["prompt"] = PROMPT
    r = httpx.post(srv.base_url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    c = out["choices"][0]
    return dict(ids=c["token_ids"], text=c["message"]["content"] if chat else c["text"],
                finish=c["finish_reason"], usage=out["usage"])


def stream(srv, body: dict, chat: bool = False) -> list[dict]:
    body = {"model": "tiny", "max_tokens": N, "temperature": 0, "stream": True, **body}
    body.setdefault("pdserve", {})["return_token_ids"] = True
    body.update({"messages": [{"role": "user", "content": "t9 t10"}]} if chat else {"prompt": PROMPT})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    with httpx.stream("POST", srv.base_url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_ignore_eos_runs_to_max_tokens(served):
    srv, ref, k = served
    out = post(srv, {})
    assert (out["ids"], out["finish"]) == (ref[:k + 1], "stop")
    for body in ({"ignore_eos": True}, {"pdserve": {"ignore_eos": True}}, {"ignore_eos": True,
                                                                          "pdserve": {"ignore_eos": True}}):
        out = post(srv, body)
        assert (out["ids"], out["finish"], out["usage"]["completion_tokens"]) == (ref, "length", N), body


def test_min_tokens_masks_eos_and_stop_token_ids(served):
    srv, ref, k = served
    eos = ref[k]
    out = post(srv, {"min_tokens": k + 3})
    assert out["ids"][:k] == ref[:k] and out["ids"][k] != eos  # the masked EOS: the next best token instead
    assert len(out["ids"]) >= k + 3 and eos not in out["ids"][:k + 3]
    stopped = post(srv, {"ignore_eos": True, "stop_token_ids": [eos]})
    assert (stopped["ids"], stopped["finish"]) == (ref[:k + 1], "stop")  # a stop id ends it, and stays in it
    late = post(srv, {"ignore_eos": True, "stop_token_ids": [eos], "min_tokens": k + 3})
    assert late["ids"][:k] == ref[:k] and eos not in late["ids"][:k + 3] and len(late["ids"]) >= k + 3


def test_top_k_one_and_min_p_one_equal_greedy_when_sampling(served):
    srv, ref, _ = served
    sampled = dict(temperature=1.0, seed=3, ignore_eos=True)
    assert post(srv, sampled)["ids"] != ref  # (the control: plain sampling does leave the greedy path)
    assert post(srv, dict(sampled, top_k=1))["ids"] == ref
    assert post(srv, dict(sampled, min_p=1.0))["ids"] == ref
    some = post(srv, dict(sampled, min_p=0.5))["ids"]
    assert some == post(srv, dict(sampled, min_p=0.5))["ids"]  # keyed by seed: reproducible


def test_repetition_penalty_top_level_equals_its_old_spelling(served):
    srv, ref, _ = served
    top = post(srv, {"ignore_eos": True, "repetition_penalty": 3.0})["ids"]
    assert top == post(srv, {"ignore_eos": True, "pdserve": {"repetition_penalty": 3.0}})["ids"]
    assert top != ref


def test_stop_strings_include_stop_str_in_output_and_min_tokens(served):
    srv, _, _ = served
    base = post(srv, {"ignore_eos": True})["text"]
    words = base.split(" ")
    pairs = [f"{a} {b[:2]}" for a, b in zip(words, words[1:])]  # each spans two tokens
    stop = next(x for x in pairs[3:] if base.count(x) == 1)
    cut = base.find(stop)
    out = post(srv, {"ignore_eos": True, "stop": [stop]})
    assert (out["text"], out["finish"]) == (base[:cut], "stop")
    kw = {"ignore_eos": True, "stop": [stop], "include_stop_str_in_output": True}
    out = post(srv, kw)
    assert (out["text"], out["finish"]) == (base[:cut + len(stop)], "stop")
    assert "".join(c["choices"][0]["text"] for c in stream(srv, kw) if c["choices"]) == out["text"]
    # min_tokens 6: the text of the first tokens is not searched (the EOS among them is masked too, so
    # the tokens differ from `base`): a stop string found only there does not end the output
    base6 = post(srv, {"ignore_eos": True, "min_tokens": 6})["text"]
    words = base6.split(" ")
    early = next(x for x in (f"{a} {b[:2]}" for a, b in zip(words[:2], words[1:3])) if base6.count(x) == 1)
    out = post(srv, {"ignore_eos": True, "stop": [early], "min_tokens": 6})
    assert (out["text"], out["finish"]) == (base6, "length")


def test_skip_special_tokens_false_keeps_their_text(served):
    srv, ref, k = served
    special = f"t{ref[k]}"
    kept = post(srv, {"ignore_eos": True, "skip_special_tokens": False})
    dropped = post(srv, {"ignore_eos": True})
    assert kept["ids"] == dropped["ids"] == ref
    assert special in kept["text"].split() and special not in dropped["text"].split()
    assert post(srv, {"ignore_eos": True, "pdserve": {"skip_special_tokens": False}})["text"] == kept["text"]


@pytest.mark.parametrize("chat", [False, True])
def test_max_completion_tokens_is_max_tokens(served, chat):
    srv, ref, _ = served
    out = post(srv, {"max_tokens": None, "max_completion_tokens": 5, "ignore_eos": True}, chat)
    assert (len(out["ids"]), out["finish"], out["usage"]["completion_tokens"]) == (5, "length", 5)
    same = post(srv, {"max_tokens": 5, "max_completion_tokens": 5, "ignore_eos": True}, chat)
    assert same["ids"] == out["ids"]


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_counts_the_tokens_streamed_so_far(served, chat):
    srv, _, _ = served
    so = {"include_usage": True, "continuous_usage_stats": True}
    events = stream(srv, {"ignore_eos": True, "stream_options": so}, chat)
    final = events[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == N
    sent = 0
    for e in events[:-1]:
        sent += len(e["choices"][0].get("token_ids") or [])
        assert e["usage"] == {"prompt_tokens": final["usage"]["prompt_tokens"], "completion_tokens": sent,
                              "total_tokens": final["usage"]["prompt_tokens"] + sent}
    assert sent == N
    alone = stream(srv, {"ignore_eos": True, "stream_options": {"continuous_usage_stats": True}}, chat)
    assert [e["usage"] for e in alone] == [e["usage"] for e in events[:-1]]  # no usage-only chunk


def test_a_resumed_request_owes_min_tokens_less_what_was_streamed():
    from types import SimpleNamespace

    from cluster.serving.recovery import resume_plan

    f = SimpleNamespace(wid="r#1", prompt_ids=[5, 6], output_ids=[7, 8, 9],
                        params=SamplingParams(max_tokens=10, min_tokens=5, seed=1))
    prompt, params = resume_plan(f)
    assert prompt == [5, 6, 7, 8, 9] and (params.max_tokens, params.min_tokens) == (7, 2)
    f.output_ids = [7] * 6
    assert resume_plan(f)[1].min_tokens == 0
    params.validate(256)
