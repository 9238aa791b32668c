"""Python client for a pdserve HTTP server (or any OpenAI-compatible one): `Client` and `AsyncClient`.

    client = Client("http://127.0.0.1:8000", api_key=None)
    out = client.complete("Once upon a time", max_tokens=32, temperature=0)      # Completion
    print(out.text, out.usage)
    for chunk in client.chat([{"role": "user", "content": "Hi"}], stream=True):  # Chunk per delta
        print(chunk.text, end="")
    async with AsyncClient(url) as c:
        out = await c.complete("Hi")
        async for chunk in await c.complete("Hi", stream=True): ...

Keyword arguments are the OpenAI body fields (max_tokens, temperature, top_p, n, seed, stop, logprobs,
top_logprobs, presence_penalty, frequency_penalty, stream_options, ...) and vLLM's sampling fields
(ignore_eos, min_tokens, top_k, min_p, repetition_penalty, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, max_completion_tokens), sent as given at the top level; `pdserve={...}` carries
pdserve's own options (timeline, return_token_ids, deadline_s, speculative, kv_eviction, sparse_attention). The model defaults to the
first one `/v1/models` lists. A streamed call opens the connection at once, so HTTP errors raise from the
call itself; an error the server sends mid-stream raises from the iteration. Errors are typed by status:
400/413/422 BadRequest, 401/403 Unauthorized, 404 NotFound, 429 Overloaded, 5xx ServerError, no answer
Unreachable -- all `PdserveClientError` with `status`, `message`, `type`, `param`, `code`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator

import httpx


class PdserveClientError(Exception):
    def __init__(self, status: int | None, message: str, type_: str | None = None, param: str | None = None,
                 code: str | None = None):
        super().__init__(f"{status}: {message}" if status else message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


class BadRequest(PdserveClientError):
    """400 (invalid field, named by `param`), 413 (body too large), 422."""


class Unauthorized(PdserveClientError):
    """401/403: missing or wrong API key."""


class NotFound(PdserveClientError):
    """404: unknown model or route."""


class Overloaded(PdserveClientError):
    """429: the server's queue is full; retry later."""


class ServerError(PdserveClientError):
    """5xx, or an error the server reported in the middle of a stream."""


class Unreachable(PdserveClientError):
    """No HTTP answer (connection refused, reset, timed out)."""


_BY_STATUS = {400: BadRequest, 401: Unauthorized, 403: Unauthorized, 404: NotFound, 413: BadRequest,
              422: BadRequest, 429: Overloaded}
_BY_TYPE = {"invalid_request_error": BadRequest, "authentication_error": Unauthorized,
            "rate_limit_error": Overloaded}


@dataclass
class Choice:
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict | None = None
    token_ids: list[int] | None = None  # with pdserve={"return_token_ids": True}
    timeline: dict[str, float] | None = None  # with pdserve={"timeline": True}


@dataclass
class Completion:
    id: str
    model: str
    choices: list[Choice]
    usage: dict[str, int]
    raw: dict = field(repr=False, default_factory=dict)

    @property
    def text(self) -> str:
        return self.choices[0].text


@dataclass
class Chunk:
    """One streamed delta of one choice; the usage-only chunk has index None and `usage` set."""
    index: int | None
    text: str
    finish_reason: str | None = None
    logprobs: dict | None = None
    token_ids: list[int] | None = None
    timeline: dict[str, float] | None = None
    usage: dict[str, int] | None = None
    raw: dict = field(repr=False, default_factory=dict)


