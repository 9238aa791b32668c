"""Parts of the cluster spec (`cluster/spec.py`) that configure the engine of a pool replica: KV pages (size,
count, storage format, eviction, prefix caching), sparse decode attention and draft-verify decoding; a
rank's Ray `resources`; the `routing` section (prefix-aware placement); the `reliability` section (dead-peer detection,
request recovery, Ray actor restarts), read by `cluster/serving/actors.py` into `RouterConfig` and actor options;
plus the strict base section every spec model derives from and `_fail_if`, which turns cross-field
problems into a `SpecError`.
"""
from __future__ import annotations

import re
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster.spec_errors import Problem, SpecError


class _Section(BaseModel):
    # strict: YAML already types its scalars, so "8000" (a string) for a port is a mistake worth naming;
    # allow_inf_nan off: YAML's .inf / .nan pass `gt=0` bounds (an infinite deadline is never a real choice)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
    _blank_is_default: ClassVar[tuple[str, ...]] = ()  # keys where `key:` with nothing under it means {}

    @model_validator(mode="before")
    @classmethod
    def _blank_sections(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls._blank_is_default:
            return {k: {} if v is None and k in cls._blank_is_default else v for k, v in data.items()}
        return data


def _fail_if(problems: list[Problem]) -> None:
    if problems:
        raise SpecError(problems)  # pydantic wraps it; spec_errors re-roots its keys at this model


RAY_RESERVED = {"CPU": "use num_cpus", "GPU": "use num_gpus", "memory": "Ray's own resource",
                "object_store_memory": "Ray's own resource"}
# Ray labels a node with accelerator type T by the node resource `accelerator_type:T` (1 on a node with such
# devices: detected by `ray start`, or given with --resources); a task or actor asks for a token share of it
# (what Ray's own `.options(accelerator_type=T)` asks), so it never limits how many land on one node.
ACCELERATOR_PREFIX = "accelerator_type:"
ACCELERATOR_SHARE = 0.001
_ACCELERATOR_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")  # Ray's names: A100, H100, L40S, A100-80G


class Resources(_Section):
    """Ray resources of one rank of a replica (a replica reserves tensor_parallel x pipeline_parallel x
    expert_parallel times these; one process each: the replica's actor, or a rank process it starts), never the
    pool's."""
    num_cpus: float = Field(1.0, ge=0)  # one torch thread per worker process
    num_gpus: float = Field(0.0, ge=0)
    custom: dict[str, float] = Field(default_factory=dict)  # e.g. {prefill: 1}: `ray start --resources`
    # the machine type the pool runs on, by Ray's name (A100, H100, L40S, ...): only nodes offering the
    # resource `accelerator_type:<name>` take its replicas (placement: cluster/serving/placement.py)
    accelerator_type: str | None = None
    _blank_is_default = ("custom",)

    @model_validator(mode="after")
    def _check(self) -> "Resources":
        problems = [Problem(f"custom.{k}", f"reserved by Ray ({RAY_RESERVED[k]})") for k in self.custom
                    if k in RAY_RESERVED]
        problems += [Problem(f"custom.{k}", f"must be > 0 (got {v!r}); remove the key to not ask for it")
                     for k, v in self.custom.items() if v <= 0]
        t = self.accelerator_type
        if t is not None and not _ACCELERATOR_NAME.match(t):
            problems.append(Problem("accelerator_type", f"{t!r} is not an accelerator type name: use Ray's name "
                                                        f"(letters, digits, '-', '_', '.'; e.g. A100, H100, L40S)"))
        elif t is not None and any(k.startswith(ACCELERATOR_PREFIX) for k in self.custom):
            problems.append(Problem("accelerator_type", f"set together with a custom {ACCELERATOR_PREFIX}* "
                                                        f"resource; name the type once, here"))
        _fail_if(problems)
        return self

    def ray_custom(self) -> dict[str, float]:
        """Ray resources other than CPU and GPU of one rank: `custom` and the accelerator type's share."""
        t = {ACCELERATOR_PREFIX + self.accelerator_type: ACCELERATOR_SHARE} if self.accelerator_type else {}
        return {**self.custom, **t}

    def actor_options(self) -> dict[str, Any]:
        """Keyword arguments for `ActorClass.options(...)`."""
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "resources": self.ray_custom()}


