"""OpenAI-style error bodies and the typed-error -> HTTP status map.

Every error the frontend returns has the body `{"error": {"message", "type", "param", "code"}}`, the shape
the official openai SDK parses into its `APIStatusError` subclasses. `app.py` raises `HTTPError` for its
own checks (auth, body size, JSON) and passes backend/engine exceptions through `from_exception`.
"""
from __future__ import annotations

from fastapi.responses import JSONResponse

from cluster.serving_api import BackendUnavailableError, OverloadedError, RequestTimeoutError
from engine.errors import InvalidRequestError, PdserveError, UnknownModelError


class HTTPError(Exception):
    """An error the frontend answers directly with `status` and an OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 429 else None
        if self.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_exception(e: BaseException) -> HTTPError:
    """Map a typed pdserve error (or anything else, as a 500) to the HTTP answer."""
    if isinstance(e, HTTPError):
        return e
    if isinstance(e, UnknownModelError):
        return HTTPError(404, str(e), param="model", code="model_not_found")
    if isinstance(e, InvalidRequestError):
        return HTTPError(400, str(e), param=e.field, code="invalid_value")
    if isinstance(e, OverloadedError):
        return HTTPError(429, str(e), "rate_limit_error", code="rate_limit_exceeded")
    if isinstance(e, RequestTimeoutError):
        return HTTPError(504, str(e), "timeout_error", code="timeout")
    if isinstance(e, BackendUnavailableError):
        return HTTPError(503, str(e), "server_error", code="service_unavailable")
    if isinstance(e, PdserveError):
        return HTTPError(500, str(e), "server_error", code="internal_error")
    return HTTPError(500, f"internal error: {type(e).__name__}", "server_error", code="internal_error")
