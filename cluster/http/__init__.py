"""OpenAI-compatible HTTP frontend: `build_app(backend)` (app.py) over any `ServingBackend`.

Modules: app (routes, auth, error handlers) -> handlers (request flow, SSE) -> openai_schema (request
models), formatting (response JSON), metrics (Prometheus, timelines), errors (OpenAI error bodies).
"""
from cluster.http.app import build_app

__all__ = ["build_app"]
