"""Open-loop load generator: sends each request at its arrival time over streaming `/v1/completions`,
whether or not earlier ones have answered (a closed loop would slow down with the server and hide its
queueing), and records what the client sees.

    records = asyncio.run(run_load(requests, prompt_of, target, progress=True))

Order inside `run_load`: one httpx.AsyncClient (no connection limit) -> one task per request, each sleeping
until `t0 + arrival_s` -> POST with `stream: true` and `stream_options.include_usage` -> every SSE chunk
that carries output tokens is time-stamped (`time.perf_counter()` minus t0) -> the usage chunk gives the
output token count -> `RequestRecord` (metrics.py turns it into TTFT/TPOT). Errors never raise: HTTP
errors, SSE error events, transport errors and client timeouts end the request with `error` set.
An optional `stop_when(records, now)` is polled every 0.2 s; when it fires (runner.py: the probe has
already missed too many requests to reach the attainment target), the unfinished requests are cancelled
-- their connections close, so the server aborts them -- and recorded as failed.

pdserve's own options go out only when `Target.pdserve` is true (`--spec`/`--compare`, or `--endpoint`
with `--pdserve-options`): `ignore_eos` (so every request produces exactly `max_tokens` tokens),
`return_token_ids` (exact token counts per chunk) and `timeline` (server-side events). Foreign servers get
a plain OpenAI body plus `Target.extra_body` (e.g. vLLM's `{"ignore_eos": true}`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

from cluster.bench.metrics import RequestRecord
from cluster.bench.workload import RequestSpec


@dataclass
class Target:
    base_url: str  # http://host:port (with or without /v1)
    model: str
    pdserve: bool = False  # send pdserve options (ignore_eos, timeline, return_token_ids)
    api_key: str | None = None
    extra_body: dict = field(default_factory=dict)
    timeout_s: float = 300.0  # per request, client side; a request that takes longer fails

    @property
    def completions_url(self) -> str:
        root = self.base_url.rstrip("/")
        return (root if root.endswith("/v1") else root + "/v1") + "/completions"


def request_body(target: Target, prompt, max_tokens: int) -> dict:
    body = {"model": target.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    if target.pdserve:
        body["pdserve"] = {"ignore_eos": True, "return_token_ids": True, "timeline": True}
        if target.timeout_s:
            body["pdserve"]["deadline_s"] = float(target.timeout_s)
    body.update(target.extra_body)
    return body


def _fold_chunk(rec: RequestRecord, raw: dict, now: float) -> None:
    """One SSE `data:` object into the record."""
    if "error" in raw:
        err = raw["error"]
        rec.error = f"stream error: {err.get('message') if isinstance(err, dict) else err}"
        return
    for c in raw.get("choices") or []:
        ids = c.get("token_ids")
        n = len(ids) if ids is not None else (1 if c.get("text") else 0)
        if n:
            rec.chunk_s.append(now)
            rec.chunk_tokens.append(n)
        if c.get("finish_reason"):
            rec.finish_reason = c["finish_reason"]
        if c.get("timeline"):
            rec.timeline = c["timeline"]
    usage = raw.get("usage")
    if usage:
        rec.output_tokens = int(usage.get("completion_tokens") or 0)
        rec.prompt_tokens = usage.get("prompt_tokens")


async def _stream(client: httpx.AsyncClient, target: Target, body: dict, rec: RequestRecord, t0: float) -> None:
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    async with client.stream("POST", target.completions_url, json=body, headers=headers) as r:
        if r.status_code >= 400:
            text = (await r.aread()).decode("utf-8", "replace")
            rec.error = f"HTTP {r.status_code}: {text[:300]}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            try:
                raw = json.loads(data)
            except ValueError:
                rec.error = f"bad SSE data: {data[:200]}"
                return
            _fold_chunk(rec, raw, time.perf_counter() - t0)
            if rec.error:
                return


async def send_one(client: httpx.AsyncClient, target: Target, spec: RequestSpec, prompt, t0: float,
                   rec: RequestRecord | None = None) -> RequestRecord:
    rec = rec or RequestRecord(spec.index, spec.arrival_s, spec.input_len, spec.output_len)
    delay = t0 + spec.arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    rec.sent_s, rec.sent_unix = time.perf_counter() - t0, time.time()
    try:
        await asyncio.wait_for(_stream(client, target, request_body(target, prompt, spec.output_len), rec, t0),
                               target.timeout_s)
    except asyncio.TimeoutError:
        rec.error = f"client timeout after {target.timeout_s:g} s"
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"
    if rec.error is None and not rec.output_tokens:
        rec.output_tokens = sum(rec.chunk_tokens)  # no usage chunk: count what streamed
    if rec.error is None and not rec.chunk_s:
        rec.error = "no output token"
    rec.end_s = time.perf_counter() - t0  # last: a watcher reads end_s as "this record is final"
    return rec


StopCheck = Callable[[list[RequestRecord], float], bool]


async def _watch(records: list[RequestRecord], tasks: list[asyncio.Task], stop_when: StopCheck, t0: float,
                 every_s: float = 0.2) -> None:
    while True:
        await asyncio.sleep(every_s)
        if stop_when(records, time.perf_counter() - t0):
            for t in tasks:
                t.cancel()  # in-flight streams close: the server sees a disconnect and aborts them
            return


async def run_load(requests: list[RequestSpec], prompt_of: Callable[[RequestSpec], object], target: Target,
                   progress: bool = False, desc: str = "", stop_when: StopCheck | None = None) -> list[RequestRecord]:
    """Every request at its arrival time (seconds from now); records in request order. `stop_when(records,
    now)` is polled while the load runs; once it says so, every request not yet finished is cancelled
    and recorded as failed ("stopped early")."""
    prompts = [prompt_of(s) for s in requests]  # built before t0: prompt building must not delay sends
    records = [RequestRecord(s.index, s.arrival_s, s.input_len, s.output_len) for s in requests]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc=desc, unit="req", leave=False, dynamic_ncols=True)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(target.timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()

        async def one(spec: RequestSpec, prompt, rec: RequestRecord) -> None:
            await send_one(client, target, spec, prompt, t0, rec)
            if bar is not None:
                bar.update(1)

        tasks = [asyncio.create_task(one(*args)) for args in zip(requests, prompts, records)]
        watcher = asyncio.create_task(_watch(records, tasks, stop_when, t0)) if stop_when else None
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            if watcher is not None:
                watcher.cancel()
            for t in tasks:
                t.cancel()
            if bar is not None:
                bar.close()
        now = time.perf_counter() - t0
        for rec, task in zip(records, tasks):
            if task.cancelled() or rec.end_s is None:
                rec.error = rec.error or "stopped early (the probe could no longer reach the attainment target)"
                rec.end_s = now
            elif task.exception() is not None:
                raise task.exception()
    return records


async def run_sequential(requests: list[RequestSpec], prompt_of: Callable[[RequestSpec], object],
                         target: Target) -> list[RequestRecord]:
    """One request at a time, each sent when the previous ended: the unloaded latencies."""
    out = []
    for s in requests:
        one = dataclasses.replace(s, arrival_s=0.0)
        out.extend(await run_load([one], prompt_of, target))
    return out
