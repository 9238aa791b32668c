"""The YAML cluster spec: what `pdserve validate` checks and `pdserve serve` will start.

Shape (only `model` is required; the pools the mode needs must be named; defaults fit one laptop):

    model, revision, dtype, mode: disaggregated | colocated   (model: a bundled name, a Hugging Face Hub id
                  org/name -- revision: its branch, tag or commit --, a model directory or a .gguf file)
    pools:        prefill + decode (disaggregated) or colocated; each: replicas, max_replicas, tensor_parallel,
                  pipeline_parallel, expert_parallel (models with experts), placement (pack | strict_pack),
                  resources {num_cpus, num_gpus, custom, accelerator_type} (per rank: a replica reserves
                  tensor_parallel x pipeline_parallel x expert_parallel of them;
                  accelerator_type: Ray's name of the machine type its nodes must offer), max_num_seqs,
                  max_num_batched_tokens, max_model_len, kv {page_size, num_pages, storage, eviction,
                  prefix_caching}, speculative {proposer, max_draft, adaptive, gate, draft_model} and
                  sparse_attention {method, budget, sink_pages, recent, ...} (both decode/colocated only)
    kv_transfer:  host, auth_token {env | file}, tls {cert_file, key_file, ca_file}, failure_policy,
                  push_timeout_s
    server:       host, port, api_key {env | file}, request_timeout_s, max_queued_requests
    reliability:  heartbeat_timeout_s, call_timeout_s, max_recoveries, actor_max_restarts,
                  replace_lost_workers, replace_backoff_s, replace_backoff_max_s, step_timeout_s,
                  placement_timeout_s
    routing:      prefix_aware (default: on where kv.prefix_caching is), cache_weight, decode_load_tokens,
                  refresh_s
    slo:          ttft_ms, tpot_ms
    autoscaling:  enabled, interval_s, window_s, cooldowns, hysteresis, pools {min_replicas, max_replicas}
    ray:          address: local | auto | ray://HOST:PORT | HOST:PORT

Order: `load_spec(path)` reads the YAML (`spec_errors.read_yaml`), validates these pydantic models
(unknown keys, types, bounds, then each model's `_check`, whose cross-field problems raise `SpecError`);
after the caller resolves the model, `spec.check_against_model(config)` checks what needs the model
(parallelism divides heads and layers, KV pages hold one sequence). Every failure is a `SpecError`
listing `<dotted.key>: <reason>`. Models are frozen; secrets are never inline, only their sources.
The engine-facing parts of a pool (kv pages, storage, eviction; speculative) live in `spec_sections.py`.
The model's own checks (its name at parse time, its config for validate/serve) live in `spec_model.py`.
Nothing here imports torch or ray (`resolve_model_config` imports the loader lazily).
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from cluster.spec_errors import Problem, SpecError, problems_from_validation, read_yaml
from cluster.spec_model import name_problems, resolve_model_config  # noqa: F401 (re-exported)
from cluster.spec_sections import (RAY_RESERVED, EvictionSpec, KVPages, ReliabilitySpec, Resources,  # noqa: F401
                                   RoutingSpec, SparseAttentionSpec, SpeculativeSpec, _fail_if, _Section,
                                   prefix_problems, sparse_problems)
from cluster.spec_autoscaling import AutoscalingSpec, autoscaling_problems
from engine.config import ModelConfig
from engine.engine_config import EngineConfig
from kv_transfer.config import LOOPBACK_HOSTS, TOKEN_ENV

__all__ = ["ClusterSpec", "Pool", "SpecError", "Problem", "load_spec", "parse_spec", "resolve_model_config"]

Dtype = Literal["float32", "bfloat16", "float16"]
POOL_ORDER = ("prefill", "decode", "colocated")
API_KEY_ENV = "PDSERVE_API_KEY"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HOST = re.compile(r"^[A-Za-z0-9_.:%\-\[\]]+$")
_RAY_ADDRESS = re.compile(r"^(ray://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.\-]*):(\d{1,5})$")


def _check_host(host: str) -> str:
    if not _HOST.match(host) or "://" in host:
        raise ValueError(f"{host!r} is not a host name or IP address (no scheme, no spaces)")
    if host.count(":") == 1:
        raise ValueError(f"{host!r} carries a port; give the host alone and the port in `port`")
    return host


class SecretSource(_Section):
    """Where a secret is read at start: `{env: NAME}` or `{file: PATH}`. Never the secret itself."""
    env: str | None = None
    file: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_literal(cls, data: Any) -> Any:
        if isinstance(data, str):  # the message never repeats the value: it may be a real secret
            raise ValueError("literal secrets are refused (specs get committed and logged); "
                             "write {env: NAME} or {file: PATH} instead")
        return data

    @model_validator(mode="after")
    def _check(self) -> "SecretSource":
        problems = []
        if (self.env is None) == (self.file is None):
            problems.append(Problem("", "give exactly one of env: NAME or file: PATH"))
        if self.env is not None and not _ENV_NAME.match(self.env):
            problems.append(Problem("env", f"{self.env!r} is not an environment variable name (letters, digits, _)"))
        if self.file is not None and not self.file.strip():
            problems.append(Problem("file", "must be a path"))
        _fail_if(problems)
        return self

    def describe(self) -> str:
        return f"${self.env}" if self.env else f"file {self.file}"


def _capacity_problem(pool: "Pool", max_len: int) -> Problem | None:
    groups = pool.expert_parallel  # expert groups attend data-parallel: a sequence lives in one group's share
    cap = pool.kv.num_pages // groups * pool.kv.page_size
    if cap >= max_len:
        return None
    need, share = groups * -(-max_len // pool.kv.page_size), f" / {groups} expert groups" if groups > 1 else ""
    return Problem("kv.num_pages", f"{pool.kv.num_pages} pages{share} x {pool.kv.page_size} tokens = {cap} tokens "
                                   f"cannot hold one {max_len}-token sequence; raise num_pages to >= {need} or set "
                                   f"max_model_len <= {cap}")


class Pool(_Section):
    """One pool of identical replicas (a replica = one engine, later tp x pp workers)."""
    # Upper bounds name absurd sizes at validation, before Ray places actors or an engine allocates.
    replicas: int = Field(1, ge=1, le=4096)
    # A live resize (`pdserve scale`) may grow the pool up to this many; None: max(replicas, 8).
    max_replicas: int | None = Field(None, ge=1, le=4096)
    tensor_parallel: int = Field(1, ge=1, le=1024)  # must divide heads and KV heads (checked against the model)
    pipeline_parallel: int = Field(1, ge=1, le=1024)  # must divide layers (checked against the model)
    # mixture-of-experts models: each MoE layer's experts split over this many groups of tensor_parallel ranks,
    # each attending its own sequences in its share of kv.num_pages (engine/parallel/expert_worker.py, docs/engine.md)
    expert_parallel: int = Field(1, ge=1, le=1024)
    # How a replica's ranks are reserved (they run as child processes of the replica's actor, so on its node):
    # pack: one Ray bundle of degree x resources per replica; strict_pack: a STRICT_PACK placement group per
    # replica, one bundle per rank (Ray refuses a replica whose ranks do not fit on one node).
    placement: Literal["pack", "strict_pack"] = "pack"
    resources: Resources = Field(default_factory=Resources)
    max_num_seqs: int = Field(32, ge=1, le=1 << 16)  # sequences in one step's batch
    max_num_batched_tokens: int = Field(512, ge=1, le=1 << 22)  # tokens in one step's batch (prefill chunk budget)
    max_model_len: int | None = Field(None, ge=1, le=1 << 22)  # prompt + output; None: the model's limit
    kv: KVPages = Field(default_factory=KVPages)
    speculative: SpeculativeSpec | None = None  # `speculative:` alone: ngram with defaults
    sparse_attention: SparseAttentionSpec | None = None  # decode/colocated; `sparse_attention:` alone: defaults
    _blank_is_default = ("resources", "kv", "speculative", "sparse_attention")

    @model_validator(mode="after")
    def _check(self) -> "Pool":
        problem = _capacity_problem(self, self.max_model_len) if self.max_model_len else None
        problems = [problem] if problem else []
        if self.expert_parallel > 1 and self.pipeline_parallel > 1:
            problems.append(Problem("expert_parallel", "with pipeline_parallel > 1: one kind of layout at a time "
                                                       "(expert groups of tensor_parallel ranks, or a pipeline)"))
        if (self.max_replicas or self.replicas) < self.replicas:
            problems.append(Problem("max_replicas", f"{self.max_replicas} is below replicas ({self.replicas})"))
        if self.placement == "strict_pack" and self.degree > 1 and self.resources.num_gpus > 0:
            problems.append(Problem("placement", "strict_pack with GPUs: the rank processes are children of the "
                                                 "replica's actor and see only the GPUs of its own bundle; use "
                                                 "pack (one bundle of every rank's GPUs, always on one node)"))
        _fail_if(problems)
        return self

    @property
    def degree(self) -> int:
        """Processes one replica computes with (its ranks): tensor_parallel x pipeline_parallel x expert_parallel."""
        return self.tensor_parallel * self.pipeline_parallel * self.expert_parallel

    def describe(self) -> str:
        r = self.resources
        parts = [f"tp {self.tensor_parallel}", f"pp {self.pipeline_parallel}"]
        parts += [f"ep {self.expert_parallel}"] if self.expert_parallel > 1 else []
        parts += [f"{r.num_cpus:g} CPU"]
        parts += [f"{self.placement} x{self.degree}"] if self.degree > 1 else []
        parts += [f"{r.num_gpus:g} GPU"] if r.num_gpus else []
        parts += [f"{k} {v:g}" for k, v in r.custom.items()] + [f"on {r.accelerator_type}"] * bool(r.accelerator_type)
        parts.append(f"{self.kv.num_pages} KV pages of {self.kv.page_size}")
        if self.speculative is not None:
            parts.append(f"speculative {self.speculative.proposer} <= {self.speculative.max_draft}")
        return f"{self.replicas} replica{'s' if self.replicas != 1 else ''} ({', '.join(parts)})"


class Pools(_Section):
    prefill: Pool | None = None  # disaggregated: runs prompts, ships KV
    decode: Pool | None = None  # disaggregated: receives KV, generates
    colocated: Pool | None = None  # colocated: each replica does both phases
    _blank_is_default = ("prefill", "decode", "colocated")  # `decode:` alone: one replica, defaults


class TLSFiles(_Section):
    """PEM paths for the KV plane; `ca_file` turns on mutual TLS (each side checks the other)."""
    cert_file: str = Field(min_length=1)
    key_file: str = Field(min_length=1)
    ca_file: str | None = Field(None, min_length=1)
    server_name: str | None = None  # the name clients check in the server certificate

    @property
    def mutual(self) -> bool:
        return self.ca_file is not None


class KVTransferSpec(_Section):
    host: str = "127.0.0.1"  # where decode workers' KV receivers listen
    auth_token: SecretSource | None = None
    tls: TLSFiles | None = None
    failure_policy: Literal["fail", "recompute"] = "fail"  # recompute: decode re-runs the prompt itself
    push_timeout_s: float = Field(120.0, gt=0, le=3600)  # deadline of one KV push (gRPC call, wall clock)

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        return _check_host(v)

    @model_validator(mode="after")
    def _check(self) -> "KVTransferSpec":
        if self.host not in LOOPBACK_HOSTS and self.auth_token is None:
            _fail_if([Problem("auth_token", f"required because kv_transfer.host {self.host!r} is not loopback; "
                                            f"add auth_token: {{env: {TOKEN_ENV}}} or bind 127.0.0.1")])
        return self


class ServerSpec(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    api_key: SecretSource | None = None  # clients send it as `Authorization: Bearer <key>`
    request_timeout_s: float = Field(120.0, gt=0)  # default per-request deadline
    max_queued_requests: int = Field(256, ge=1)  # beyond this the frontend answers 429

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        return _check_host(v)

    @model_validator(mode="after")
    def _check(self) -> "ServerSpec":
        if self.host not in LOOPBACK_HOSTS and self.api_key is None:
            _fail_if([Problem("api_key", f"required because server.host {self.host!r} is not loopback; "
                                         f"add api_key: {{env: {API_KEY_ENV}}} or bind 127.0.0.1")])
        return self


class SloSpec(_Section):
    ttft_ms: float = Field(2000.0, gt=0)  # time to first token target
    tpot_ms: float = Field(150.0, gt=0)  # time per output token target


class RaySpec(_Section):
    address: str = "local"  # local: start a private Ray here; auto: join the running cluster

    @field_validator("address")
    @classmethod
    def _address(cls, v: str) -> str:
        if v in ("local", "auto"):
            return v
        m = _RAY_ADDRESS.match(v)
        if not m or not 1 <= int(m.group(3)) <= 65535:
            raise ValueError(f"{v!r} is not a Ray address; use local, auto, ray://HOST:PORT (Ray client) or "
                             f"HOST:PORT (the head's GCS, e.g. 10.0.0.1:6379)")
        return v


class ClusterSpec(_Section):
    model: str = Field(min_length=1)  # smollm2-135m, a Hub id (org/name), a model directory or a .gguf file
    revision: str | None = Field(None, min_length=1)  # Hub ids only: branch, tag or commit (default: main)
    dtype: Dtype = "bfloat16"
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    pools: Pools = Field(default_factory=Pools)
    kv_transfer: KVTransferSpec = Field(default_factory=KVTransferSpec)
    server: ServerSpec = Field(default_factory=ServerSpec)
    slo: SloSpec = Field(default_factory=SloSpec)
    ray: RaySpec = Field(default_factory=RaySpec)
    reliability: ReliabilitySpec = Field(default_factory=ReliabilitySpec)
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    _blank_is_default = ("pools", "kv_transfer", "server", "slo", "ray", "reliability", "routing", "autoscaling")

    @model_validator(mode="after")
    def _check(self) -> "ClusterSpec":
        problems = name_problems(self.model, self.revision) + self._mode_problems()
        if self.pools.prefill is not None and self.pools.prefill.speculative is not None:
            problems.append(Problem("pools.prefill.speculative", "prefill workers do not decode; set "
                                                                 "speculative on pools.decode"))
        pre, dec = self.pools.prefill, self.pools.decode
        if self.mode == "disaggregated" and dec is not None and dec.kv.eviction is not None:
            problems.append(Problem("pools.decode.kv.eviction", "eviction runs where prompts are prefilled: set "
                                                                "it on pools.prefill (the decode pool adopts "
                                                                "the kept tokens)"))
        if self.mode == "disaggregated" and pre and dec and pre.kv.storage != dec.kv.storage:
            problems.append(Problem("pools.decode.kv.storage", f"{dec.kv.storage!r} differs from pools.prefill.kv."
                                    f"storage {pre.kv.storage!r}: KV pages travel in their storage format, so "
                                    f"both pools must use the same one"))
        if self.mode == "disaggregated" and pre and dec and pre.kv.storage == "kivi4" and (
                pre.kv.page_size != dec.kv.page_size):
            problems.append(Problem("pools.decode.kv.page_size", f"{dec.kv.page_size} differs from pools.prefill.kv."
                                    f"page_size {pre.kv.page_size}: kivi4 cells carry a share of their page's key "
                                    f"scales (a page is one key group), so both pools need the same page size"))
        _fail_if(problems + self._deadline_problems() + prefix_problems(self) + sparse_problems(self)
                 + autoscaling_problems(self))
        return self

    def _deadline_problems(self) -> list[Problem]:
        # A worker found dead only after its requests' deadline passed cannot be recovered from: every
        # request it held has already failed with a timeout.
        deadline, rel = self.server.request_timeout_s, self.reliability
        return [Problem(f"reliability.{k}", f"{v:g} s must be below server.request_timeout_s ({deadline:g} s): a "
                                            f"dead worker must be found while its requests can still recover")
                for k, v in (("heartbeat_timeout_s", rel.heartbeat_timeout_s), ("call_timeout_s", rel.call_timeout_s))
                if v >= deadline]

    def _mode_problems(self) -> list[Problem]:
        p, out = self.pools, []
        if self.mode == "disaggregated":
            out += [Problem(f"pools.{n}", f"required in disaggregated mode (e.g. `{n}: {{replicas: 1}}`), "
                                          f"or set mode: colocated") for n in ("prefill", "decode")
                    if getattr(p, n) is None]
            if p.colocated is not None:
                out.append(Problem("pools.colocated", "only used in colocated mode; remove it or set mode: colocated"))
            return out
        if p.colocated is None:
            out.append(Problem("pools.colocated", "required in colocated mode (e.g. `colocated: {replicas: 2}`)"))
        out += [Problem(f"pools.{n}", "not used in colocated mode (each replica runs both phases); move its "
                                      "settings to pools.colocated or set mode: disaggregated")
                for n in ("prefill", "decode") if getattr(p, n) is not None]
        if "kv_transfer" in self.model_fields_set:
            out.append(Problem("kv_transfer", "has no effect in colocated mode (no KV moves between workers); "
                                              "remove it"))
        return out

    def pools_in_use(self) -> dict[str, Pool]:
        return {n: getattr(self.pools, n) for n in POOL_ORDER if getattr(self.pools, n) is not None}

    def check_against_model(self, config: ModelConfig) -> None:
        """What needs the model: raise `SpecError` listing every pool whose settings do not fit it."""
        problems: list[Problem] = []
        for name, pool in self.pools_in_use().items():
            problems += [Problem(f"pools.{name}.{p.key}", p.reason) for p in _model_problems(pool, config)]
        _fail_if(problems)

    def engine_config(self, pool: str) -> EngineConfig:
        """The engine config of one replica of `pool` (what its worker builds `engine.LLM` from)."""
        return EngineConfig.of(self.engine_kwargs(pool))

    def engine_kwargs(self, pool: str) -> dict[str, Any]:
        """The settings of `pool` that differ from an engine's defaults, as `EngineConfig` field names."""
        p = self.pools_in_use()[pool]
        kw = {"model": self.model, "dtype": self.dtype, "page_size": p.kv.page_size, "num_pages": p.kv.num_pages,
              "max_num_seqs": p.max_num_seqs, "max_num_batched_tokens": p.max_num_batched_tokens,
              "max_model_len": p.max_model_len, "kv_storage": p.kv.storage}
        if self.revision is not None:
            kw["revision"] = self.revision
        if p.kv.eviction is not None:
            kw["kv_eviction"] = p.kv.eviction.model_dump()
        if p.kv.prefix_caching:
            kw["enable_prefix_caching"] = True
        if p.tensor_parallel > 1:  # rank processes started by the engine (engine/parallel/launcher.py)
            kw["tensor_parallel_size"] = p.tensor_parallel
        if p.pipeline_parallel > 1:
            kw["pipeline_parallel_size"] = p.pipeline_parallel
        if p.expert_parallel > 1:  # expert ranks, started by the engine as the TP/PP ones
            kw["expert_parallel_size"] = p.expert_parallel
        if p.speculative is not None:
            kw["speculative"] = p.speculative.engine_config()
        if p.sparse_attention is not None:
            kw["sparse_attention"] = p.sparse_attention.engine_config()
        return kw

    def summary(self) -> str:
        pools = "; ".join(f"{n} {pool.describe()}" for n, pool in self.pools_in_use().items())
        rev = f" at {self.revision}" if self.revision else ""
        return (f"{self.mode} {self.model}{rev} ({self.dtype}): {pools}; ray {self.ray.address}; "
                f"http {self.server.host}:{self.server.port}")


