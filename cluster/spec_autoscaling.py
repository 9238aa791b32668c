"""The `autoscaling:` section of the cluster spec (`cluster/spec.py`): what the SLO autoscaler
(`cluster/serving/autoscaler.py`) reads. Pydantic at the YAML edge; `autoscaler.autoscale_config(spec)` turns
it into the frozen `AutoscaleConfig` the pure policy (`cluster/serving/autoscale_policy.py`) runs on.

    autoscaling:
      enabled: true
      interval_s: 10             # one decision per pool this often
      window_s: 60               # the sliding window of recent requests the rate, mix and latencies come from
      scale_up_cooldown_s: 30    # after any change of a pool, no scale-up for this long...
      scale_down_cooldown_s: 120 # ...and no scale-down for this long (shrinking too soon is what flaps)
      scale_up_tolerance: 0.1    # no scale-up while the forecast rate / 1.1 still fits the current replicas
      latency_pressure: 0.8      # latencies "near the targets": p90 beyond 0.8 x a target (a scale-up reason
                                 # where the replicas have carried the forecast before; no shrink on it)
      demonstrated_horizon_s: 1800   # how long a rate a replica carried within the SLO bounds the need (0: off)
      scale_down_headroom: 0.2   # hysteresis: shrink only if the forecast rate x 1.2 still fits fewer replicas
      scale_down_stable_intervals: 3   # ...in this many decisions in a row
      min_samples: 10            # finished requests a window needs before latencies correct the model
      correction_smoothing: 0.5  # weight of the newest measured/predicted ratio in the correction factor
      profile: null              # latency profile for the planner's model (name under deploy/profiles or a path)
      pools:
        colocated: {min_replicas: 1, max_replicas: 2}

Cross-field checks (`autoscaling_problems(spec)`, called by `ClusterSpec._check`): every pool named is in
use; min_replicas <= max_replicas; max_replicas within the pool's own `max_replicas` (what `pdserve scale`
allows); the pool's start `replicas` within [min, max]; window_s >= interval_s. A pool left out is
autoscaled between 1 and its own max_replicas.
"""
from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from cluster.spec_errors import Problem
from cluster.spec_sections import _fail_if, _Section

DEFAULT_MAX = 8  # a pool without max_replicas may grow to max(replicas, 8) (cluster/spec.py Pool)


class AutoscalePool(_Section):
    min_replicas: int = Field(1, ge=1, le=4096)  # a pool keeps at least one worker
    max_replicas: int | None = Field(None, ge=1, le=4096)  # None: the pool's own max_replicas

    @model_validator(mode="after")
    def _check(self) -> "AutoscalePool":
        if self.max_replicas is not None and self.min_replicas > self.max_replicas:
            _fail_if([Problem("min_replicas", f"{self.min_replicas} is above max_replicas ({self.max_replicas}); "
                                              f"lower min_replicas or raise max_replicas")])
        return self


class AutoscalingSpec(_Section):
    enabled: bool = False
    interval_s: float = Field(10.0, gt=0, le=3600)
    window_s: float = Field(60.0, gt=0, le=86400)
    scale_up_cooldown_s: float = Field(30.0, ge=0, le=86400)
    scale_down_cooldown_s: float = Field(120.0, ge=0, le=86400)
    scale_up_tolerance: float = Field(0.1, ge=0, le=1)
    latency_pressure: float = Field(0.8, gt=0, le=1)
    demonstrated_horizon_s: float = Field(1800.0, ge=0, le=7 * 86400)
    scale_down_headroom: float = Field(0.2, ge=0, le=10)
    scale_down_stable_intervals: int = Field(3, ge=1, le=1000)
    min_samples: int = Field(10, ge=1, le=100000)
    correction_smoothing: float = Field(0.5, gt=0, le=1)
    profile: str | None = Field(None, min_length=1)
    pools: dict[str, AutoscalePool] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _blank_pools(cls, data: Any) -> Any:  # `colocated:` with nothing under it: the defaults
        if isinstance(data, dict) and isinstance(data.get("pools"), dict):
            data = {**data, "pools": {k: {} if v is None else v for k, v in data["pools"].items()}}
        return data

    @model_validator(mode="after")
    def _check(self) -> "AutoscalingSpec":
        if self.window_s < self.interval_s:
            _fail_if([Problem("window_s", f"{self.window_s:g} s is shorter than interval_s ({self.interval_s:g} s): "
                                          f"each decision must see at least one interval of requests")])
        return self


def pool_bounds(spec) -> dict[str, tuple[int, int]]:
    """pool -> (min, max) replicas the autoscaler keeps it within (every pool in use)."""
    out = {}
    for name, pool in spec.pools_in_use().items():
        own = pool.max_replicas or max(pool.replicas, DEFAULT_MAX)
        a = spec.autoscaling.pools.get(name) or AutoscalePool()
        out[name] = (a.min_replicas, a.max_replicas if a.max_replicas is not None else own)
    return out


def autoscaling_problems(spec) -> list[Problem]:
    a = spec.autoscaling
    pools = spec.pools_in_use()
    out = [Problem(f"autoscaling.pools.{n}", f"is not a pool of this spec (pools: {', '.join(pools)})")
           for n in a.pools if n not in pools]
    if out:
        return out
    for name, (lo, hi) in pool_bounds(spec).items():
        pool, key = pools[name], f"autoscaling.pools.{name}"
        own = pool.max_replicas or max(pool.replicas, DEFAULT_MAX)
        if hi > own:
            out.append(Problem(f"{key}.max_replicas", f"{hi} is above pools.{name}.max_replicas ({own}); the "
                                                      f"autoscaler resizes within the pool's own bound: raise "
                                                      f"pools.{name}.max_replicas or lower this"))
        elif lo > hi:
            out.append(Problem(f"{key}.min_replicas", f"{lo} is above the pool's max_replicas ({hi})"))
        elif a.enabled and not lo <= pool.replicas <= hi:
            out.append(Problem(f"pools.{name}.replicas", f"{pool.replicas} is outside the autoscaler's "
                                                         f"[{lo}, {hi}]; start the pool within them"))
    return out
