"""Run the HTTP frontend under uvicorn: in the foreground (`serve_backend`) or in a thread (`BackgroundServer`).

    serve_backend(backend, host="127.0.0.1", port=8000, api_key=None)   # blocks until Ctrl-C
    with BackgroundServer(backend) as srv:                              # tests: ephemeral port
        Client(srv.base_url).complete(...)

Binds 127.0.0.1 unless told otherwise; a non-loopback host without an API key is refused with
`InsecureBindError` (field `api_key`) by `_config`, which every path to uvicorn goes through (these two and
`cluster/launch.py`), before any socket opens; the spec's `server` section enforces the same rule.
`BackgroundServer` binds its socket before the thread starts, so `port` is known at once and port 0 picks a
free one; `stop()` asks uvicorn to exit, waits for open connections to finish, and joins the thread. Neither stops the backend: its owner shuts it down.
"""
from __future__ import annotations

import socket
import threading
import time

import uvicorn

from cluster.http.app import DEFAULT_MAX_BODY_BYTES, build_app
from cluster.serving_api import ServingBackend
from engine.errors import PdserveError
from kv_transfer.config import LOOPBACK_HOSTS  # one list of loopback names for HTTP, KV plane and spec


class InsecureBindError(PdserveError, ValueError):
    """The HTTP frontend was asked to listen beyond loopback without an API key; `field` is "api_key"."""

    def __init__(self, host: str):
        self.field, self.host = "api_key", host
        super().__init__(f"api_key: required to listen on {host!r} (beyond loopback); set server.api_key "
                         f"(e.g. {{env: PDSERVE_API_KEY}}) or bind 127.0.0.1")


def _check_bind(host: str, api_key: str | None) -> None:
    if host not in LOOPBACK_HOSTS and not api_key:
        raise InsecureBindError(host)


def _config(backend: ServingBackend, host: str, port: int, api_key: str | None, max_body_bytes: int,
            log_level: str, **app_kw) -> uvicorn.Config:
    _check_bind(host, api_key)  # every caller, so no path reaches uvicorn with an open wide bind
    app = build_app(backend, api_key=api_key, max_body_bytes=max_body_bytes, **app_kw)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=5, lifespan="off")


def serve_backend(backend: ServingBackend, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                  max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, log_level: str = "info", **app_kw) -> None:
    """Serve until interrupted (uvicorn handles SIGINT/SIGTERM)."""
    uvicorn.Server(_config(backend, host, port, api_key, max_body_bytes, log_level, **app_kw)).run()


class BackgroundServer:
    """uvicorn in a daemon thread on an already-bound socket; `stop()` shuts it down cleanly."""

    def __init__(self, backend: ServingBackend, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, log_level: str = "warning", **app_kw):
        _check_bind(host, api_key)  # before the socket below opens
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(_config(backend, host, self.port, api_key, max_body_bytes, log_level,
                                             **app_kw))
        self.app = self.server.config.app
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                        name=f"pdserve-http-{self.port}", daemon=True)

    @property
    def base_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            self.stop()
            raise RuntimeError(f"uvicorn did not start on {self.base_url} within {timeout}s")
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