class SparseAttentionSpec(_Section):
    """`sparse_attention:` on a decode or colocated pool: decode steps read only the KV pages Quest picks
    (engine/kv_cache/sparse.py); every token's KV is kept. Requests may change it for themselves
    (`pdserve.sparse_attention`) only where this is on (the pool then keeps page summaries)."""
    method: Literal["quest"] = "quest"
    budget: int = Field(1024, ge=1, le=1 << 22)  # tokens of top-scored pages read; a multiple of kv.page_size
    sink_pages: int = Field(1, ge=0)  # first pages always read
    recent: int = Field(64, ge=0)  # the last `recent` slots always read
    min_context: int = Field(0, ge=0)  # shorter contexts read every page
    select_per: Literal["kv_head", "row"] = "kv_head"  # row: one choice for all KV heads (the paged kernel)
    gqa: Literal["max", "sum"] = "max"
    selection_layers: tuple[int, ...] = ()  # only these layers choose, the others reuse (TidalDecode)
    dense_layers: int = Field(0, ge=0)  # the first layers read every page (Quest: 2); requests cannot change it

    @field_validator("selection_layers", mode="before")
    @classmethod
    def _layers(cls, v: Any) -> Any:
        if isinstance(v, list):  # YAML lists; strict mode takes tuples only
            v = tuple(v)
        if isinstance(v, tuple) and any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in v):
            raise ValueError(f"must be a list of layer ids >= 0, got {list(v)!r}")
        return v

    def engine_config(self) -> dict[str, Any]:
        """The `sparse_attention` keyword of `engine.LLM` (plain data: it crosses to Ray actors)."""
        return {**self.model_dump(), "selection_layers": list(self.selection_layers)}


def sparse_problems(spec) -> list[Problem]:
    """`ClusterSpec` cross-checks of each pool's sparse attention (keys rooted at the spec)."""
    return [Problem(f"pools.{name}.{p.key}", p.reason) for name, pool in spec.pools_in_use().items()
            for p in _pool_sparse_problems(pool, name)]


def _pool_sparse_problems(pool, name: str) -> list[Problem]:
    sa = pool.sparse_attention
    if sa is None:
        return []
    if name == "prefill":
        return [Problem("sparse_attention", "prefill reads every page (sparse attention is for decode steps); "
                                            "set it on pools.decode")]
    out, ps = [], pool.kv.page_size
    if sa.budget % ps:
        out.append(Problem("sparse_attention.budget", f"{sa.budget} is not a multiple of kv.page_size ({ps}); "
                                                      f"use e.g. {max(1, sa.budget // ps) * ps}"))
    if pool.kv.storage == "kivi4":
        out.append(Problem("sparse_attention", "kivi4 pages keep no page summaries; use storage raw, int8 or fp8"))
    if pool.degree > 1:
        out.append(Problem("sparse_attention", "not with tensor/pipeline/expert parallelism yet (page summaries "
                                               "live in the single-process KV backend)"))
    return out


class KVPages(_Section):
    page_size: int = Field(16, ge=1, le=1024)  # tokens per KV page
    # pages per replica: 16k tokens, ~380 MB for SmolLM2 in bf16. The cap stops an absurd count before the
    # pool is allocated (2^24 pages of 16 tokens of SmolLM2 is ~6 TB).
    num_pages: int = Field(1024, ge=1, le=1 << 24)
    # page format, also the KV wire format (int8/fp8: ~0.52x of bf16; kivi4: 4-bit KIVI, ~0.33x, no eviction)
    storage: Literal["raw", "int8", "fp8", "kivi4"] = "raw"
    eviction: "EvictionSpec | None" = None  # thin prompt KV at the end of prefill (prefill/colocated pools)
    # share full pages of repeated prompt prefixes (engine/kv_cache/prefix_cache.py); in a disaggregated
    # cluster the decode side then receives only the KV past what it holds
    prefix_caching: bool = False

    @model_validator(mode="after")
    def _check(self) -> "KVPages":
        if self.prefix_caching and self.eviction is not None:
            _fail_if([Problem("prefix_caching", "cannot be combined with kv.eviction on the same pool yet: evicted "
                                                "KV no longer lines up with its tokens, so its pages cannot be "
                                                "shared; turn one of them off")])
        if self.storage == "kivi4" and self.eviction is not None:
            _fail_if([Problem("eviction", "cannot be combined with storage kivi4: compaction would move cells "
                                          "across its per-page key groups; use int8 or fp8 with eviction")])
        return self


