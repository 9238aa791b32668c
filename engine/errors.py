"""Typed errors raised at the engine's boundaries.

Every error a caller can cause is a ValueError subclass that names the offending field, so HTTP and
Ray layers can map it to a 400 without string matching. Internal invariants use `assert`, not these.
"""
from __future__ import annotations


class PdserveError(Exception):
    """Base of every typed pdserve error."""


class InvalidRequestError(PdserveError, ValueError):
    """A request (prompt or sampling parameter) is invalid; `field` names what is wrong."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class UnknownModelError(PdserveError, ValueError):
    """The model name or path does not resolve to anything loadable."""

    def __init__(self, model: str, message: str):
        self.field = "model"
        self.model = model
        super().__init__(f"model {model!r}: {message}")


class UnsupportedArchitectureError(PdserveError, ValueError):
    """The checkpoint is of an architecture the engine does not implement."""

    def __init__(self, arch: str, supported: tuple[str, ...]):
        self.field = "model"
        super().__init__(f"architecture {arch!r} is not supported; supported: {', '.join(supported)}")


class OutOfPagesError(PdserveError):
    """The page pool cannot satisfy an allocation (the scheduler treats this as back-pressure)."""


class ReservationError(PdserveError, ValueError):
    """A reservation is unknown, expired or already finished."""
