"""`build_app(backend, ...)`: the OpenAI-compatible FastAPI app in front of any `ServingBackend`.

Routes:
    POST /v1/completions, /v1/chat/completions   handlers.handle (stream or not)
    GET  /v1/models, /v1/models/{id}             the one model the backend serves
    GET  /health                                  200 {"status": "ok" | "degraded", ...} (never needs the API
                                                  key; a cluster adds its pools: live, target, why, since)
    GET  /metrics                                 Prometheus text (metrics.FrontendMetrics)
    GET  /v1/pdserve/timeline/{response_id}       per-choice timelines of a recent response (debug)
    POST /v1/pdserve/admin/scale                  resize a cluster's pool while serving (admin.py)

Every error answer is an OpenAI error body (`errors.HTTPError`): typed pdserve errors map to 400/404/429/
503/504, unknown routes to 404, anything unexpected to 500. With `api_key` set, every route but /health
needs `Authorization: Bearer <key>` (checked by `_ApiKeyGuard` with `hmac.compare_digest`, before the body
is read). `cluster/server.py` runs the app under uvicorn.
"""
from __future__ import annotations

import hmac
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.http.admin import install_admin
from cluster.http.errors import HTTPError, from_exception
from cluster.http.handlers import ClientGone, FrontendContext, handle
from cluster.http.metrics import FrontendMetrics, TimelineStore
from cluster.serving_api import ServingBackend
from engine.errors import PdserveError

log = logging.getLogger("pdserve.http")
DEFAULT_MAX_BODY_BYTES = 2 << 20
_OPEN_PATHS = ("/health",)


class _ApiKeyGuard:
    """Pure ASGI middleware: 401 unless the bearer token equals the API key (constant-time compare)."""

    def __init__(self, app, api_key: str, metrics: FrontendMetrics):
        self.app, self.key, self.metrics = app, api_key.encode(), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(token, self.key):
                self.metrics.count_error(401)
                err = HTTPError(401, "missing or invalid API key (send `Authorization: Bearer <key>`)",
                                "authentication_error", code="invalid_api_key")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(backend: ServingBackend, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              default_max_tokens: int = 16, default_chat_max_tokens: int = 256,
              timeline_capacity: int = 1024) -> FastAPI:
    """The app; `default_*max_tokens` apply when a request names none (OpenAI's completions default is 16)."""
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    ctx = FrontendContext(backend, FrontendMetrics(), TimelineStore(timeline_capacity), max_body_bytes,
                          {"completion": default_max_tokens, "chat": default_chat_max_tokens})
    app.state.pdserve = ctx
    if api_key:
        app.add_middleware(_ApiKeyGuard, api_key=api_key, metrics=ctx.metrics)
    _install_error_handlers(app, ctx)
    created = int(time.time())

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, ctx, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, ctx, "chat")

    def model_card() -> dict:  # (`root`, as vLLM's card has it: `vllm bench serve` reads it)
        return {"id": backend.model_name, "object": "model", "created": created, "owned_by": "pdserve",
                "root": backend.model_name, "parent": None}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != backend.model_name:
            raise HTTPError(404, f"model {model_id!r} is not served here", param="model", code="model_not_found")
        return model_card()

    @app.get("/health")
    async def health():
        stats = await backend.stats()
        out = {"status": "ok", "queued": stats.queued, "running": stats.running}
        if stats.health is not None:  # a cluster: "degraded" while a pool lacks workers (pools say why, since)
            out.update(status=stats.health["status"], pools=stats.health["pools"])
        return out

    @app.get("/metrics")
    async def metrics():
        ctx.metrics.refresh(await backend.stats())
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/pdserve/timeline/{response_id}")
    async def timeline(response_id: str):
        found = ctx.timelines.get(response_id)
        if found is None:
            raise HTTPError(404, f"no timeline kept for {response_id!r}", param="response_id")
        return {"id": response_id, "timelines": found}

    install_admin(app, backend)
    return app


def _install_error_handlers(app: FastAPI, ctx: FrontendContext) -> None:
    def answer(err: HTTPError) -> JSONResponse:
        ctx.metrics.count_error(err.status)
        return err.response()

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, e: HTTPError):
        return answer(e)

    @app.exception_handler(PdserveError)
    async def _typed(request: Request, e: PdserveError):
        return answer(from_exception(e))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, e: ClientGone):
        return Response(status_code=499)  # nobody reads it; uvicorn drops it

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(request: Request, e: StarletteHTTPException):
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return answer(HTTPError(e.status_code, str(e.detail), kind))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return answer(HTTPError(400, str(e.errors()[:1])))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return answer(from_exception(e))
