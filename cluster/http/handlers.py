"""`POST /v1/completions` and `POST /v1/chat/completions`: body -> sub-requests -> JSON or SSE.

Life of one HTTP request (`handle`):
    read_json        body size checked against the limit before parsing (413), then JSON (400)
    parse_request    openai_schema: strict pydantic, unsupported / internal / unknown fields -> 400
    _plan            one GenerateRequest per choice: prompts x n, seeds seed+j, chat messages templated to ids
    Merged           every sub-request's backend stream runs as a task; items come out as (choice, delta)
    first item       awaited before any byte is sent (while watching for disconnect), so validation,
                     404 and 429 errors become proper HTTP errors even for `stream: true`
    stream           SSE chunks (`data: {...}`; each with its choice's usage so far under
                     `stream_options.continuous_usage_stats`), the usage chunk under `include_usage`,
                     `data: [DONE]`; an error after the first byte goes out as `data: {"error": ...}`
    non-stream       all deltas folded into choices, one JSON body
Any early exit (client disconnect, error, cancellation) cancels the sub-request tasks; the backend's
generate() then aborts each request, which frees its pages.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Literal

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from cluster.http.errors import HTTPError, from_exception
from cluster.http.formatting import ChoiceState, Formatter
from cluster.http.metrics import FrontendMetrics, TimelineStore
from cluster.http.openai_schema import ChatRequest, CompletionRequest, in_body, parse_request, sampling_params
from cluster.serving_api import GenerateDelta, GenerateRequest, ServingBackend
from engine.errors import InvalidRequestError, PdserveError, UnknownModelError

log = logging.getLogger("pdserve.http")
MAX_CHOICES = 64  # prompts x n per HTTP request
Kind = Literal["completion", "chat"]


@dataclass
class FrontendContext:
    backend: ServingBackend
    metrics: FrontendMetrics
    timelines: TimelineStore
    max_body_bytes: int
    default_max_tokens: dict[str, int]
    template_lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, c: ChoiceState) -> None:
        self.metrics.observe_finished(c.finish_reason, c.prompt_tokens, c.completion_tokens, c.timeline)


@dataclass
class _Plan:
    response_id: str
    subs: list[GenerateRequest]
    groups: list[int]  # prompt index of each choice (usage counts a prompt once)


class ClientGone(Exception):
    """The HTTP client disconnected; nothing is answered."""


async def read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise HTTPError(400, "Content-Length is not a number")
        if int(length) > limit:
            raise HTTPError(413, f"request body of {length} bytes exceeds the limit of {limit}",
                            code="request_too_large")
    buf = bytearray()
    async for chunk in request.stream():  # chunked bodies have no Content-Length: count as they come
        buf += chunk
        if len(buf) > limit:
            raise HTTPError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
    try:
        return json.loads(buf)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HTTPError(400, f"body is not valid JSON: {e}", param="body") from None
    except RecursionError:  # `[[[[...` nested past Python's stack: a hostile body, not a server fault
        raise HTTPError(400, "body is not valid JSON: nested too deeply", param="body") from None


def _apply_template(ctx: FrontendContext, messages: list[dict]) -> list[int]:
    with ctx.template_lock:  # the HF tokenizer is not safe to use from several threads at once
        try:
            return ctx.backend.tokenizer().apply_chat_template(messages, add_generation_prompt=True)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as e:
            raise InvalidRequestError("messages", f"chat template failed: {e}") from None


async def _plan(ctx: FrontendContext, req: CompletionRequest | ChatRequest, kind: Kind) -> _Plan:
    if req.model != ctx.backend.model_name:
        raise UnknownModelError(req.model, f"this server serves {ctx.backend.model_name!r}")
    if isinstance(req, ChatRequest):
        msgs = [m.as_template_dict() for m in req.messages]
        prompts: list = [await asyncio.to_thread(_apply_template, ctx, msgs)]
        prefix = "chatcmpl"
    else:
        prompts, prefix = req.prompts(), "cmpl"
    if len(prompts) * req.n > MAX_CHOICES:
        raise InvalidRequestError("n", f"{len(prompts)} prompts x n={req.n} exceeds {MAX_CHOICES} choices")
    response_id = f"{prefix}-{uuid.uuid4().hex}"
    subs, groups = [], []
    for p_index, prompt in enumerate(prompts):
        for j in range(req.n):
            params = sampling_params(req, j, ctx.default_max_tokens[kind])
            subs.append(GenerateRequest(f"{response_id}-{len(subs)}", prompt, params, model=req.model,
                                        deadline_s=req.pdserve.deadline_s, return_timeline=True))
            groups.append(p_index)
    return _Plan(response_id, subs, groups)


class Merged:
    """Every sub-request's backend stream as a task; `next()` gives (choice index, delta), None at the end.
    `req` (the parsed body) names an engine error's field where the body has it (`in_body`)."""

    def __init__(self, backend: ServingBackend, subs: list[GenerateRequest],
                 req: CompletionRequest | ChatRequest | None = None):
        self.backend, self.req = backend, req
        self.queue: asyncio.Queue = asyncio.Queue()
        self.remaining = len(subs)
        self.tasks = [asyncio.create_task(self._pump(i, r)) for i, r in enumerate(subs)]

    async def _pump(self, index: int, req: GenerateRequest) -> None:
        try:
            async for delta in self.backend.generate(req):
                self.queue.put_nowait((index, delta))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which maps it to an HTTP answer
            self.queue.put_nowait((index, in_body(e, self.req) if isinstance(e, InvalidRequestError) else e))

    async def next(self) -> tuple[int, GenerateDelta] | None:
        if self.remaining == 0:
            return None
        index, item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            self.remaining -= 1
        return index, item

    def close(self) -> None:
        for t in self.tasks:
            t.cancel()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(request: Request, coro):
    """Run `coro`; if the client disconnects first, cancel it and raise ClientGone."""
    work, watch = asyncio.ensure_future(coro), asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
    if work in done:
        return work.result()
    raise ClientGone()