class EvictionSpec(_Section):
    """`kv.eviction`: which prompt tokens' KV survive the prefill (engine/kv_cache/eviction.py)."""
    method: Literal["snapkv", "streaming", "h2o"] = "snapkv"
    budget: float = Field(0.3, gt=0)  # <= 1: share of the prompt kept; > 1: tokens kept
    min_prompt: int = Field(256, ge=1)  # shorter prompts keep every token
    window: int = Field(32, ge=1)  # snapkv: observation window, always kept
    pool: int = Field(7, ge=1)  # snapkv: max-pool kernel over token scores (odd)
    sinks: int = Field(4, ge=0)  # streaming: first tokens always kept
    slack: int = Field(16, ge=1)  # h2o: evict during decode once keep + slack slots are held

    @field_validator("pool")
    @classmethod
    def _odd(cls, v: int) -> int:
        if v % 2 == 0:
            raise ValueError(f"must be odd (a centred window), got {v}")
        return v


class SpeculativeSpec(_Section):
    """Draft-verify decoding in a decode or colocated pool (engine.spec_decode.SpeculativeConfig)."""
    proposer: Literal["ngram", "recycling", "draft_model", "self_sparse"] = "ngram"
    max_draft: int = Field(4, ge=1, le=16)  # draft tokens per request per step, at most
    adaptive: bool = True  # per-request draft length from its acceptance
    gate: bool = True  # speculate only when the measured verify cost says it pays for the batch
    draft_model: str | None = Field(None, min_length=1)  # proposer draft_model: a model with the same tokenizer

    @model_validator(mode="after")
    def _check(self) -> "SpeculativeSpec":
        if self.proposer == "draft_model" and self.draft_model is None:
            _fail_if([Problem("draft_model", "required with proposer: draft_model (a model name, HF directory "
                                             "or .gguf with the served model's tokenizer)")])
        if self.proposer != "draft_model" and self.draft_model is not None:
            _fail_if([Problem("draft_model", f"only used with proposer: draft_model (proposer is {self.proposer})")])
        return self

    def engine_config(self) -> dict[str, Any]:
        """The `speculative` keyword of `engine.LLM` (plain data: it crosses to Ray actors)."""
        opts = {"model": self.draft_model} if self.draft_model else {}
        return {"proposer": self.proposer, "max_draft": self.max_draft, "adaptive": self.adaptive,
                "gate": self.gate, "proposer_options": opts}


class RoutingSpec(_Section):
    """`routing`: how the router weighs where a prompt's prefix is cached against load
    (cluster/serving/prefix_routing.py). Cross-checked against the pools' `kv.prefix_caching` in `ClusterSpec`."""
    prefix_aware: bool | None = None  # None: on for every pool with kv.prefix_caching
    cache_weight: float = Field(1.0, ge=0.0, le=100.0)  # one cached prompt token against one queued token
    # a decode worker's request in flight, in prompt tokens to ship: how much load outweighs a cached prefix
    decode_load_tokens: float = Field(64.0, ge=0.0, le=float(1 << 20))
    refresh_s: float = Field(5.0, ge=0.0, le=3600.0)  # workers' cache reports replace the router's guess (0: never)

    def router_options(self) -> dict[str, Any]:
        """Keyword arguments of `cluster.serving.router.RouterConfig` this section sets."""
        return {"prefix_routing": self.prefix_aware, "prefix_cache_weight": self.cache_weight,
                "decode_load_tokens": self.decode_load_tokens, "prefix_refresh_s": self.refresh_s}


