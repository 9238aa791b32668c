"""What sparse decode attention a sequence gets: the config dataclass and its per-request resolution.

Three places set it, each through this module (pure Python, no torch):
  - the engine / pool: `LLM(sparse_attention={...})` (YAML `pools.<decode|colocated>.sparse_attention`)
    -> `SparseAttentionConfig.of(value)`, then `check_page_size` when the pool is built;
  - a request: `SamplingParams.sparse_attention` (HTTP `pdserve.sparse_attention`): None = the engine's
    config, "off" = full attention for this request, a dict = the engine's config with those fields
    replaced. `SamplingParams.validate` checks the value alone (`check_value`: types, unknown keys);
    `LLM.check_request` checks it against the engine (`check_for_engine`: the page size, and sparse
    attention must be on in the engine -- page summaries are kept from the pool's first write, not built
    lazily, so a request cannot turn them on: a 400 names the pool option instead);
  - a step: whoever builds a decode batch (`LLM._batch`, the speculative step's draft and verify batches)
    calls `step_rows(engine_cfg, requests)`: a request id -> effective config map for `StepBatch.sparse`,
    or None when every row has the engine's config (the common case: the backend uses its own).
The backend's selection (`sparse.select`) honours that map row by row, so a batch mixes sparse rows of
different budgets and full rows.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

from engine.errors import InvalidRequestError

FIELD = "sparse_attention"


@dataclass(frozen=True)
class SparseAttentionConfig:
    method: str = "quest"  # the only one so far
    budget: int = 1024  # tokens of top-scored pages read besides the sinks and the recent window
    sink_pages: int = 1  # first pages always read (attention sinks)
    recent: int = 64  # the last `recent` slots always read (their pages)
    min_context: int = 0  # rows with fewer slots read everything
    select_per: str = "kv_head"  # "kv_head" (Quest) or "row" (one choice for all KV heads: the paged kernel)
    gqa: str = "max"  # how query heads of one KV head combine their page bounds: "max" or "sum"
    selection_layers: tuple[int, ...] = ()  # () = every layer chooses; else only these, the others reuse
    # the first `dense_layers` layers read every page (Quest leaves its first two dense: their attention is
    # the least sparse). One value per engine: a request cannot change it (a group's rows share the layers)
    dense_layers: int = 0

    def __post_init__(self) -> None:
        if self.method != "quest":
            raise InvalidRequestError(f"{FIELD}.method", f"{self.method!r} is not a method; known: 'quest'")
        for key in ("budget", "sink_pages", "recent", "min_context", "dense_layers"):
            val = getattr(self, key)
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                raise InvalidRequestError(f"{FIELD}.{key}", f"must be an integer >= 0, got {val!r}")
        if self.budget < 1:
            raise InvalidRequestError(f"{FIELD}.budget", "must be >= 1 token")
        if self.select_per not in ("kv_head", "row"):
            raise InvalidRequestError(f"{FIELD}.select_per", f"{self.select_per!r}; use 'kv_head' or 'row'")
        layers = self.selection_layers
        if isinstance(layers, list):
            object.__setattr__(self, "selection_layers", layers := tuple(layers))
        if not isinstance(layers, tuple) or any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in layers):
            raise InvalidRequestError(f"{FIELD}.selection_layers", f"must be a list of layer ids >= 0, got {layers!r}")
        if self.gqa not in ("max", "sum"):
            raise InvalidRequestError(f"{FIELD}.gqa", f"{self.gqa!r}; use 'max' or 'sum'")

    @staticmethod
    def of(value) -> "SparseAttentionConfig | None":
        """None / "off" -> None; a config passes; a dict is checked key by key (unknown keys named)."""
        if value is None or value == "off":
            return None
        if isinstance(value, SparseAttentionConfig):
            return value
        return SparseAttentionConfig(**_fields(value))

    def chooses_at(self, layer: int) -> bool:
        """Does this layer choose pages (rather than reuse the step's latest choice)?"""
        return not self.selection_layers or layer in self.selection_layers


def _fields(value) -> dict:
    if not isinstance(value, dict):
        raise InvalidRequestError(FIELD, f"must be 'off' or a dict of fields, got {type(value).__name__}")
    known = {f.name for f in dataclasses.fields(SparseAttentionConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidRequestError(f"{FIELD}.{unknown[0]}", f"unknown key; known: {', '.join(sorted(known))}")
    return value


def check_page_size(cfg: SparseAttentionConfig | None, page_size: int) -> None:
    """The budget is spent in whole pages: one that is not a multiple of the page size would be rounded
    down silently (and one below a page would choose no page by score at all)."""
    if cfg is not None and cfg.budget % page_size:
        fit = max(1, cfg.budget // page_size) * page_size
        raise InvalidRequestError(f"{FIELD}.budget", f"{cfg.budget} is not a multiple of the KV page size "
                                                     f"({page_size} tokens); use e.g. {fit}")


def check_value(value) -> None:
    """A request's value on its own (no engine at hand): None, "off" or a dict of valid fields."""
    if value is None or value == "off" or isinstance(value, SparseAttentionConfig):
        return
    SparseAttentionConfig(**_fields(value))  # each given field checked against the defaults of the rest


def for_request(engine_cfg: SparseAttentionConfig | None, value) -> SparseAttentionConfig | None:
    """The config a request's rows decode with (None: full attention)."""
    if value is None:
        return engine_cfg
    if value == "off":
        return None
    if engine_cfg is None:
        raise InvalidRequestError(FIELD, "this pool runs with sparse attention off, so its pages keep no page "
                                         "summaries to choose from; enable `sparse_attention` on the pool (YAML "
                                         "pools.decode.sparse_attention, or LLM(sparse_attention=...)) to allow "
                                         "per-request settings, or send \"off\"")
    if isinstance(value, SparseAttentionConfig):
        return value
    fields = _fields(value)
    if fields.get("dense_layers", engine_cfg.dense_layers) != engine_cfg.dense_layers:
        raise InvalidRequestError(f"{FIELD}.dense_layers", f"is the pool's setting ({engine_cfg.dense_layers}); a "
                                                           "request cannot change it (rows of a step share the layers)")
    return dataclasses.replace(engine_cfg, **fields)


def check_for_engine(engine_cfg: SparseAttentionConfig | None, value, page_size: int) -> None:
    check_page_size(for_request(engine_cfg, value), page_size)


def step_rows(engine_cfg: SparseAttentionConfig | None, requests: Iterable) -> dict | None:
    """request id -> effective config for a step's batch (`StepBatch.sparse`), or None when every request
    has the engine's own config. `requests`: objects with `request_id` and `params.sparse_attention`."""
    if engine_cfg is None:
        return None  # (a request cannot turn it on: check_for_engine refused that at intake)
    reqs = list(requests)
    if all(r.params.sparse_attention is None for r in reqs):
        return None
    return {r.request_id: for_request(engine_cfg, r.params.sparse_attention) for r in reqs}
