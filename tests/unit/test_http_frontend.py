"""The OpenAI-compatible HTTP frontend, `LocalEngineBackend` and the Python client on a tiny random model.

A real uvicorn serves each backend on 127.0.0.1 (ephemeral port, loopback only). Greedy tokens over HTTP
must equal `engine.LLM.generate` on the same weights; streamed deltas concatenate to the non-streamed
text; bad input gets OpenAI-style 400/401/404/413/429 bodies while in-flight requests finish unharmed.
Every test ends with the engine empty (no pages, reservations or requests left).
"""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import torch

from cluster.client import AsyncClient, BadRequest, Client, NotFound, Overloaded, Unauthorized
from cluster.local_backend import LocalEngineBackend
from cluster.server import BackgroundServer
from cluster.serving_api import BackendUnavailableError, GenerateRequest
from engine import SamplingParams
from engine.llm import LLM
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.prompts import COUNT, MIXED, SHORT
from tests.tiny_models import write_tiny_llama

KEY = "test-key-123"
TEMPLATE = "{% for m in messages %}t3 {{ m['content'] }} t4 {% endfor %}{% if add_generation_prompt %}t5{% endif %}"
PROMPTS = [MIXED[:6], SHORT, COUNT[:30], [100, 7, 7, 8]]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """The tiny Llama with a chat template (its own copy: the shared `tiny_dir` has none)."""
    d = write_tiny_llama(tmp_path_factory, "chat")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template=TEMPLATE)))
    return d


def _serve(chat_dir, **kw):
    llm = LLM(model=str(chat_dir), dtype="float32", num_pages=256, max_num_seqs=16)
    backend = LocalEngineBackend(llm, model_name="tiny", max_queued=kw.pop("max_queued", 64))
    return llm, backend, BackgroundServer(backend, **kw).start()


def _settle(llm, backend) -> None:
    """Wait for aborts in flight to reach the engine thread, then the leak check."""
    def busy():
        stats = asyncio.run(backend.stats())
        return stats.queued or stats.running or stats.pages_in_use or llm.has_unfinished()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and busy():
        time.sleep(0.01)
    stats = asyncio.run(backend.stats())
    assert stats.queued == stats.running == 0, f"backend requests left: {stats}"
    assert_engine_empty(llm)


@pytest.fixture(scope="module")
def served(chat_dir):
    llm, backend, srv = _serve(chat_dir, max_body_bytes=64 * 1024)
    yield llm, backend, srv
    srv.stop()
    backend.close()
    assert_engine_empty(llm)


@pytest.fixture(scope="module")
def guarded(chat_dir):
    llm, backend, srv = _serve(chat_dir, api_key=KEY, max_queued=2)
    yield llm, backend, srv
    srv.stop()
    backend.close()
    assert_engine_empty(llm)


@pytest.fixture(autouse=True)
def _no_leaks(request):
    yield
    for name in ("served", "guarded"):
        if name in request.fixturenames:
            llm, backend, _ = request.getfixturevalue(name)
            _settle(llm, backend)


@pytest.fixture(scope="module")
def reference(chat_dir):
    llm = LLM(model=str(chat_dir), dtype="float32", num_pages=256, keep_logits=True)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    assert_engine_empty(llm)
    return [o.token_ids for o in outs], [torch.stack(o.logits) for o in outs]


