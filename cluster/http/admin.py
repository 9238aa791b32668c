"""Admin routes of the frontend: resizing a cluster's pools while it serves (`pdserve scale` calls this).

    POST /v1/pdserve/admin/scale   {"pool": "decode", "replicas": 2}
        200 {"pool", "replicas", "added": [worker names], "removed": [worker names]} once the resize is done
        400 naming the field: an unknown pool, replicas not an integer, below 1 or above the pool's
            max_replicas, a resize of that pool already under way, a malformed body -- nothing changed
        401 without `Authorization: Bearer <key>` when the server has an API key (`app._ApiKeyGuard` guards
            every route but /health); 404 when the backend has no pools (one in-process engine)
        503 when a new worker cannot be placed or started (the workers that did join stay)

Who calls it: `app.build_app` installs it; the backend's `scale(pool, replicas)` does the work
(`cluster/serving/scaling.py`).
"""
from __future__ import annotations

import json

from fastapi import FastAPI, Request

from cluster.http.errors import HTTPError
from cluster.serving_api import ServingBackend

MAX_BODY_BYTES = 4096


def install_admin(app: FastAPI, backend: ServingBackend) -> None:
    @app.post("/v1/pdserve/admin/scale")
    async def scale(request: Request):
        scale_fn = getattr(backend, "scale", None)
        if scale_fn is None:
            raise HTTPError(404, "this server runs one engine in-process: it has no pools to resize",
                            code="not_found")
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            raise HTTPError(413, f"the body exceeds {MAX_BODY_BYTES} bytes")
        try:
            data = json.loads(body or b"null")
        except ValueError:
            raise HTTPError(400, "the body is not JSON; send {\"pool\": NAME, \"replicas\": N}") from None
        if not isinstance(data, dict):
            raise HTTPError(400, "the body must be a JSON object {\"pool\": NAME, \"replicas\": N}")
        unknown = sorted(set(data) - {"pool", "replicas"})
        if unknown:
            raise HTTPError(400, f"unknown key(s): {', '.join(unknown)} (send pool and replicas)", param=unknown[0])
        for key, kind in (("pool", str), ("replicas", int)):
            value = data.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise HTTPError(400, f"{key}: required, {'a string' if kind is str else 'an integer'} "
                                     f"(got {value!r})", param=key)
        return await scale_fn(data["pool"], data["replicas"])  # (typed errors: the app's handlers)