def prefix_problems(spec) -> list[Problem]:
    """`ClusterSpec` cross-checks of prefix caching against eviction and routing (keys rooted at the spec)."""
    pre, dec, out = spec.pools.prefill, spec.pools.decode, []
    if spec.mode == "disaggregated" and pre and dec and dec.kv.prefix_caching and pre.kv.eviction is not None:
        # the decode side shares cached pages into a reservation; evicted KV cannot fill such a one
        out.append(Problem("pools.decode.kv.prefix_caching", "cannot be combined with pools.prefill.kv.eviction "
                                                             "yet (evicted KV cannot join cached prefix pages); "
                                                             "turn one of them off"))
    if spec.routing.prefix_aware and not any(p.kv.prefix_caching for p in spec.pools_in_use().values()):
        out.append(Problem("routing.prefix_aware", "needs kv.prefix_caching: true on at least one pool (there is "
                                                   "no cached prefix to route by)"))
    return out


class ReliabilitySpec(_Section):
    """`reliability`: how fast a dead worker is noticed and what happens to the requests it held
    (cluster/serving/recovery.py). Cross-checked against `server.request_timeout_s` in `ClusterSpec`."""
    # Dead-peer detection bound: a worker whose event long-poll has not returned for this long is declared
    # dead (found within this + one 50 ms admission tick). >= 1 s: a healthy long poll returns every 0.5 s.
    heartbeat_timeout_s: float = Field(30.0, ge=1.0, le=3600.0)
    # A placement command (reserve, submit, add_request) unanswered this long: its worker is lost and fenced.
    call_timeout_s: float = Field(30.0, gt=0.0, le=3600.0)
    max_recoveries: int = Field(2, ge=0, le=16)  # re-placements of one request after worker losses, then 503
    # Ray restarts a dead worker actor this many times. Calls are never retried on the new incarnation
    # (max_task_retries stays 0): the router must see the death to recover the requests the old one held.
    actor_max_restarts: int = Field(0, ge=0, le=100)
    # Self-healing: a lost worker's slot gets a fresh actor (after Ray's restarts, if any, are used up).
    replace_lost_workers: bool = True
    # Crash loops: the n-th replacement in a row that fails to start or dies before its first step waits
    # backoff x 2^(n-1), at most max, before the next start.
    replace_backoff_s: float = Field(1.0, gt=0.0, le=600.0)
    replace_backoff_max_s: float = Field(60.0, gt=0.0, le=3600.0)
    # Step watchdog: a step running longer is a hung worker (fenced, replaced). None: derived from the
    # latency profile of the spec's model and the pool's limits (cluster/serving/ray_pools.py, step_bound).
    step_timeout_s: float | None = Field(None, ge=0.1, le=3600.0)
    # Placement bound: how long Ray may take to place a pool's replicas (at start, a scale-up, a replacement
    # whose node is gone) -- nodes of the type it names joining, room freeing -- before that start fails
    # with a typed error naming the pool and what the cluster's nodes offer. Raise it where an autoscaler
    # boots the nodes (minutes).
    placement_timeout_s: float = Field(60.0, gt=0.0, le=3600.0)

    def router_options(self) -> dict[str, Any]:
        """Keyword arguments of `cluster.serving.router.RouterConfig` this section sets."""
        return {"heartbeat_timeout_s": self.heartbeat_timeout_s, "call_timeout_s": self.call_timeout_s,
                "max_recoveries": self.max_recoveries, "rejoin_restarted": self.actor_max_restarts > 0,
                "replace_lost": self.replace_lost_workers, "replace_backoff_s": self.replace_backoff_s,
                "replace_backoff_max_s": max(self.replace_backoff_max_s, self.replace_backoff_s)}

    def actor_options(self) -> dict[str, Any]:
        """Keyword arguments of Ray's `ActorClass.options(...)` this section sets."""
        return {"max_restarts": self.actor_max_restarts, "max_task_retries": 0}
