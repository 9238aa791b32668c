"""Bad input over HTTP, each row a test (issue 8, section 3): oversized prompts, invalid token ids, bad
max_tokens, NaN / infinite / negative sampling values, fields naming internal state, oversized bodies and
malformed JSON, on `/v1/completions` and `/v1/chat/completions`. Every row must get an OpenAI error body
with the right status and `param`, never a 500, and leave the engine empty (no pages, reservations or
requests); one test sends the whole table while a greedy stream runs and checks that stream is unharmed.
In-process: a real uvicorn on 127.0.0.1 in front of `LocalEngineBackend` on a tiny random Llama (no Ray).
"""
from __future__ import annotations

import asyncio
import json
import threading
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

MAX_LEN, LIMIT = 64, 128 * 1024  # the engine's max_model_len; the frontend's body limit (bytes)
BASE = {"model": "tiny", "prompt": "t5 t6", "max_tokens": 4}
LONG = list(range(3, 3 + MAX_LEN + 16))  # more tokens than the model takes
NAN, INF = float("nan"), float("inf")

# name: (patch over BASE, status, param)
ROWS = {
    # oversized prompts
    "prompt ids past max_model_len": ({"prompt": LONG}, 400, "prompt"),
    "prompt text past max_model_len": ({"prompt": " ".join(f"t{i}" for i in LONG)}, 400, "prompt"),
    "prompt + max_tokens past max_model_len": ({"prompt": LONG[:60], "max_tokens": 10}, 400, "max_tokens"),
    "batch with one oversized prompt": ({"prompt": [[5, 6], LONG]}, 400, "prompt"),
    "empty text prompt": ({"prompt": ""}, 400, "prompt"),
    "empty id list": ({"prompt": []}, 400, "prompt"),
    "batch of empty lists": ({"prompt": [[]]}, 400, "prompt"),
    "prompt an object": ({"prompt": {"text": "t5"}}, 400, "prompt"),
    # invalid token ids
    "negative token id": ({"prompt": [5, -1]}, 400, "prompt"),
    "token id = vocab size": ({"prompt": [5, 256]}, 400, "prompt"),
    "token id past int64": ({"prompt": [5, 2**64]}, 400, "prompt"),
    "float token id": ({"prompt": [5, 1.5]}, 400, "prompt"),
    "boolean token id": ({"prompt": [5, True]}, 400, "prompt"),
    "text mixed with ids": ({"prompt": ["t5", 5]}, 400, "prompt"),
    "bad id in a batch": ({"prompt": [[5], [999]]}, 400, "prompt"),
    # max_tokens
    "max_tokens negative": ({"max_tokens": -1}, 400, "max_tokens"),
    "max_tokens a string": ({"max_tokens": "8"}, 400, "max_tokens"),
    "max_tokens a float": ({"max_tokens": 1.5}, 400, "max_tokens"),
    "max_tokens a boolean": ({"max_tokens": True}, 400, "max_tokens"),
    "max_tokens 2**63": ({"max_tokens": 2**63}, 400, "max_tokens"),
    # sampling values (json.dumps writes NaN / Infinity, which Python's json -- and so the server -- reads)
    "temperature NaN": ({"temperature": NAN}, 400, "temperature"),
    "temperature Infinity": ({"temperature": INF}, 400, "temperature"),
    "top_p -Infinity": ({"top_p": -INF}, 400, "top_p"),
    "presence_penalty NaN": ({"presence_penalty": NAN}, 400, "presence_penalty"),
    "repetition_penalty NaN": ({"pdserve": {"repetition_penalty": NAN}}, 400, "pdserve.repetition_penalty"),
    "deadline Infinity": ({"pdserve": {"deadline_s": INF}}, 400, "pdserve.deadline_s"),
    "eviction budget NaN": ({"pdserve": {"kv_eviction": {"budget": NAN}}}, 400, "pdserve.kv_eviction"),
    "temperature a string": ({"temperature": "hot"}, 400, "temperature"),
    "top_p zero": ({"top_p": 0}, 400, "top_p"),
    "top_p negative": ({"top_p": -0.1}, 400, "top_p"),
    "presence_penalty past 2": ({"presence_penalty": 2.5}, 400, "presence_penalty"),
    "frequency_penalty past -2": ({"frequency_penalty": -9}, 400, "frequency_penalty"),
    "seed negative": ({"seed": -1}, 400, "seed"),
    "n zero": ({"n": -1}, 400, "n"),
    "n past the cap": ({"n": 17}, 400, "n"),
    "logprobs past 20": ({"logprobs": 21}, 400, "logprobs"),
    "logprobs negative": ({"logprobs": -1}, 400, "logprobs"),
    "stop an integer": ({"stop": 5}, 400, "stop"),
    "stop empty string": ({"stop": [""]}, 400, "stop"),
    "stop too many": ({"stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    "top_k negative": ({"pdserve": {"top_k": -5}}, 400, "pdserve.top_k"),
    "repetition_penalty zero": ({"pdserve": {"repetition_penalty": 0.0}}, 400, "pdserve.repetition_penalty"),
    "deadline zero": ({"pdserve": {"deadline_s": 0}}, 400, "pdserve.deadline_s"),
    "deadline negative": ({"pdserve": {"deadline_s": -1.0}}, 400, "pdserve.deadline_s"),
    "stop token id negative": ({"pdserve": {"stop_token_ids": [-1]}}, 400, "pdserve.stop_token_ids"),
    "stop token id past vocab": ({"pdserve": {"stop_token_ids": [999]}}, 400, "pdserve.stop_token_ids"),
    # vLLM's sampling fields at the top level
    "min_tokens negative": ({"min_tokens": -1}, 400, "min_tokens"),
    "min_tokens past max_tokens": ({"min_tokens": 5}, 400, "min_tokens"),
    "min_tokens a float": ({"min_tokens": 1.5}, 400, "min_tokens"),
    "min_p past 1": ({"min_p": 1.5}, 400, "min_p"),
    "min_p negative": ({"min_p": -0.1}, 400, "min_p"),
    "min_p NaN": ({"min_p": NAN}, 400, "min_p"),
    "top-level top_k below -1": ({"top_k": -2}, 400, "top_k"),
    "top-level repetition_penalty zero": ({"repetition_penalty": 0}, 400, "repetition_penalty"),
    "top-level stop token id past vocab": ({"stop_token_ids": [999]}, 400, "stop_token_ids"),
    "ignore_eos a string": ({"ignore_eos": "true"}, 400, "ignore_eos"),
    "skip_special_tokens an integer": ({"skip_special_tokens": 0}, 400, "skip_special_tokens"),
    "top_k both ways, different": ({"top_k": 2, "pdserve": {"top_k": 3}}, 400, "top_k"),
    "max_completion_tokens past max_model_len": ({"max_tokens": None, "prompt": LONG[:60],
                                                  "max_completion_tokens": 10}, 400, "max_completion_tokens"),
    "continuous_usage_stats without stream": ({"stream_options": {"continuous_usage_stats": True}}, 400,
                                              "stream_options"),
    "beam search": ({"use_beam_search": True}, 400, "use_beam_search"),
    "max_draft past 16": ({"pdserve": {"speculative": {"max_draft": 99}}}, 400, "pdserve.speculative.max_draft"),
    "eviction budget negative": ({"pdserve": {"kv_eviction": {"budget": -1.0}}}, 400, "pdserve.kv_eviction"),
    "sparse budget zero": ({"pdserve": {"sparse_attention": {"budget": 0}}}, 400, "pdserve.sparse_attention.budget"),
    "sparse unknown method": ({"pdserve": {"sparse_attention": {"method": "x"}}}, 400,
                              "pdserve.sparse_attention.method"),
    "sparse unknown key": ({"pdserve": {"sparse_attention": {"bugdet": 64}}}, 400, "pdserve.sparse_attention.bugdet"),
    # the served engine runs with sparse attention off: fields (not "off") are refused, naming the option
    "sparse on a pool without it": ({"pdserve": {"sparse_attention": {"budget": 64}}}, 400,
                                    "pdserve.sparse_attention"),
    # fields naming internal state
    "request_id": ({"request_id": "r-1"}, 400, "request_id"),
    "nonce": ({"nonce": "00"}, 400, "nonce"),
    "worker_id": ({"worker_id": "decode-0"}, 400, "worker_id"),
    "page_table": ({"page_table": [1, 2]}, 400, "page_table"),
    "a name with a transfer part": ({"my_transfer_hint": 1}, 400, "my_transfer_hint"),
    "pdserve.reservation_id": ({"pdserve": {"reservation_id": "x"}}, 400, "pdserve.reservation_id"),
    "pdserve.lease_s": ({"pdserve": {"lease_s": 999}}, 400, "pdserve.lease_s"),
    "pdserve.page_table": ({"pdserve": {"page_table": [0]}}, 400, "pdserve.page_table"),
    "pdserve not an object": ({"pdserve": "fast"}, 400, "pdserve"),
}
# name: (raw body bytes, status, param or None) -- bodies that are not a JSON object, or are not JSON at all
RAW = {
    "malformed": (b"{not json", 400, "body"),
    "truncated": (b'{"model": "tiny", "prompt": "t5"', 400, "body"),
    "empty body": (b"", 400, "body"),
    "not utf-8": (b'{"model": "\xff\xfe"}', 400, "body"),
    "top-level list": (b'[{"model": "tiny", "prompt": "t5"}]', 400, "body"),
    "top-level string": (b'"t5"', 400, "body"),
    "top-level null": (b"null", 400, "body"),
    "nesting bomb": (b"[" * 60000 + b"]" * 60000, 400, "body"),
    "body over the limit": (json.dumps({**BASE, "user": "x" * (LIMIT + 10)}).encode(), 413, None),
}
CHAT = {  # chat-only rows
    "no messages": ({"messages": []}, 400, "messages"),
    "messages missing": ({}, 400, "messages"),
    "tool role": ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages"),
    "chat temperature NaN": ({"messages": [{"role": "user", "content": "t5"}], "temperature": NAN}, 400,
                             "temperature"),
    "content an integer": ({"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    "max_tokens and max_completion_tokens differ": ({"messages": [{"role": "user", "content": "t5"}], "max_tokens": 2,
                                                     "max_completion_tokens": 3}, 400, "max_completion_tokens"),
    "chat prompt past max_model_len": ({"messages": [{"role": "user", "content": " ".join(["t7"] * 90)}]}, 400,
                                       "prompt"),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = write_tiny_llama(tmp_path_factory)  # its own copy: the test changes its files
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    template = "{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}t5"
    (d / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template=template)))
    llm = LLM(model=str(d), dtype="float32", num_pages=64, max_num_seqs=8, max_model_len=MAX_LEN)
    backend = LocalEngineBackend(llm, model_name="tiny")
    srv = BackgroundServer(backend, max_body_bytes=LIMIT).start()
    yield llm, backend, srv
    srv.stop()
    backend.close()
    assert_engine_empty(llm)


@pytest.fixture(autouse=True)
def _nothing_leaked(served):
    yield
    llm, backend, _ = served
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = asyncio.run(backend.stats())
        if not (stats.queued or stats.running or stats.pages_in_use or llm.has_unfinished()):
            break
        time.sleep(0.01)
    assert_engine_empty(llm)


def _send(srv, path: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(srv.base_url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=30)


def _check(r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error", err
    if param is not None:
        assert err["param"] == param or (err["param"] or "").startswith(param + "."), err


@pytest.mark.parametrize("name", list(ROWS))
def test_completion_row(served, name):
    patch, status, param = ROWS[name]
    _check(_send(served[2], "/v1/completions", {**BASE, **patch}), status, param)


@pytest.mark.parametrize("name", list(RAW))
def test_raw_body_row(served, name):
    body, status, param = RAW[name]
    for path in ("/v1/completions", "/v1/chat/completions"):
        _check(_send(served[2], path, body), status, param)


@pytest.mark.parametrize("name", list(CHAT))
def test_chat_row(served, name):
    patch, status, param = CHAT[name]
    _check(_send(served[2], "/v1/chat/completions", {"model": "tiny", "max_tokens": 4, **patch}), status, param)


def test_chunked_body_over_the_limit_is_413_without_content_length(served):
    def chunks():  # a generator body goes out chunked: the server counts bytes as they come
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(LIMIT // 4096 + 2):
            yield b"t5 " * 1365 + b"t"
        yield b'"}'
    r = httpx.post(served[2].base_url + "/v1/completions", content=chunks(), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text


def test_the_whole_table_while_a_stream_runs_leaves_it_unharmed(served):
    llm, _, srv = served
    prompt = MIXED[:6]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = LLM(model=llm.model_dir, dtype="float32", num_pages=64).generate([prompt], params)[0].token_ids
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True,
            "pdserve": {"ignore_eos": True, "return_token_ids": True}}
    got: list[int] = []

    def stream():
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got.extend(json.loads(line[6:])["choices"][0].get("token_ids") or [])
    t = threading.Thread(target=stream)
    t.start()
    for patch, status, param in ROWS.values():
        _check(_send(srv, "/v1/completions", {**BASE, **patch}), status, param)
    for raw, status, param in RAW.values():
        _check(_send(srv, "/v1/completions", raw), status, param)
    t.join(60)
    assert got == expected
