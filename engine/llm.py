"""`LLM`: a single-process engine (scheduler + runner), used standalone and as the colocated baseline.

    llm = LLM(model="smollm2-135m", dtype="float32", page_size=16, num_pages=512)  # kv_storage="int8"|"fp8"
    llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", revision="main")  # a Hub id (engine/hub.py)
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))

Step API for servers: `add_request()` -> repeated `step()` (each returns a `RequestOutput` for every
request that advanced) -> `abort()` at any time. Entry points for disaggregation: `add_request(...,
prefill_only=True)` ends HELD with its pages kept until `release_held()`; `reserve()` +
`add_prefilled_request()` join a request whose KV was written into reserved pages by someone else.
`enable_prefix_caching=True` shares full pages of repeated prefixes between requests
(`engine/kv_cache/prefix_cache.py`); `prefix_stats()`, `reset_prefix_cache()`. `sparse_attention={"method":
"quest", "budget": 1024, ...}` lets decode steps read only the pages Quest picks (`engine/kv_cache/sparse.py`);
a request's `params.sparse_attention` ("off" or fields) changes it for its own rows (`sparse_config.py`).
`decode_graphs`: "auto" (CUDA graphs for plain decode steps on a GPU), "static" (the same step eagerly), "off".
Options are an `EngineConfig` (engine/engine_config.py): `LLM(model, **fields)` or `LLM(EngineConfig(...))`;
request intake (prompt and parameter checks) lives in engine/intake.py.
"""
from __future__ import annotations

import time

import torch

from engine.batch import SeqResult, SeqStep, StepBatch, StepOutput
from engine.engine_config import EngineConfig
from engine.errors import InvalidRequestError
from engine.intake import RequestIntake
from engine import kernels
from engine.kernels.cuda.graph_decode import attach as attach_graphs
from engine.kv_cache.allocator import PageAllocator, Reservation
from engine.kv_cache.backend import make_backend
from engine.kv_cache.block_table import BlockTables, seq_owner
from engine.kv_cache.prefix_cache import PrefixCache, PrefixSharing, prefix_salt
from engine.evictor import Evictor
from engine.kv_cache.eviction_policy import EvictionPolicy
from engine.kv_cache.sparse import SparseAttentionConfig, install as install_sparse
from engine.kv_cache.sparse_config import step_rows as sparse_rows
from engine.kv_cache.spec import KVPageSpec
from engine.loader import fingerprint, load_config, load_weights, resolve_model
from engine.parallel.validate import expert_attention_of
from engine.forward import build_forward
from engine.outputs import OutputProcessor, RequestOutput
from engine.request import Request, RequestStatus, SampledToken
from engine.runner import ModelRunner
from engine.sampler import SampleRequest
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.spec_decode.config import SpeculativeConfig
from engine.tokenizer import Tokenizer