# ---- shared by both clients -------------------------------------------------------------------
def _root(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _error_from_body(status: int | None, body: Any) -> PdserveClientError:
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        err = {"message": str(body)[:500]}
    cls = _BY_STATUS.get(status) if status else _BY_TYPE.get(err.get("type"), ServerError)
    if cls is None:
        cls = ServerError if status and status >= 500 else PdserveClientError
    if status is None and err.get("code") == "model_not_found":
        cls = NotFound
    return cls(status, str(err.get("message")), err.get("type"), err.get("param"), err.get("code"))


def _raise_for(status: int, content: bytes) -> None:
    if status < 400:
        return
    try:
        body = json.loads(content)
    except ValueError:
        body = content.decode("utf-8", "replace")
    raise _error_from_body(status, body)


def _body(payload: dict, model: str, stream: bool, pdserve: dict | None, params: dict) -> dict:
    body = dict(payload, model=model, **{k: v for k, v in params.items() if v is not None})
    if stream:
        body["stream"] = True
    if pdserve:
        body["pdserve"] = dict(pdserve)
    return body


def _parse(raw: dict, chat: bool) -> Completion:
    choices = [Choice(c["index"], (c["message"].get("content") or "") if chat else c["text"], c.get("finish_reason"),
                      c.get("logprobs"), c.get("token_ids"), c.get("timeline")) for c in raw["choices"]]
    return Completion(raw["id"], raw["model"], choices, raw.get("usage") or {}, raw)


def _chunks(line: str, chat: bool) -> list[Chunk] | None:
    """Chunks of one SSE line; None at `[DONE]`; raises the error event's typed error."""
    if not line.startswith("data:"):
        return []
    data = line[5:].strip()
    if data == "[DONE]":
        return None
    raw = json.loads(data)
    if "error" in raw:
        raise _error_from_body(None, raw)
    out = []
    for c in raw.get("choices", []):
        text = ((c.get("delta") or {}).get("content") or "") if chat else c.get("text", "")
        out.append(Chunk(c["index"], text, c.get("finish_reason"), c.get("logprobs"), c.get("token_ids"),
                         c.get("timeline"), raw.get("usage"), raw))
    if not out and raw.get("usage"):
        out.append(Chunk(None, "", usage=raw["usage"], raw=raw))
    return out


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# ---- sync ---------------------------------------------------------------------------------------
class Client:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0, model: str | None = None):
        self.base_url, self.model = _root(base_url), model
        self._http = httpx.Client(base_url=self.base_url, headers=_headers(api_key), timeout=timeout)

    def complete(self, prompt: str | list[int] | list[str], *, model: str | None = None, stream: bool = False,
                 pdserve: dict | None = None, **params) -> Completion | Iterator[Chunk]:
        body = _body({"prompt": prompt}, model or self._model(), stream, pdserve, params)
        return self._call("/v1/completions", body, stream, chat=False)

    def chat(self, messages: list[dict], *, model: str | None = None, stream: bool = False,
             pdserve: dict | None = None, **params) -> Completion | Iterator[Chunk]:
        body = _body({"messages": messages}, model or self._model(), stream, pdserve, params)
        return self._call("/v1/chat/completions", body, stream, chat=True)

    def models(self) -> list[str]:
        return [m["id"] for m in self._get("/v1/models")["data"]]

    def health(self) -> dict:
        return self._get("/health")

    def metrics(self) -> str:
        return self._request("GET", "/metrics").text

    def scale(self, pool: str, replicas: int) -> dict:
        """Resize a cluster's pool while it serves (the admin endpoint; needs the API key when one is set):
        {pool, replicas, added, removed} once done."""
        return self._request("POST", "/v1/pdserve/admin/scale", json={"pool": pool, "replicas": replicas}).json()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _model(self) -> str:
        if self.model is None:
            self.model = self.models()[0]
        return self.model

    def _get(self, path: str) -> dict:
        return self._request("GET", path).json()

    def _request(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise Unreachable(None, f"{self.base_url}{path}: {type(e).__name__}: {e}") from e
        _raise_for(r.status_code, r.content)
        return r

    def _call(self, path: str, body: dict, stream: bool, chat: bool):
        if not stream:
            return _parse(self._request("POST", path, json=body).json(), chat)
        try:
            r = self._http.send(self._http.build_request("POST", path, json=body), stream=True)
        except httpx.TransportError as e:
            raise Unreachable(None, f"{self.base_url}{path}: {type(e).__name__}: {e}") from e
        if r.status_code >= 400:
            r.read()
            r.close()
            _raise_for(r.status_code, r.content)
        return self._iterate(r, chat)

    @staticmethod
    def _iterate(r: httpx.Response, chat: bool) -> Iterator[Chunk]:
        try:
            for line in r.iter_lines():
                chunks = _chunks(line, chat)
                if chunks is None:
                    return
                yield from chunks
        finally:
            r.close()


# ---- async --------------------------------------------------------------------------------------
class AsyncClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0, model: str | None = None):
        self.base_url, self.model = _root(base_url), model
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=_headers(api_key), timeout=timeout)

    async def complete(self, prompt: str | list[int] | list[str], *, model: str | None = None, stream: bool = False,
                       pdserve: dict | None = None, **params) -> Completion | AsyncIterator[Chunk]:
        body = _body({"prompt": prompt}, model or await self._model(), stream, pdserve, params)
        return await self._call("/v1/completions", body, stream, chat=False)

    async def chat(self, messages: list[dict], *, model: str | None = None, stream: bool = False,
                   pdserve: dict | None = None, **params) -> Completion | AsyncIterator[Chunk]:
        body = _body({"messages": messages}, model or await self._model(), stream, pdserve, params)
        return await self._call("/v1/chat/completions", body, stream, chat=True)

    async def models(self) -> list[str]:
        return [m["id"] for m in (await self._request("GET", "/v1/models")).json()["data"]]

    async def health(self) -> dict:
        return (await self._request("GET", "/health")).json()

    async def metrics(self) -> str:
        return (await self._request("GET", "/metrics")).text

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _model(self) -> str:
        if self.model is None:
            self.model = (await self.models())[0]
        return self.model

    async def _request(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            r = await self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise Unreachable(None, f"{self.base_url}{path}: {type(e).__name__}: {e}") from e
        _raise_for(r.status_code, r.content)
        return r

    async def _call(self, path: str, body: dict, stream: bool, chat: bool):
        if not stream:
            return _parse((await self._request("POST", path, json=body)).json(), chat)
        try:
            r = await self._http.send(self._http.build_request("POST", path, json=body), stream=True)
        except httpx.TransportError as e:
            raise Unreachable(None, f"{self.base_url}{path}: {type(e).__name__}: {e}") from e
        if r.status_code >= 400:
            await r.aread()
            await r.aclose()
            _raise_for(r.status_code, r.content)
        return self._iterate(r, chat)

    @staticmethod
    async def _iterate(r: httpx.Response, chat: bool) -> AsyncIterator[Chunk]:
        try:
            async for line in r.aiter_lines():
                chunks = _chunks(line, chat)
                if chunks is None:
                    return
                for c in chunks:
                    yield c
        finally:
            await r.aclose()