def _post(srv, path, body, key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(srv.base_url + path, json=body, headers=headers, timeout=60)


GREEDY = dict(max_tokens=12, temperature=0, pdserve={"ignore_eos": True, "return_token_ids": True})


# ---- exactness and streaming -------------------------------------------------------------------
def test_greedy_over_http_matches_engine_single_and_concurrent(served, reference):
    _, _, srv = served
    ref_tokens, ref_logits = reference
    client = Client(srv.base_url)
    single = [client.complete(p, **GREEDY).choices[0].token_ids for p in PROMPTS]
    assert_greedy_equal(ref_tokens, single, ref_logits)
    streamed = [[t for c in client.complete(p, stream=True, **GREEDY) for t in c.token_ids or []] for p in PROMPTS]
    assert_greedy_equal(ref_tokens, streamed, ref_logits)

    async def concurrent():
        async with AsyncClient(srv.base_url) as ac:
            async def one(i):
                p = PROMPTS[i % len(PROMPTS)]
                if i % 2:
                    return [t for c in [c async for c in await ac.complete(p, stream=True, **GREEDY)]
                            for t in c.token_ids or []]
                return (await ac.complete(p, **GREEDY)).choices[0].token_ids
            return await asyncio.gather(*(one(i) for i in range(16)))
    got = asyncio.run(concurrent())
    assert_greedy_equal([ref_tokens[i % 4] for i in range(16)], got, [ref_logits[i % 4] for i in range(16)])


@pytest.mark.parametrize("chat", [False, True])
def test_stream_deltas_concatenate_to_nonstreamed_text_with_usage(served, chat):
    client = Client(served[2].base_url)
    call = (lambda **kw: client.chat([{"role": "user", "content": "t9 t10 t11"}], **kw)) if chat else \
        (lambda **kw: client.complete("t5 t6 t7 t8", **kw))
    full = call(max_tokens=20, temperature=0, pdserve={"ignore_eos": True})
    chunks = list(call(max_tokens=20, temperature=0, pdserve={"ignore_eos": True}, stream=True,
                       stream_options={"include_usage": True}))
    assert "".join(c.text for c in chunks) == full.text and full.text
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"] == [full.choices[0].finish_reason]
    assert chunks[-1].index is None and chunks[-1].usage == full.usage
    assert full.usage["completion_tokens"] == 20
    assert full.usage["total_tokens"] == full.usage["prompt_tokens"] + 20
    assert all(c.usage is None for c in chunks[:-1])


def test_n_choices_and_seed_reproducibility(served):
    client = Client(served[2].base_url)
    kw = dict(max_tokens=10, temperature=1.0, pdserve={"ignore_eos": True})
    a = client.complete("t5 t6", n=2, seed=7, **kw)
    b = client.complete("t5 t6", n=2, seed=7, **kw)
    c = client.complete("t5 t6", seed=8, **kw)
    assert [x.index for x in a.choices] == [0, 1]
    assert [x.text for x in a.choices] == [x.text for x in b.choices]
    assert a.choices[1].text == c.text  # choice i samples with seed + i
    assert a.usage["completion_tokens"] == 20 and a.usage["prompt_tokens"] == 2
    streamed = {}
    for ch in client.complete("t5 t6", n=2, seed=7, stream=True, **kw):
        streamed[ch.index] = streamed.get(ch.index, "") + ch.text
    assert streamed == {0: a.choices[0].text, 1: a.choices[1].text}


def test_stop_strings_are_held_back_until_resolved(served):
    client = Client(served[2].base_url)
    base = client.complete("t5 t6 t7", max_tokens=16, temperature=0, pdserve={"ignore_eos": True}).text
    words = base.split(" ")
    stop = f"{words[3]} {words[4][:2]}"  # spans two tokens: " t.." is streamed before it is known to stop
    expected = base[:base.find(stop)]
    kw = dict(max_tokens=16, temperature=0, stop=[stop, "zz"], pdserve={"ignore_eos": True})
    full = client.complete("t5 t6 t7", **kw)
    chunks = list(client.complete("t5 t6 t7", stream=True, **kw))
    assert full.text == expected and full.choices[0].finish_reason == "stop"
    assert "".join(c.text for c in chunks) == expected
    assert not any(stop[:3] in c.text for c in chunks)


def test_backend_directly_and_shutdown_with_requests_in_flight(chat_dir):
    llm = LLM(model=str(chat_dir), dtype="float32", num_pages=64)
    backend = LocalEngineBackend(llm, model_name="tiny")
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def run():
        gen = backend.generate(GenerateRequest("a", [5, 6, 7], params, model="tiny"))
        first = await gen.__anext__()
        assert first.prompt_tokens == 3 and len(first.new_token_ids) == 1
        await backend.shutdown()
        with pytest.raises(BackendUnavailableError):
            async for _ in gen:
                pass
        with pytest.raises(BackendUnavailableError):
            await backend.generate(GenerateRequest("b", [5], params, model="tiny")).__anext__()
    asyncio.run(run())
    assert_engine_empty(llm)


def test_logprobs_shapes(served):
    client = Client(served[2].base_url)
    out = client.complete("t5 t6", max_tokens=4, temperature=0, logprobs=2, pdserve={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 4
    assert all(len(d) == 2 and lp["tokens"][i] in d for i, d in enumerate(lp["top_logprobs"]))
    assert "".join(lp["tokens"]) == out.text
    chat = client.chat([{"role": "user", "content": "t9"}], max_tokens=3, temperature=0, logprobs=True,
                       top_logprobs=2, pdserve={"ignore_eos": True})
    content = chat.choices[0].logprobs["content"]
    assert len(content) == 3 and all(set(c) == {"token", "logprob", "bytes", "top_logprobs"} for c in content)
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
    streamed = [c.logprobs for c in client.chat([{"role": "user", "content": "t9"}], max_tokens=3, temperature=0,
                                                logprobs=True, stream=True, pdserve={"ignore_eos": True})]
    assert sum(len(x["content"]) for x in streamed if x) == 3


def test_timeline_option_and_debug_endpoint(served):
    client = Client(served[2].base_url)
    out = client.complete("t5", max_tokens=3, temperature=0, pdserve={"timeline": True, "ignore_eos": True})
    tl = out.choices[0].timeline
    assert tl["queued"] <= tl["engine_added"] <= tl["first_token"] <= tl["finish"]
    got = httpx.get(f"{served[2].base_url}/v1/pdserve/timeline/{out.id}").json()
    assert got["timelines"] == [tl]


def test_deadline_ends_with_timeout(served):
    _, backend, srv = served
    backend.pause()
    try:
        fut = _in_thread(lambda: _post(srv, "/v1/completions", {"model": "tiny", "prompt": "t5", "max_tokens": 50,
                                                               "pdserve": {"deadline_s": 0.01, "ignore_eos": True}}))
        _wait_for(lambda: asyncio.run(backend.stats()).queued == 1)
        time.sleep(0.05)  # past the deadline while held
    finally:
        backend.resume()
    r = fut()
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "timeout"


def test_client_disconnect_aborts_and_frees_pages(served):
    llm, backend, srv = served
    aborted = asyncio.run(backend.stats()).extra["requests_aborted"]
    with httpx.stream("POST", srv.base_url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "t5", "max_tokens": 400, "stream": True,
                            "pdserve": {"ignore_eos": True}}) as r:
        next(r.iter_lines())
    _wait_for(lambda: asyncio.run(backend.stats()).extra["requests_aborted"] == aborted + 1)
    backend.pause()  # a non-streamed request whose client gives up while it waits in the queue
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.base_url + "/v1/completions", json={"model": "tiny", "prompt": "t5", "max_tokens": 400},
                       timeout=httpx.Timeout(10, read=0.3))
    finally:
        backend.resume()
    _wait_for(lambda: asyncio.run(backend.stats()).extra["requests_aborted"] == aborted + 2)
    # the autouse leak check then asserts the engine is empty


# ---- errors ------------------------------------------------------------------------------------
BAD = [
    ({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_p": "0.5"}, "top_p"),
    ({"unknown_thing": 1}, "unknown_thing"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"), ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"ignore_eos": "yes"}, "ignore_eos"), ({"reservation_id": "r1"}, "reservation_id"),
    ({"use_beam_search": True}, "use_beam_search"), ({"min_p": 2}, "min_p"),
    ({"top_k": 3, "pdserve": {"top_k": 4}}, "top_k"),
    ({"pdserve": {"kv_transfer_params": {}}}, "pdserve.kv_transfer_params"), ({"pdserve": {"nope": 1}}, "pdserve.nope"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 100000}, "max_tokens"), ({"n": 0}, "n"),
    ({"prompt": [5, 999999]}, "prompt"), ({"stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize("patch,param", BAD, ids=[p for _, p in BAD])
def test_bad_fields_get_400_naming_them(served, patch, param):
    r = _post(served[2], "/v1/completions", {"model": "tiny", "prompt": "t5", "max_tokens": 4, **patch})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and param.split(".")[-1] in err["message"]


def test_other_errors_404_413_invalid_json_and_typed_client_errors(served):
    srv = served[2]
    r = _post(srv, "/v1/completions", {"model": "gpt-4", "prompt": "t5"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = _post(srv, "/v1/completions", {"model": "tiny", "prompt": "t5 " * 40000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(srv.base_url + "/v1/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = _post(srv, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "tool", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    assert httpx.get(srv.base_url + "/nowhere").json()["error"]["message"] == "Not Found"
    client = Client(srv.base_url)
    with pytest.raises(BadRequest) as e:
        client.complete("t5", temperature=-2)
    assert e.value.param == "temperature"
    with pytest.raises(NotFound):
        client.complete("t5", model="other")
    with pytest.raises(BadRequest):
        client.chat([{"role": "user", "content": "t5"}], stream=True, tools=[{"type": "function"}])


def test_api_key_429_and_inflight_requests_unharmed(guarded, reference):
    _, backend, srv = guarded
    assert _post(srv, "/v1/completions", {"model": "tiny", "prompt": "t5"}).status_code == 401
    assert _post(srv, "/v1/completions", {"model": "tiny", "prompt": "t5"}, key="wrong").status_code == 401
    assert httpx.get(srv.base_url + "/metrics").status_code == 401
    assert httpx.get(srv.base_url + "/health").status_code == 200  # liveness needs no key
    with pytest.raises(Unauthorized):
        Client(srv.base_url, api_key="wrong").complete("t5", model="tiny")
    client = Client(srv.base_url, api_key=KEY)
    backend.pause()  # hold the engine so two requests sit in the queue
    try:
        streamed = _in_thread(lambda: list(client.complete(PROMPTS[0], stream=True, **GREEDY)))
        plain = _in_thread(lambda: client.complete(PROMPTS[1], **GREEDY))
        _wait_for(lambda: asyncio.run(backend.stats()).queued == 2)
        r = _post(srv, "/v1/completions", {"model": "tiny", "prompt": "t5"}, key=KEY)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        with pytest.raises(Overloaded):
            client.complete("t5")
        for patch, _ in BAD[:6]:  # bad requests while others are in flight
            assert _post(srv, "/v1/completions", {"model": "tiny", "prompt": "t5", **patch}, key=KEY).status_code == 400
    finally:
        backend.resume()
    got = [[t for c in streamed() for t in c.token_ids or []], plain().choices[0].token_ids]
    assert_greedy_equal(reference[0][:2], got, reference[1][:2])


# ---- models, health, metrics, openai SDK -------------------------------------------------------
def test_models_health_and_metrics(served):
    srv = served[2]
    Client(srv.base_url).complete("t5", max_tokens=3)
    assert httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"] == "tiny"
    assert httpx.get(srv.base_url + "/v1/models/tiny").json()["id"] == "tiny"
    assert httpx.get(srv.base_url + "/health").json()["status"] == "ok"
    text = httpx.get(srv.base_url + "/metrics").text
    for name in ("pdserve_time_to_first_token_seconds_bucket", "pdserve_time_per_output_token_seconds",
                 "pdserve_e2e_request_latency_seconds", "pdserve_request_phase_seconds", "pdserve_requests_queued",
                 "pdserve_requests_running", "pdserve_kv_pages_in_use", "pdserve_kv_transfer_bytes",
                 "pdserve_kv_transfer_seconds", "pdserve_preemptions_total", "pdserve_requests_total",
                 "pdserve_http_errors_total"):
        assert name in text, name


def test_official_openai_sdk(served):
    openai = pytest.importorskip("openai")
    sdk = openai.OpenAI(base_url=served[2].base_url + "/v1", api_key="unused", max_retries=0)
    out = sdk.completions.create(model="tiny", prompt="t5 t6", max_tokens=6, temperature=0,
                                 extra_body={"pdserve": {"ignore_eos": True}})
    parts = sdk.completions.create(model="tiny", prompt="t5 t6", max_tokens=6, temperature=0, stream=True,
                                   extra_body={"pdserve": {"ignore_eos": True}})
    assert "".join(c.choices[0].text for c in parts if c.choices) == out.choices[0].text
    chat = sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t9"}], max_tokens=5,
                                       temperature=0, seed=1)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t9"}],
                                    response_format={"type": "json_object"})
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="nope", prompt="t5")


# ---- helpers -----------------------------------------------------------------------------------
def _in_thread(fn):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            box["error"] = e
    t = threading.Thread(target=run)
    t.start()

    def result():
        t.join(60)
        if "error" in box:
            raise box["error"]
        return box["value"]
    return result


def _wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)
