"""What a plan costs and draws, what an objective ranks by, and the `--price` / `--power` overrides.

    parse_overrides("--price", ["h100=4.5"], table) -> {"h100-80g-sxm": 4.5}   (typed errors on bad input)
    with_overrides(hw, prices, powers) -> Hardware                           (the table's numbers replaced)
    require(hws, objective, budget_cost, budget_power)                      (missing numbers: a typed error)
    plan_cost(plan, hw_of) / plan_power(plan, hw_of)                        USD per hour / watts
    objective_key(objective, plan, cost, power)                             smaller is better

A pool pays its devices' price per hour; it draws its phase's typical power per device (prefill pool:
`prefill_w`, decode pool: `decode_w`, colocated: the higher of the two, since prompt chunks run at full
draw). Who calls: `commands/designs_cmd` (overrides), `designs` (objectives and budgets),
`emit/design_report`. Pure Python.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from cluster.planner.errors import PlannerError, UnknownHardwareError
from cluster.planner.inputs.hardware import Hardware, load_hardware
from cluster.planner.search.plans import Plan

OBJECTIVES = ("gpus", "cost", "power", "goodput-per-dollar")


def parse_overrides(flag: str, items: list[str] | None, unit: str) -> dict[str, float]:
    """`NAME=VALUE` items (repeatable flag) -> {canonical hardware name: value}; names resolve through the
    table's aliases; values must be numbers >= 0."""
    out: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise PlannerError(f"{flag} {item!r}: give NAME={unit}, e.g. {flag} h100=4.5")
        try:
            number = float(value)
        except ValueError:
            raise PlannerError(f"{flag} {item!r}: {value!r} is not a number ({unit})") from None
        if not number >= 0:
            raise PlannerError(f"{flag} {item!r}: must be >= 0 {unit} (got {value})")
        out[_named(flag, name)] = number
    return out


def _named(flag: str, name: str) -> str:
    """The canonical name of `name`; unknown: the table's error (known names listed) led by the flag."""
    try:
        return load_hardware(name).name
    except UnknownHardwareError as e:
        e.args = (f"{flag}: {e}",)
        raise


def with_overrides(hw: Hardware, prices: dict[str, float], powers: dict[str, float]) -> Hardware:
    """`--price NAME=USD` sets the device-hour price; `--power NAME=W` sets the draw in both phases (and TDP)."""
    if hw.name in prices:
        hw = replace(hw, price_per_hour=prices[hw.name])
    if hw.name in powers:
        w = powers[hw.name]
        hw = replace(hw, tdp_w=w, prefill_w=w, decode_w=w)
    return hw


def parse_hardware_list(text: str) -> list[str]:
    """`--hardware h100,a100` -> names in order, duplicates dropped; unknown ones raise naming the flag."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise PlannerError("--hardware: give one or more names from deploy/hardware.yaml, e.g. --hardware h100,a100")
    out: list[str] = []
    for n in names:
        canon = _named("--hardware", n)
        if canon not in out:
            out.append(canon)
    return out


def require(hws: list[Hardware], objective: str | None, budget_cost: float | None,
            budget_power: float | None) -> None:
    """Every number the objective or budget needs is there and valid, else a typed error naming the fix."""
    for flag, v in (("--budget-cost", budget_cost), ("--budget-power", budget_power)):
        if v is not None and not v > 0:
            raise PlannerError(f"{flag} must be > 0 (got {v:g})")
    need_price = objective in ("cost", "goodput-per-dollar") or budget_cost is not None
    need_power = objective == "power" or budget_power is not None
    why = f"--objective {objective}" if objective in ("cost", "power", "goodput-per-dollar") else \
        ("--budget-cost" if budget_cost is not None else "--budget-power")
    for hw in hws:
        if need_price and hw.price_per_hour is None:
            raise PlannerError(f"{why} needs a price for {hw.name}: deploy/hardware.yaml has no price_per_hour "
                               f"for it; give --price {hw.name}=USD (per device-hour)")
        if need_price and hw.price_per_hour < 0:
            raise PlannerError(f"{hw.name}: price {hw.price_per_hour:g} is negative; give --price {hw.name}=USD >= 0")
        if need_power and (hw.prefill_w is None or hw.decode_w is None):
            raise PlannerError(f"{why} needs power for {hw.name}: deploy/hardware.yaml has no power for it; "
                               f"give --power {hw.name}=W (per device)")


def pool_watts(hw: Hardware, phase: str) -> float | None:
    if hw.prefill_w is None or hw.decode_w is None:
        return None
    return {"prefill": hw.prefill_w, "decode": hw.decode_w}.get(phase, max(hw.prefill_w, hw.decode_w))


def plan_cost(plan: Plan, hw_of: Callable[[str], Hardware]) -> float | None:
    """USD per hour (None when a device has no price)."""
    total = 0.0
    for c, n in plan.pools:
        price = hw_of(c.hardware).price_per_hour
        if price is None:
            return None
        total += price * c.parallel.gpus * n
    return total


def plan_power(plan: Plan, hw_of: Callable[[str], Hardware]) -> float | None:
    """Watts while serving (None when a device has no power figures)."""
    total = 0.0
    for c, n in plan.pools:
        w = pool_watts(hw_of(c.hardware), c.phase)
        if w is None:
            return None
        total += w * c.parallel.gpus * n
    return total


def objective_key(objective: str, plan: Plan, cost: float | None, power: float | None) -> tuple:
    """Sort key, smaller is better; ties go to fewer GPUs, then higher per-GPU goodput."""
    tie = (plan.gpus, -plan.per_gpu_goodput)
    if objective == "cost":
        return (cost, *tie)
    if objective == "power":
        return (power, *tie)
    if objective == "goodput-per-dollar":
        return (-plan.goodput / cost if cost else 0.0, *tie)
    return tie