# engine setting -> the pool's YAML key, for the engine's own parallel validators
_PARALLEL_KEYS = {"tensor_parallel_size": "tensor_parallel", "pipeline_parallel_size": "pipeline_parallel",
                  "expert_parallel_size": "expert_parallel", "speculative": "speculative", "kv_eviction": "kv.eviction"}


def _parallel_problems(pool: Pool, c: ModelConfig) -> list[Problem]:
    """The engine's judgement of the pool's degrees and options (engine/parallel/validate.py), so the spec
    and `LLM(tensor_parallel_size=, pipeline_parallel_size=, expert_parallel_size=)` cannot disagree."""
    from engine.parallel.validate import parallel_problems, valid_ep_degrees, valid_tp_degrees  # pure

    errs = parallel_problems(c, pool.tensor_parallel, pool.pipeline_parallel, pool.speculative is not None,
                             pool.kv.eviction is not None, pool.expert_parallel)
    hints = {"tensor_parallel_size": f"; use one of {', '.join(map(str, valid_tp_degrees(c)))}",
             "pipeline_parallel_size": f"; use 1 to {c.num_layers}",
             "expert_parallel_size": (f"; use one of {', '.join(map(str, valid_ep_degrees(c)))}" if c.moe is not None
                                      else "; remove the key (or set 1)")}
    return [Problem(_PARALLEL_KEYS.get(e.field, e.field), e.reason + hints.get(e.field, "")) for e in errs]


def _model_problems(pool: Pool, c: ModelConfig) -> list[Problem]:
    out: list[Problem] = _parallel_problems(pool, c)
    if pool.max_model_len is not None and pool.max_model_len > c.max_position:
        out.append(Problem("max_model_len", f"{pool.max_model_len} exceeds the model's {c.max_position} positions"))
    problem = _capacity_problem(pool, min(pool.max_model_len or c.max_position, c.max_position))
    return out + ([problem] if problem else [])


def parse_spec(data: dict[str, Any], source: str | None = None) -> ClusterSpec:
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError(problems_from_validation(e, ClusterSpec), source) from None


def load_spec(path: str | Path) -> ClusterSpec:
    """Read and validate a spec file; `SpecError` lists every problem found (model checks come later)."""
    return parse_spec(read_yaml(path), str(path))

