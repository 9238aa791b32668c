"""The exact request bodies of GuideLLM, AIPerf and `vllm bench serve` (tests/data/client_bodies/, issue 22)
posted through the FastAPI app in front of a fake backend: each gets a 200 and a well-formed answer, read
the way that client reads it, and the backend receives the sampling parameters the body asked for.

The fake backend answers every request with tokens 10, 11, ... one per delta up to max_tokens and keeps
the `GenerateRequest`s it got; no engine, no sockets (starlette's TestClient drives the ASGI app).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from cluster.http.app import build_app
from cluster.serving_api import BackendStats, GenerateDelta

BODIES = Path(__file__).parents[1] / "data" / "client_bodies"
FILES = sorted(BODIES.glob("*.json"))
FIELDS = ("ignore_eos", "min_tokens", "top_k", "min_p", "repetition_penalty", "temperature", "top_p",
          "presence_penalty", "frequency_penalty")


class FakeTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt=True):
        return [3 + i for i, _ in enumerate(messages)] + [5]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"t{i}" for i in ids)


class FakeBackend:
    model_name = "tiny"

    def __init__(self):
        self.requests = []

    async def generate(self, req):
        self.requests.append(req)
        n_prompt = len(req.prompt) if isinstance(req.prompt, list) else len(req.prompt.split())
        n = req.params.max_tokens
        for i in range(n):
            last = i == n - 1
            yield GenerateDelta(req.request_id, [10 + i], f" t{10 + i}", last, "length" if last else None,
                                n_prompt, i + 1)

    async def abort(self, request_id):
        pass

    def tokenizer(self):
        return FakeTokenizer()

    async def stats(self):
        return BackendStats()


@pytest.fixture(scope="module")
def app():
    backend = FakeBackend()
    with TestClient(build_app(backend)) as client:
        yield client, backend


def _events(text: str) -> list:
    lines = [ln for ln in text.split("\n") if ln]
    assert all(ln.startswith("data: ") for ln in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]


def _check_stream(events: list, chat: bool, body: dict, expected_text: str, n_prompt: int) -> None:
    opts = body.get("stream_options") or {}
    obj = "chat.completion.chunk" if chat else "text_completion"
    assert all(e["object"] == obj and e["model"] == "tiny" and "error" not in e for e in events)
    assert len({e["id"] for e in events}) == 1
    with_choices = [e for e in events if e["choices"]]
    text = "".join((e["choices"][0].get("delta") or {}).get("content") or "" if chat else e["choices"][0]["text"]
                   for e in with_choices)
    assert text == expected_text
    assert [e["choices"][0]["finish_reason"] for e in with_choices if e["choices"][0]["finish_reason"]] == ["length"]
    n_out = body.get("max_tokens") or body.get("max_completion_tokens")
    final = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
    if opts.get("include_usage"):  # a last chunk without choices carries the usage
        assert events[-1]["choices"] == [] and events[-1]["usage"] == final
    if opts.get("continuous_usage_stats"):  # every chunk carries its choice's usage so far
        counts = [e["usage"]["completion_tokens"] for e in with_choices]
        assert counts == sorted(counts) and counts[-1] == n_out
        assert all(e["usage"]["prompt_tokens"] == n_prompt and e["usage"]["total_tokens"] ==
                   n_prompt + e["usage"]["completion_tokens"] for e in with_choices)
    elif opts.get("include_usage"):
        assert all(e["usage"] is None for e in with_choices)
    # as GuideLLM and `vllm bench serve` read it: the last usage seen / the usage of a chunk without choices
    seen = [e.get("usage") for e in events if e.get("usage")]
    assert seen[-1] == final
    assert [e["usage"] for e in events if not e["choices"] and e.get("usage")] == [final]


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_client_body_gets_200_and_its_sampling_params(app, path):
    client, backend = app
    rec = json.loads(path.read_text())
    body, chat = rec["body"], rec["path"].endswith("/chat/completions")
    assert rec["source"] and rec["how"]
    backend.requests.clear()
    r = client.post(rec["path"], content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    [sub] = backend.requests
    n_out = body.get("max_tokens") or body.get("max_completion_tokens")
    expected_text = "".join(f" t{10 + i}" for i in range(n_out))
    n_prompt = len(sub.prompt) if isinstance(sub.prompt, list) else len(sub.prompt.split())
    if body.get("stream"):
        assert r.headers["content-type"].startswith("text/event-stream")
        _check_stream(_events(r.text), chat, body, expected_text, n_prompt)
    else:
        out = r.json()
        assert out["object"] == ("chat.completion" if chat else "text_completion")
        choice = out["choices"][0]
        assert (choice["message"]["content"] if chat else choice["text"]) == expected_text
        assert choice["finish_reason"] == "length"
        assert out["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                "total_tokens": n_prompt + n_out}
    p = sub.params
    assert p.max_tokens == n_out
    for name in FIELDS:
        if name in body:
            assert getattr(p, name) == body[name], name
    assert p.ignore_eos  # every recorded body asks for a fixed output length
    assert p.min_tokens == body.get("min_tokens", 0) and p.min_p == body.get("min_p", 0.0)


def test_every_client_and_both_endpoints_are_recorded():
    names = {p.stem for p in FILES}
    for client in ("guidellm", "aiperf", "vllm_bench"):
        assert any(n.startswith(f"{client}_completions") for n in names), client
        assert any(n.startswith(f"{client}_chat") for n in names), client
    assert {"guidellm", "aiperf"} <= {n.split("_")[0] for n in names if not json.loads(
        (BODIES / f"{n}.json").read_text())["body"].get("stream")}, "non-streamed bodies"
