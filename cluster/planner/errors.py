"""Typed planner errors: every input a user can get wrong raises one of these, naming the fix.

Raised by `models` (unknown model), `hardware` (unknown hardware), `profiles` (bad profile file),
`search` (no configuration fits memory, the SLO or the rate cannot be met); `cli` prints them as
`error: <message>` and exits 2. They are ValueErrors so callers can treat them as bad input.
Pure Python: the engine's `PdserveError` is not reused because importing `engine` pulls in torch.
"""
from __future__ import annotations


class PlannerError(ValueError):
    """Base of every planner error a user can cause."""


class UnknownModelError(PlannerError):
    def __init__(self, name: str, known: list[str], close: list[str]):
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        super().__init__(f"unknown model {name!r}{hint}; known: {', '.join(known)} (or their Hub ids); "
                         f"or give a Hugging Face config.json path")
        self.name = name


class UnknownHardwareError(PlannerError):
    def __init__(self, name: str, known: list[str], close: list[str]):
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        super().__init__(f"unknown hardware {name!r}{hint}; known: {', '.join(known)} (deploy/hardware.yaml)")
        self.name = name


class BadConfigError(PlannerError):
    """A model config, hardware table or profile file is malformed; the message names the file and key."""


class NoFeasibleConfigError(PlannerError):
    """The model fits no TP x PP configuration of the given GPUs (memory, heads, layers)."""


class InfeasibleSLOError(PlannerError):
    """No plan meets the SLO (at any rate, or at the requested rate with the GPUs given).

    `closest` describes the nearest feasible option (a looser SLO, a lower rate or more GPUs)."""

    def __init__(self, message: str, closest: str):
        super().__init__(f"{message}; closest feasible: {closest}")
        self.closest = closest