async def handle(request: Request, ctx: FrontendContext, kind: Kind):
    req = parse_request(await read_json(request, ctx.max_body_bytes), kind)
    plan = await _plan(ctx, req, kind)
    want_lp = req.logprobs if isinstance(req, ChatRequest) else req.logprobs is not None
    so = req.stream_options if req.stream else None
    fmt = Formatter(kind, plan.response_id, req.model, int(time.time()), ctx.backend.tokenizer(), want_lp,
                    req.pdserve.return_token_ids, req.pdserve.timeline, bool(so and so.include_usage),
                    bool(so and so.continuous_usage_stats))
    choices = [ChoiceState(i) for i in range(len(plan.subs))]
    merged = Merged(ctx.backend, plan.subs, req)
    try:
        first = await _until_disconnect(request, merged.next())
        if req.stream:
            return StreamingResponse(_sse(ctx, plan, merged, fmt, choices, first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await _until_disconnect(request, _collect(merged, choices, first))
    except BaseException:
        merged.close()
        raise
    merged.close()
    for c in choices:
        ctx.observe(c)
    ctx.timelines.put(plan.response_id, [c.timeline for c in choices])
    return JSONResponse(fmt.response(choices, plan.groups))


async def _collect(merged: Merged, choices: list[ChoiceState], item) -> None:
    while item is not None:
        index, delta = item
        choices[index].add(delta)
        item = await merged.next()


def _event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _sse(ctx: FrontendContext, plan: _Plan, merged: Merged, fmt: Formatter, choices: list[ChoiceState],
               item) -> AsyncIterator[str]:
    try:
        if fmt.kind == "chat":  # (one prompt: the first delta's prompt count is every choice's)
            for c in choices:
                yield _event(fmt.role_chunk(c.index, item[1].prompt_tokens))
        while item is not None:
            index, delta = item
            c = choices[index]
            c.add(delta)
            chunk = fmt.chunk(c, delta)
            if chunk is not None:
                yield _event(chunk)
            if delta.finished:
                ctx.observe(c)
            item = await merged.next()
        if fmt.include_usage:
            yield _event(fmt.usage_chunk(choices, plan.groups))
        ctx.timelines.put(plan.response_id, [c.timeline for c in choices])
        yield "data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 - headers are sent: the error travels as an SSE event
        err = from_exception(e)
        if not isinstance(e, PdserveError):
            log.exception("stream %s failed", plan.response_id)
        ctx.metrics.count_error(err.status)
        yield _event(err.body())
        yield "data: [DONE]\n\n"
    finally:
        merged.close()
