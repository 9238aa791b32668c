"""Typed errors of the parallel engine (tensor, pipeline and expert parallelism), raised at its boundaries.

`ParallelConfigError`: a degree the model cannot be split by (raised by `shard.validate_tp` and
`stages.validate_pp`, both in `validate.py`, before any process starts; the cluster spec asks the same
functions). `UnsupportedWithParallelError`: `LLM` was asked for a feature that does not yet run across
ranks. `RankFailedError`: a rank process died or raised while the driver waited for it; every rank of the
replica is shut down before it is raised.
"""
from __future__ import annotations

from engine.errors import PdserveError


class ParallelConfigError(PdserveError, ValueError):
    """A parallel degree does not divide the model; `field` names the offending setting."""

    def __init__(self, field: str, message: str):
        self.field, self.reason = field, message
        super().__init__(f"{field}: {message}")


class UnsupportedWithParallelError(PdserveError, ValueError):
    """A feature combined with tensor, expert or pipeline parallelism that the ranks cannot run yet."""

    def __init__(self, field: str, message: str):
        self.field, self.reason = field, f"{message} (not supported with tensor, expert or pipeline parallelism)"
        super().__init__(f"{field}: {self.reason}")


class RankFailedError(PdserveError, RuntimeError):
    """A rank process raised or exited; `rank` says which, the message carries its traceback."""

    def __init__(self, rank: int, message: str):
        self.rank = rank
        super().__init__(f"tensor-parallel rank {rank}: {message}")
