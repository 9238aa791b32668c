"""Continuous-batching scheduler: `schedule()` picks the step, `update(outputs)` applies it (pure Python).

Owned by `engine.LLM` (and by workers built on it). Each `schedule()` spends a token budget: running
requests first, oldest first (one decode token each, or their next prefill chunk), then waiting requests
in arrival order while pages and sequence slots allow (admission by free pages). When a running request
needs a page and none is free, the newest running request is preempted: its pages are freed and it goes
back to the front of the queue, to be recomputed from prompt + outputs (its outputs are kept, so the
stream neither loses nor repeats a token). `update()` appends sampled tokens and applies token-level
stops; string stops are the output processor's job (it calls `finish`).

With prefix caching (`prefix`, a `kv_cache.prefix_cache.PrefixSharing`): each `schedule()` first
registers the running requests' newly full, final pages in the cache; a waiting request is admitted onto
the cached pages of its longest cached prefix and computes only the rest (admission counts the pages the
cache could give back as free); a preempted or ending request registers its pages before freeing them,
so they stay cached (evictable) for whoever comes next.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache.block_table import BlockTables, seq_owner
from engine.kv_cache.prefix_cache import PrefixSharing
from engine.request import Request, RequestStatus, SampledToken


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # index into request.token_ids of the first new token
    num_tokens: int
    num_cached: int  # slots in cache before this chunk
    sample: bool  # chunk reaches the end of the known tokens, so a token is sampled


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.chunks


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_chunked_prefills: int = 0  # prefill chunks that did not reach the end of the prompt
    num_steps: int = 0


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, tables: BlockTables, eos_token_ids: tuple[int, ...] = (),
                 prefix: PrefixSharing | None = None):
        self.cfg = cfg
        self.prefix = prefix
        self.tables = tables
        self.eos = set(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.held: dict[str, Request] = {}
        self.stats = SchedulerStats()

    # ---- intake ------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """A request whose KV is already in its block table (prefilled elsewhere)."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- schedule ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.cfg.max_num_batched_tokens
        out = SchedulerOutput([])
        if self.prefix is not None:
            for req in self.running:
                self.prefix.register(req)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(len(req.token_ids) - req.num_computed, budget)
            if n <= 0:
                i += 1
                continue
            if not self._make_room(req, n, out):
                continue  # req itself was preempted; running[i] is now the next request
            out.chunks.append(self._chunk(req, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            hit = self.prefix.probe(req) if self.prefix is not None else None
            skip = len(hit.pages) * self.tables.page_size if hit is not None else 0
            remaining = len(req.token_ids) - req.num_computed - skip
            n = min(remaining, budget)
            if n < remaining and not self.cfg.enable_chunked_prefill and not req.num_preemptions:
                break  # (a preempted request's recompute may exceed the budget: it is chunked regardless)
            if self._pages_short(req, n, hit):
                break  # admission: wait for pages
            self.waiting.popleft()
            if self.prefix is not None:
                req.num_computed += self.prefix.admit(req, hit)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(self._chunk(req, n))
            budget -= n
        self.stats.num_steps += not out.empty
        return out

    def _pages_short(self, req: Request, n: int, hit) -> bool:
        if self.prefix is not None:
            return self.prefix.pages_short(req, n, hit)
        return not self.tables.fits(req.request_id, n)

    def _make_room(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        """Free pages for `n` more slots of `req` by preempting the newest (of those whose pages share its pool,
        where the allocator has partitions); False if `req` was preempted."""
        while not self.tables.fits(req.request_id, n):
            victim = self._newest_in_pool_of(req)
            self.preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _newest_in_pool_of(self, req: Request) -> Request:
        alloc = self.tables.allocator
        if alloc.partitions == 1:
            return self.running[-1]
        p = alloc.owner_partition(seq_owner(req.request_id))  # None: req holds no page yet, any pool serves
        same = (r for r in reversed(self.running) if p is None or alloc.owner_partition(seq_owner(r.request_id)) == p)
        return next(same, self.running[-1])

    def preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._free(req)
        req.num_computed = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.stats.num_preemptions += 1

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        cached = self.tables.get(req.request_id).num_slots if req.request_id in self.tables else 0
        self.tables.append(req.request_id, n)
        sample = req.num_computed + n == len(req.token_ids)
        if not sample:
            self.stats.num_chunked_prefills += 1
        return ScheduledChunk(req, req.num_computed, n, cached, sample)

    # ---- update ------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, SampledToken], now: float) -> list[Request]:
        """Apply a step's results; returns requests that reached a token-level stop or became held."""
        ended = []
        for c in out.chunks:
            req = c.request
            if req.finished:  # ended while the step ran (a deferred stop string, an abort): its token is dropped
                continue
            req.num_computed += c.num_tokens
            if not c.sample:
                continue
            tok = sampled[req.request_id]
            req.token_ids.append(tok.token_id)
            if req.params.logprobs is not None:
                req.output_logprobs.append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            reason = self._stop_reason(req, tok.token_id)
            if reason:
                self.finish(req, reason)
                ended.append(req)
            elif req.prefill_only:
                self.running.remove(req)
                req.status = RequestStatus.HELD
                self.held[req.request_id] = req
                ended.append(req)
        return ended

    def append_output(self, req: Request, tok: SampledToken, now: float) -> str | None:
        """Append one verified token (a speculative step commits several); its token-level stop reason.
        The caller finishes the request on a reason and stops appending."""
        req.token_ids.append(tok.token_id)
        if req.params.logprobs is not None:
            req.output_logprobs.append(tok)
        if req.first_token_time is None:
            req.first_token_time = now
        return self._stop_reason(req, tok.token_id)

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        stop_token = (token in self.eos and not p.ignore_eos) or token in p.stop_token_ids
        if stop_token and req.num_output >= p.min_tokens:  # (the sampler masks them before min_tokens)
            return "stop"
        if req.num_output >= p.max_tokens:
            return "length"
        return None

    # ---- ending ------------------------------------------------------------------------------
    def finish(self, req: Request, reason: str) -> None:
        """End a request wherever it is and free its pages (idempotent)."""
        if req.status == RequestStatus.FINISHED:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        else:
            self.held.pop(req.request_id, None)
        self._free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = req.finish_reason or reason

    def _free(self, req: Request) -> None:
        if self.prefix is not None:  # its final full pages outlive it in the cache
            self.prefix.register(req)
            self.prefix.forget(req.request_id)
        self.tables.free(req.request_id)

    def truncate(self, req: Request, num_tokens: int) -> None:
        """Roll back to the first `num_tokens` tokens (rejected drafts): tokens, computed count, slots."""
        assert req.num_prompt <= num_tokens <= len(req.token_ids)
        drop = len(req.token_ids) - num_tokens
        del req.token_ids[num_tokens:]
        if drop and req.output_logprobs:
            del req.output_logprobs[max(0, len(req.output_logprobs) - drop):]
        if req.num_computed > num_tokens:
            keep = self.prefix.rollback(req, num_tokens) if self.prefix is not None else num_tokens
            cut = req.num_computed - keep
            self.tables.truncate(req.request_id, self.tables.get(req.request_id).num_slots - cut)
            req.num_computed = keep  # (below num_tokens: the rest is recomputed, off the shared page)
