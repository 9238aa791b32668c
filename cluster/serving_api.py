"""The contract between the HTTP frontend / Python client side and whatever serves requests.

The frontend (`cluster/http/`) turns an OpenAI request into a `GenerateRequest` and consumes the
`GenerateDelta` stream of a `ServingBackend`; backends are `LocalEngineBackend` (one in-process
`engine.LLM`, used by tests and `pdserve generate`), and the Ray router (disaggregated or colocated pools).
Plain dataclasses only: they cross Ray actor boundaries and the frontend never sees a live engine.

Life of a call: frontend builds GenerateRequest -> backend.generate(req) yields GenerateDelta items
(each with the new tokens and text since the previous one; the last has finished=True) -> on client
disconnect the frontend calls backend.abort(request_id) -> the backend frees every page and lease.
Errors: the backend raises engine.errors.InvalidRequestError (400, names the field), OverloadedError
(429), UnknownModelError (404), RequestTimeoutError (408/504 by the frontend's choice) -- all typed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol

from engine.errors import PdserveError
from engine.sampling_params import SamplingParams

# Timeline entries that are counts, not unix times (cluster router, from the decode worker): KV payload
# bytes shipped for the request, and the most KV pages it held on its decode (or colocated) worker at once.
TIMELINE_COUNTS = ("kv_bytes", "kv_pages")

class OverloadedError(PdserveError):
    """The queue limit is reached; the client should retry later (HTTP 429)."""


class RequestTimeoutError(PdserveError):
    """The request's deadline passed before it finished; its pages were freed."""


class BackendUnavailableError(PdserveError):
    """No worker can take the request (all failed or shutting down) (HTTP 503)."""


@dataclass
class GenerateRequest:
    request_id: str
    prompt: str | list[int]  # text, or token ids (chat requests arrive already templated as ids)
    params: SamplingParams
    model: str = "smollm2-135m"
    deadline_s: float | None = None  # seconds from arrival; None = the server default
    return_timeline: bool = False  # include the per-request timeline in the final delta


@dataclass
class GenerateDelta:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "timeout"
    prompt_tokens: int = 0
    completion_tokens: int = 0  # total so far
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None  # new tokens only
    timeline: dict[str, float] | None = None  # event -> unix time (queued, first_token, finish, ...); and
    # the TIMELINE_COUNTS (kv_bytes, kv_pages) where the backend reports them


@dataclass
class BackendStats:
    queued: int = 0
    running: int = 0
    pages_in_use: int = 0
    num_pages: int = 0
    preemptions: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    # cluster backends: {"status": "ok" | "degraded", "pools": {pool: {live, target, pending, degraded,
    # reason, since (unix s)}}} -- what /health and /metrics say about the pools; None: nothing to say
    health: dict | None = None
    # cluster backends with `autoscaling.enabled`: `autoscaler.Autoscaler.status()` (per pool target, current,
    # need, forecast_rate, correction, failed; decision counts by (pool, direction, reason)); None: off
    autoscaling: dict | None = None


class ServingBackend(Protocol):
    model_name: str

    def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    def tokenizer(self): ...  # engine.tokenizer.Tokenizer of the served model (chat templates, counts)

    async def stats(self) -> BackendStats: ...

    async def shutdown(self) -> None: ...
