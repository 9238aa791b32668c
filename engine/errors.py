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


class HubModelError(UnknownModelError):
    """A Hugging Face Hub id did not resolve; `fix` says what to do about it (engine/hub.py)."""

    def __init__(self, model: str, message: str, fix: str):
        self.fix = fix
        super().__init__(model, f"{message}; {fix}")


class ModelNotCachedError(HubModelError):
    """The id (at this revision) is not in the local Hugging Face cache and the Hub may not be asked
    (HF_HUB_OFFLINE) or could not be reached."""


class GatedModelError(HubModelError):
    """The repository is gated: its license must be accepted and HF_TOKEN must carry that account's token."""


class HubRepoNotFoundError(HubModelError):
    """No such repository on the Hub (or a private one the token, if any, cannot read)."""


class UnknownRevisionError(HubModelError):
    """The repository has no such branch, tag or commit."""


class UnsupportedArchitectureError(PdserveError, ValueError):
    """The checkpoint is of an architecture the engine does not implement; `model` names it where known."""

    def __init__(self, arch: str, supported: tuple[str, ...], model: str | None = None):
        self.field = "model"
        self.model = model
        where = f"model {model!r}: " if model else ""
        super().__init__(f"{where}architecture {arch!r} is not supported; supported: {', '.join(supported)}")


class UnsupportedFeatureError(UnsupportedArchitectureError):
    """A supported architecture whose config asks for a feature the engine does not compute (a RoPE type, an
    activation, shared experts, ...); `features` names each by its config key."""

    def __init__(self, arch: str, features: list[str], model: str | None = None):
        self.field = "model"
        self.model = model
        self.features = list(features)
        where = f"model {model!r}: " if model else ""
        PdserveError.__init__(self, f"{where}{arch} config asks for what the engine does not compute: "
                                    f"{'; '.join(features)}; pick a checkpoint without it")


class OutOfPagesError(PdserveError):
    """The page pool cannot satisfy an allocation (the scheduler treats this as back-pressure)."""


class ReservationError(PdserveError, ValueError):
    """A reservation is unknown, expired or already finished."""