class LLM:
    def __init__(self, model: "str | EngineConfig" = "smollm2-135m", *, clock=time.monotonic, **options):
        cfg = model.with_options(**options) if isinstance(model, EngineConfig) else EngineConfig(model, **options)
        self.engine_config = cfg
        (model, dtype, device, page_size, num_pages, max_num_seqs, max_num_batched_tokens, max_model_len,
         enable_chunked_prefill, num_threads, keep_logits, speculative, kv_storage, kv_eviction,
         enable_prefix_caching, sparse_attention, tensor_parallel_size, pipeline_parallel_size, revision,
         decode_graphs) = (
            cfg.model, cfg.dtype, cfg.device, cfg.page_size, cfg.num_pages, cfg.max_num_seqs,
            cfg.max_num_batched_tokens, cfg.max_model_len, cfg.enable_chunked_prefill, cfg.num_threads,
            cfg.keep_logits, cfg.speculative, cfg.kv_storage, cfg.kv_eviction, cfg.enable_prefix_caching,
            cfg.sparse_attention, cfg.tensor_parallel_size, cfg.pipeline_parallel_size, cfg.revision, cfg.decode_graphs)
        if num_threads:
            torch.set_num_threads(num_threads)
        self.model_name = model  # as given: what the OpenAI API's `model` field names
        self.model_dir = resolve_model(model, revision)
        self.config = load_config(self.model_dir)
        self.dtype = dtype
        self.fingerprint = fingerprint(self.model_dir, dtype)
        self.tokenizer = Tokenizer(self.model_dir)
        self.tensor_parallel_size = tp = tensor_parallel_size  # > 1: ranks in processes of their own
        self.pipeline_parallel_size = pp = pipeline_parallel_size  # > 1: layer stages, one process each
        self.expert_parallel_size = ep = cfg.expert_parallel_size  # > 1: expert ranks, attention on each
        parallel = (tp, pp, ep) != (1, 1, 1)
        self.expert_attention = expert_attention_of(cfg.expert_attention, tp, ep)  # None: no expert ranks
        if kv_storage == "kivi4" and parallel:  # rank processes have no allocator to release staging with
            raise InvalidRequestError("kv_storage", "'kivi4' does not run with tensor/pipeline parallelism yet")
        if kv_storage == "kivi4" and kv_eviction is not None:
            raise InvalidRequestError("kv_eviction", "cannot be combined with kv_storage 'kivi4': compaction would "
                                                     "move cells across the per-page key groups; use int8 or fp8")
        if parallel:
            from engine.parallel.tp_runner import check_supported, make_parallel_runner

            check_supported(self.config, tp, speculative, kv_eviction, pp, ep)
        self.model = None if parallel else build_forward(self.config, load_weights(self.model_dir), _torch_dtype(dtype), device)
        self.max_model_len = min(max_model_len or self.config.max_position, self.config.max_position)
        ranks_pools = ep if self.expert_attention == "data" else 1  # pools the pages split over, one per rank
        if num_pages is None:  # per pool
            num_pages = ranks_pools * max(-(-16384 // page_size), -(-self.max_model_len // page_size))
        num_pages = -(-num_pages // ranks_pools) * ranks_pools  # (rounded up to split evenly)
        c = self.config
        self.kv_spec = KVPageSpec(c.num_layers, c.num_kv_heads, c.head_dim, page_size, dtype, kv_storage,
                                  cell_align=kernels.cell_align(kv_storage))
        self.allocator = PageAllocator(num_pages, clock=clock, partitions=ranks_pools)
        self.backend = None if parallel else make_backend(self.kv_spec, num_pages, device)  # parallel: one per rank
        if hasattr(self.backend, "release_pages"):  # kivi4: staging copies go with the pages (kv_cache/kivi.py)
            self.allocator.add_unheld_hook(lambda page: self.backend.release_pages([page]))
        self.tables = BlockTables(self.allocator, page_size)
        self.sparse_attention = SparseAttentionConfig.of(sparse_attention)  # decode reads chosen pages (kv_cache/sparse)
        if self.sparse_attention is not None:
            if parallel or kv_storage == "kivi4":
                raise InvalidRequestError("sparse_attention", "runs on raw, int8 or fp8 pages without tensor/"
                                                              "pipeline parallelism (page summaries live in the backend)")
            install_sparse(self.backend, self.allocator, self.tables, self.sparse_attention)
        self.runner = (ModelRunner(self.model, self.backend, page_size, cfg.sampler) if not parallel else
                       make_parallel_runner(self.model_dir, c, dtype, self.kv_spec, num_pages, tp, pp, device, ep,
                                            self.expert_attention))
        spec_cfg = SpeculativeConfig.of(speculative)
        verify_len = spec_cfg.max_draft + 1 if spec_cfg is not None else 0  # verify steps get graphs too
        self.decode_graphs = None if parallel else attach_graphs(self.runner, max_num_seqs, self.max_model_len,
                                                                 decode_graphs, verify_len)
        eos = tuple(c.eos_token_ids) or ((self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id is not None else ())
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill),
                                   self.tables, eos)
        self.outputs = OutputProcessor(self.tokenizer)
        self.requests: dict[str, Request] = {}
        self._deferred: list[Request] = []  # sampled by a step that overlapped the host: not emitted yet
        self.clock = clock
        self.keep_logits = keep_logits  # tests: keep each sampled position's float32 logits on the request
        self.eviction = EvictionPolicy.of(kv_eviction)  # which KV survives (kv_cache/eviction, engine/evictor)
        self.evictor = Evictor(self, self.eviction)
        self.prefix_cache: PrefixCache | None = None  # full pages shared by a hash chain of their tokens
        if enable_prefix_caching:
            self.prefix_cache = PrefixCache(self.allocator, page_size,
                                            prefix_salt(self.fingerprint, self.kv_spec.signature(), page_size))
            self.scheduler.prefix = PrefixSharing(self.prefix_cache, self.tables, self._prefix_cacheable)
        self.spec = None  # draft-verify decoding (engine/spec_decode), when configured
        if spec_cfg is not None:
            from engine.spec_decode.step import SpecDecoder, SpecHost

            host = SpecHost(c, self.model_dir, dtype, torch.device(device).type, self.runner, self.backend,
                            self.tables, self.allocator, self.scheduler, self.outputs, self.requests, keep_logits,
                            clock, self._batch, self._finish_step, self._output)
            self.spec = SpecDecoder(host, spec_cfg)
        self.intake = RequestIntake(self.tokenizer, c.vocab_size, self.max_model_len, page_size,
                                    num_pages // ranks_pools * page_size, kv_storage, self.backend is not None, self.scheduler,
                                    self.sparse_attention, self.spec)

    # ---- intake (engine/intake.py) -------------------------------------------------------------
    def check_request(self, n_prompt: int, params: SamplingParams, prefill_only: bool = False) -> None:
        """InvalidRequestError if a prompt of `n_prompt` tokens with `params` can never run here."""
        self.intake.check(n_prompt, params, prefill_only)

    def _new_request(self, prompt, params: SamplingParams | None, request_id: str | None, prefill_only=False):
        return self.intake.new_request(prompt, params, request_id, self.requests, self.clock(), prefill_only)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, prefill_only: bool = False) -> str:
        req = self._new_request(prompt, params, request_id, prefill_only)
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        return req.request_id

    # ---- disaggregation entry points ---------------------------------------------------------
    def reserve(self, num_tokens: int, lease_s: float = 30.0, token_ids: list[int] | None = None) -> Reservation:
        """Hold pages for `num_tokens` of KV arriving from elsewhere (OutOfPagesError if none).
        `token_ids` (the prompt; prefix caching on): the pages of its cached prefix are shared into the
        reservation instead, so only tokens from `num_shared * page_size` on need shipping; the KV must
        then not be evicted/compacted (no `num_slots`), and nothing may write into the shared pages."""
        pages = []
        if token_ids is not None and self.prefix_cache is not None:
            pages = self.prefix_cache.lookup_to_admit(token_ids, num_tokens // self.kv_spec.page_size)[0]
        return self.allocator.reserve(self.tables.pages_for(num_tokens) - len(pages), lease_s, pages)

    def add_prefilled_request(self, prompt_token_ids: list[int], first_token_id: int, reservation_id: str,
                              params: SamplingParams | None = None, request_id: str | None = None,
                              num_slots: int | None = None, num_computed: int | None = None) -> str:
        """Join a request whose prompt KV is already in the reserved pages; decoding starts next step.
        `num_slots`: the prefill side evicted KV and the pages hold only that many (kept) tokens, at the
        front; the reservation's surplus pages go back to the pool. `num_computed`: the pages hold the KV of
        the first that many prompt tokens only (kivi4 ships whole pages, `kv_cache/kivi.py`); the next step
        computes the rest of the prompt with the first token, into the reservation's pages."""
        req = self._new_request(prompt_token_ids, params, request_id)
        tok = self.intake.tokens([first_token_id])[0]
        if num_slots is not None and not 0 < num_slots <= req.num_prompt:
            raise InvalidRequestError("num_slots", f"{num_slots} for a {req.num_prompt}-token prompt")
        if num_computed is not None and (num_slots is not None or not 0 <= num_computed <= req.num_prompt):
            raise InvalidRequestError("num_computed", f"{num_computed} for a {req.num_prompt}-token prompt"
                                      + (" (not with num_slots)" if num_slots is not None else ""))
        shared = self.allocator.get_reservation(reservation_id).num_shared
        if num_slots is not None and shared:
            raise InvalidRequestError("num_slots", "evicted KV cannot join a reservation on cached prefix pages")
        if num_computed is not None and num_computed < shared * self.kv_spec.page_size:
            raise InvalidRequestError("num_computed", f"{num_computed} is inside the {shared} cached prefix pages "
                                                      "shared into the reservation (nothing may write them)")
        if shared and self.prefix_cache is not None:
            self.prefix_cache.stats.shared_received_pages += shared  # pages no one had to ship
        pages = self.allocator.commit(reservation_id, seq_owner(req.request_id))
        self.tables.adopt(req.request_id, pages, req.num_prompt)
        if num_slots is not None:
            self.tables.truncate(req.request_id, num_slots)
        if num_computed is not None:  # the tail's slots are not written yet; its page stays (next step fills it)
            self.tables.get(req.request_id).num_slots = num_computed
        req.token_ids.append(tok)
        if req.params.logprobs is not None:  # the prefill side holds its logprob; keep outputs aligned
            req.output_logprobs.append(SampledToken(tok))
        req.num_computed = req.num_prompt if num_computed is None else num_computed
        req.first_token_time = self.clock()
        self.requests[req.request_id] = req
        self.scheduler.add_running(req)
        return req.request_id

    def held_pages(self, request_id: str) -> tuple[list[int], int]:
        """Page table and slot count of a HELD prefill-only request (to ship its KV)."""
        t = self.tables.get(request_id)
        return list(t.pages), t.num_slots

    def release_held(self, request_id: str) -> None:
        req = self.scheduler.held.get(request_id)
        if req is not None:
            self.scheduler.finish(req, "stop")
            self.requests.pop(request_id, None)
            self.evictor.release(request_id)

    # ---- stepping ----------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._deferred)

    def step(self) -> list[RequestOutput]:
        """One engine step; its outputs. A step that runs behind the host (a static-shape decode step on a
        GPU) has its tokens detokenized during the next step, while the device computes that one: its
        outputs come one step later, and a stop string found then discards the one token computed past it."""
        self.allocator.expire()
        sched = self.scheduler.schedule()
        if sched.empty or self.spec is not None:
            earlier = self._emit(self._detokenize_deferred())
            return earlier + (self.spec.step(sched) if not sched.empty else [])
        pending = self.runner.launch(self._batch(sched))
        done = self._detokenize_deferred()  # the host's share that overlaps the device's
        out = pending.wait()
        earlier = self._emit(done)  # before the update: a request a stop string ended takes no more tokens
        return earlier + self._finish_step(sched, out.results, out.observations, defer=pending.overlaps)

    def _finish_step(self, sched: SchedulerOutput, results: list[SeqResult],
                     observations: dict | None = None, defer: bool = False) -> list[RequestOutput]:
        """Apply a plain step's results (one sampled token per sampling chunk); the outputs (none when
        `defer`: the next step detokenizes them)."""
        self.evictor.apply(sched.chunks, observations or {})
        sampled = {r.request_id: r.sampled for r in results if r.sampled is not None}
        if self.keep_logits:
            for c, r in zip(sched.chunks, results):
                if c.sample and not c.request.finished:
                    c.request.logits.append(r.logits[-1].clone())
        self.scheduler.update(sched, sampled, self.clock())
        sampling = [c.request for c in sched.chunks if c.sample]
        if defer:
            self._deferred = sampling
            return []
        return [self._output(req) for req in sampling]

    def _detokenize_deferred(self) -> list[tuple[Request, RequestOutput | None]]:
        """The deferred requests' outputs (aborted ones dropped); None for one whose text hit a stop string
        while it runs: `_emit` ends it once the step in flight is done with its pages."""
        reqs, self._deferred = self._deferred, []
        done = []
        for r in reqs:
            if self.requests.get(r.request_id) is r:
                hit = self.outputs.advance(r)
                done.append((r, None if hit and not r.finished else self._output(r, False)))
        return done

    def _emit(self, done: list[tuple[Request, RequestOutput | None]]) -> list[RequestOutput]:
        return [out if out is not None else self._output(req, True) for req, out in done]

    def _batch(self, sched: SchedulerOutput) -> StepBatch:
        seqs, observe = [], self.evictor.observe(sched)
        for c in sched.chunks:
            req = c.request
            sample = None
            if c.sample:
                sample = SampleRequest(req.params, req.seed, req.num_output, req.prompt_token_ids,
                                       req.output_token_ids, self.eos_token_ids)
            seqs.append(SeqStep(req.request_id, req.token_ids[c.start:c.start + c.num_tokens], c.start,
                                c.num_cached, self.tables.get(req.request_id).pages,
                                [c.num_tokens - 1] if c.sample else [], sample))
        return StepBatch(seqs, return_logits=self.keep_logits, observe=observe or None,
                         sparse=sparse_rows(self.sparse_attention, (c.request for c in sched.chunks)))

    def will_evict(self, request_id: str) -> bool:
        """Will this request's prompt KV be thinned at the end of its prefill (policy on, prompt long
        enough)? The KV sender asks, to ship the kept pages once instead of each layer as computed."""
        req = self.requests.get(request_id)
        return req is not None and self.evictor.will_evict(req)

    @property
    def eos_token_ids(self) -> set[int]:
        """The ids that end a request (the scheduler's); the sampler masks them while under min_tokens."""
        return self.scheduler.eos

    @property
    def num_evicted_tokens(self) -> int:
        return self.evictor.num_evicted_tokens

    def _output(self, req: Request, stop_hit: bool | None = None) -> RequestOutput:
        """`stop_hit`: `outputs.advance(req)` already run (a deferred step's text), else run here."""
        if (self.outputs.advance(req) if stop_hit is None else stop_hit) and not req.finished:
            self.scheduler.finish(req, "stop")
        if req.finished:
            self.requests.pop(req.request_id, None)
            self.evictor.release(req.request_id)
        out = self.outputs.make_output(req)
        if req.status == RequestStatus.HELD:
            self.outputs.forget(req.request_id)  # a held prefill produces no more text
        return out

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req, "abort")
            self.outputs.forget(request_id)
        self.evictor.release(request_id)
        if self.spec is not None:
            self.spec.release(request_id)

    def execute(self, batch: StepBatch) -> StepOutput:
        """Run a hand-built batch (tests and workers that schedule for themselves)."""
        return self.runner.execute(batch)

    def generate_until_idle(self) -> list[RequestOutput]:
        """Step until nothing is queued or running; every output produced, in order."""
        return [o for _ in iter(self.has_unfinished, False) for o in self.step()]

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        prompts = [prompts] if single else list(prompts)
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[i] for i in ids]

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Shut down the rank processes of a parallel engine; nothing to do for one process."""
        if hasattr(self.runner, "close"):
            self.runner.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- introspection -----------------------------------------------------------------------
    def kv_usage(self) -> dict[str, int]:
        """pages_in_use: held by a request or reservation; with prefix caching also cached_pages (held by
        the cache, some of them also in use) and evictable_pages (cache only: counted free, not in use)."""
        u = {"pages_in_use": self.allocator.num_in_use, "reservations": self.allocator.num_reservations,
             "num_pages": self.allocator.num_pages}
        if self.prefix_cache is not None:
            u.update(cached_pages=len(self.prefix_cache), evictable_pages=self.allocator.num_evictable)
        if self.sparse_attention is not None:  # page summaries beside the pages
            u["summary_bytes"] = self.backend.summaries.nbytes()
        return u

    # ---- prefix caching ----------------------------------------------------------------------
    def _prefix_cacheable(self, req: Request) -> bool:
        """Requests whose KV is evicted/compacted neither share nor register pages (slots != tokens)."""
        return self.evictor.policy_of(req) is None

    def prefix_stats(self) -> dict[str, float]:
        """Queried/hit tokens, hit rate, prefill tokens saved, cached/evictable/evicted pages; {} if off."""
        if self.prefix_cache is None:
            return {}
        d = self.prefix_cache.stats.as_dict()
        d.update(cached_pages=len(self.prefix_cache), evictable_pages=self.allocator.num_evictable,
                 kv_bytes_not_received=d["shared_received_pages"] * self.kv_spec.bytes_per_page())
        return d

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """Leading tokens of `token_ids` whose KV this engine's prefix cache holds (0 if off)."""
        return self.prefix_cache.cached_prefix_tokens(token_ids) if self.prefix_cache is not None else 0

    def reset_prefix_cache(self) -> int:
        """Drop every cached page (pages still in use stay with their requests); how many were cached."""
        return self.scheduler.prefix.reset() if self.prefix_cache is not None else 0

    def spec_stats(self) -> dict[str, float]:
        """Speculation metrics (acceptance rate, tokens per verify, share of steps speculated, ...); {} if off."""
        return self.spec.stats.as_dict() if self.spec is not None else {}


def _torch_dtype(name: str) -> torch.dtype:
    if name not in ("float32", "bfloat16", "float16"):
        raise InvalidRequestError("dtype", f"{name!r} is not one of float32, bfloat16, float16")
    return getattr(torch, name)
