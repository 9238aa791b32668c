"""Latency profiles (`deploy/profiles/<name>.json`) and the factory that picks a latency model.

A profile is what `pdserve profile` writes (or a published profile of the same form for devices this
machine lacks): DistServe's fitted coefficients per TP degree, their fit error, optionally roofline
efficiency factors, and the raw measurements. Shape:

    {"name": ..., "model": "smollm2-135m", "dtype": "bfloat16", "hardware": "cpu-local", "device": "cuda" (GPU only),
     "tp": {"1": {"prefill": [a, b, c], "decode": [a, b, c], "fit": {...}}},
     "calibration": {"compute_eff": .., "memory_eff": .., "overhead_s": ..},   (optional)
     "corun": {"slowdown": {"decode_beside_prefill": 1.1, ...}, ...},          (optional, `calibrate/corun.py`)
     "serving": {"disaggregated": {"prefill_factor": .., "decode_factor": .., "admission_s": .., ...},
                 "colocated": {...}},                                          (optional, `calibrate/serving_fit.py`)
     "measurements": {...}, "notes": "..."}                                     (optional)

`corun.slowdown` keys are `<kind>_beside_<kind>` over prefill/decode: how much slower a step runs while
an instance on the same node's memory bus is mid-step (`sim/bus.py`); `corun_of` gives the simulators the
factors (none in the profile: factor 1, as for GPUs with their own HBM each). `load_profile(...,
corun="cpu")` takes the CPU-clock factors (the bus and cache alone); "wall" the wall-clock ones (also the
time a worker loses to other processes when the node's cores are oversubscribed); "off" none.
`serving` (from bench runs, `pdserve profile --serving-from`): what the runtime adds to the engine's
times, per serving mode (the two run different processes around the engine); `latency_model(...,
mode=)` scales the coefficients by that mode's factors and carries its `admission_s` and drift (a mode
without its own entry takes the other's: the nearest measurement there is); `load_profile(...,
serving=False)` drops them (the bare engine). `pdserve plan` and bench/checks/planner_check.py apply them only
with `--serving on`: on this shared machine the factors move with the hour (a disaggregated decode
factor of 1.47 at one time, ~1.14 half an hour later), which would move absolute feasibility by default.

GPU operator profiles: `pdserve fit-gpu TABLES --out NAME.json` writes {"name", "hardware", "step":
{...}, "step_fit": {...}} (the GPU step model's constants, `inputs/gpu_constants.py`); `pdserve plan
--profile` also takes the measured tables themselves (a Vidur-layout CSV, a directory of them, or several
joined by commas: `is_table_profile`) and fits them on the spot for the hardware
(`calibrate/gpu_fit.py`'s `table_profile`; groups the tables lack keep the hardware entry's constants).

`latency_model(...)`: the profile's coefficients for that TP if it has them; else the GPU step model
(`gpu_latency`) with the profile's fitted `step` constants, or the hardware entry's when neither the
profile nor anything else says otherwise; else (CPUs, old profiles with a `calibration` or TP=1 fit) the
roofline, calibrated from the profile when there is one. Models with experts take the MoE forms of the
last two (`moe.py`: experts touched per step, expert parallelism's groups and all-to-all).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cluster.planner.errors import BadConfigError
from cluster.planner.inputs.gpu_constants import StepConstants, StepEntry
from cluster.planner.inputs.hardware import Hardware
from cluster.planner.inputs.models import ModelSpec
from cluster.planner.inputs.paths import deploy_dir, pydantic_problems, read_data
from cluster.planner.latency.base import Coeffs, FittedLatency, LatencyModel, Parallel
from cluster.planner.latency.drift import MODES, SPREAD_POINTS, drift_of, scaled
from cluster.planner.latency.gpu_latency import OperatorLatency
from cluster.planner.latency.interference import KINDS, Corun
from cluster.planner.latency.moe import MoEOperatorLatency, MoERooflineLatency
from cluster.planner.latency.roofline import Calibration, RooflineLatency, calibrate


class _TPEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    prefill: tuple[float, float, float]
    decode: tuple[float, float, float]
    fit: dict[str, Any] = {}


class _CalibrationEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    compute_eff: float = 0.6
    memory_eff: float = 0.8
    overhead_s: float = 0.002
    allreduce_latency_s: float = 10e-6


class _CorunEntry(BaseModel):
    """What `corun.measure_corun` writes; `slowdown` (CPU clock) or `wall_slowdown` feeds the model."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    slowdown: dict[str, float]
    spread: dict[str, tuple[float, float]] = {}
    wall_slowdown: dict[str, float] = {}
    step_ms: dict[str, tuple[float, float]] = {}
    neighbour_cpu_share: dict[str, float] = {}
    machine_busy: dict[str, float] = {}
    method: str = ""

    @field_validator("slowdown", "wall_slowdown")
    @classmethod
    def _pairs(cls, v: dict[str, float]) -> dict[str, float]:
        known = {f"{a}_beside_{b}" for a in KINDS for b in KINDS}
        bad = sorted(set(v) - known)
        if bad:
            raise ValueError(f"unknown pair(s) {', '.join(bad)}; known: {', '.join(sorted(known))}")
        if any(f <= 0 for f in v.values()):
            raise ValueError("slowdown factors must be > 0 (1: no interference)")
        return v


class _ServingEntry(BaseModel):
    """What `calibrate.serving_fit.calibrate_serving` writes."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    prefill_factor: float = Field(gt=0)
    decode_factor: float = Field(gt=0)
    admission_s: float = Field(0.0, ge=0)
    prefill_spread: list[float] = []
    decode_spread: list[float] = []
    prefill_window_s: float = Field(1.0, gt=0)  # the spans the spreads were measured over
    decode_window_s: float = Field(10.0, gt=0)
    points: int = 0
    source: str = ""
    mode: str = ""

    @field_validator("prefill_spread", "decode_spread")
    @classmethod
    def _quantiles(cls, v: list[float]) -> list[float]:
        if v and (len(v) != SPREAD_POINTS or v[0] <= 0 or any(b < a for a, b in zip(v, v[1:]))):
            raise ValueError(f"a spread is {SPREAD_POINTS} positive, non-decreasing quantiles (or empty)")
        return v


class _ProfileFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    model: str = ""  # "" for a GPU operator profile: its constants hold for any model
    dtype: str = "bfloat16"
    hardware: str
    device: str = ""  # `pdserve profile --device cuda` writes it; CPU profiles leave it out
    tp: dict[int, _TPEntry] = {}
    calibration: _CalibrationEntry | None = None
    step: StepEntry | None = None
    step_fit: dict[str, Any] = {}
    corun: _CorunEntry | None = None
    serving: dict[str, _ServingEntry] = {}

    @field_validator("serving")
    @classmethod
    def _modes(cls, v: dict) -> dict:
        bad = sorted(set(v) - set(MODES))
        if bad:
            raise ValueError(f"serving mode(s) {', '.join(bad)}; known: {', '.join(MODES)}")
        return v
    measurements: dict[str, Any] = {}
    notes: str = ""


@dataclass(frozen=True)
class Profile:
    name: str
    model: str
    dtype: str
    hardware: str
    coeffs: dict[int, Coeffs] = field(default_factory=dict)  # TP degree -> fitted coefficients
    calibration: Calibration | None = None
    fit: dict[int, dict[str, Any]] = field(default_factory=dict)
    corun: Corun = field(default_factory=Corun.none)  # co-run slowdown on one node's memory bus
    serving: dict = field(default_factory=dict)  # mode -> its serving calibration (`calibrate/serving_fit.py`)
    step: StepConstants | None = None  # GPU step model constants fitted from measured operator tables


CORUN_CLOCKS = ("cpu", "wall", "off")


def profile_path(name_or_path: str) -> Path:
    """A path to a profile JSON as given, else deploy/profiles/<name>.json (which may not exist)."""
    path = Path(name_or_path)
    return path if path.is_file() else deploy_dir() / "profiles" / f"{name_or_path}.json"


def is_table_profile(name_or_path: str) -> bool:
    """Measured operator tables rather than a profile JSON: a CSV, a directory, or several joined by commas."""
    parts = name_or_path.split(",")
    return len(parts) > 1 or Path(name_or_path).is_dir() or Path(name_or_path).suffix == ".csv"


def load_profile(name_or_path: str, corun: str = "cpu", serving: bool = True) -> Profile:
    """A path to a profile JSON, or a name under `deploy/profiles/`; `corun`: which co-run factors;
    `serving`: apply its serving calibration (when it has one). Measured GPU tables (`is_table_profile`)
    are fitted for a hardware entry by `calibrate.gpu_fit.table_profile` (numpy), which `pdserve plan` calls
    (`commands/plan_inputs.py`); here they are refused with that hint."""
    if corun not in CORUN_CLOCKS:
        raise BadConfigError(f"co-run clock {corun!r}: one of {', '.join(CORUN_CLOCKS)}")
    if is_table_profile(name_or_path):
        raise BadConfigError(f"{name_or_path}: measured tables are fitted for a hardware entry "
                             f"(cluster.planner.calibrate.gpu_fit.table_profile), not read as a profile")
    path = profile_path(name_or_path)
    if not path.is_file():
        known = sorted(p.stem for p in (deploy_dir() / "profiles").glob("*.json"))
        raise BadConfigError(f"profile {name_or_path!r} not found (a path, or one of: {', '.join(known) or 'none'}); "
                             f"make one with `pdserve profile SPEC --out deploy/profiles/NAME.json`")
    try:
        p = _ProfileFile.model_validate(read_data(path))
    except ValidationError as e:
        raise BadConfigError(pydantic_problems(path, e)) from None
    if not p.tp and p.calibration is None and p.step is None:
        raise BadConfigError(f"{path}: has neither `tp` coefficients, a `calibration` nor a GPU `step`; "
                             f"nothing to model")
    cal = Calibration(**p.calibration.model_dump()) if p.calibration else None
    factors = {"cpu": p.corun.slowdown, "wall": p.corun.wall_slowdown, "off": {}}[corun] if p.corun else {}
    if p.corun and corun == "wall" and not factors:
        raise BadConfigError(f"{path}: its `corun` entry has no `wall_slowdown`; use the cpu factors")
    corun = Corun.from_dict(factors)
    coeffs = {tp: Coeffs(e.prefill, e.decode) for tp, e in p.tp.items()}
    return Profile(p.name, p.model, p.dtype, p.hardware, coeffs, cal, {tp: dict(e.fit) for tp, e in p.tp.items()},
                   corun, dict(p.serving) if serving else {}, p.step.constants() if p.step else None)


def corun_of(profile: Profile | None) -> Corun:
    """The co-run factors the simulators apply to instances sharing a node: the profile's measured ones;
    none (factor 1) without a profile or when it has no `corun` entry."""
    return profile.corun if profile is not None else Corun.none()


def latency_model(model: ModelSpec, hw: Hardware, parallel: Parallel, dtype: str = "bfloat16",
                  profile: Profile | None = None, gpus_per_node: int = 8, mode: str = "disaggregated") -> LatencyModel:
    """The latency model of one TP x PP instance serving in `mode` (see the module map for the order of
    preference)."""
    stages_cross_nodes = parallel.gpus > gpus_per_node
    pp_link = hw.inter_node_bw if stages_cross_nodes else hw.intra_node_bw
    if profile is not None and parallel.tp in profile.coeffs:
        per_token = model.hidden * 2 / pp_link  # activation hop between stages, bf16
        entry = profile.serving.get(mode) or next(iter(profile.serving.values()), None)
        if entry is None:
            return FittedLatency(parallel, profile.coeffs[parallel.tp], per_token)
        return FittedLatency(parallel, scaled(profile.coeffs[parallel.tp], entry), per_token, entry.admission_s,
                             drift_of(entry))
    step = profile.step if profile is not None and profile.step is not None else None
    legacy = profile is not None and (profile.calibration is not None or 1 in profile.coeffs)
    if step is None and not legacy:
        step = hw.step
    # a mixture of experts: the same choice, with MoE layers and EP groups (`moe.py`); the all-to-all
    # crosses nodes only when an instance's stage does
    a2a = {"a2a_bw": hw.inter_node_bw if parallel.stage_gpus > gpus_per_node else hw.intra_node_bw}
    if step is not None:
        if model.is_moe:
            return MoEOperatorLatency(parallel, model, hw, step, dtype, pp_link, **a2a)
        return OperatorLatency(parallel, model, hw, step, dtype, pp_link)
    cal = Calibration()
    if profile is not None and profile.calibration is not None:
        cal = profile.calibration
    elif profile is not None and 1 in profile.coeffs:
        cal = calibrate(model, hw, profile.coeffs[1], dtype)
    if model.is_moe:
        return MoERooflineLatency(parallel, model, hw, dtype, cal, pp_link, **a2a)
    return RooflineLatency(parallel, model, hw, dtype, cal, pp_link)


def describe_latency(profile: Profile | None, hw: Hardware, corun: str) -> str:
    """What `pdserve plan` says it planned with (the spec header and the report)."""
    if profile is not None and profile.step is not None:
        return f"GPU step model fitted from {profile.name} ({profile.step.source})"
    if profile is not None:
        return (f"profile {profile.name} (fitted TP {sorted(profile.coeffs)}; roofline calibrated from it "
                f"elsewhere; co-run factors: {corun if not profile.corun.is_none else 'none'})")
    if hw.step is not None:
        return f"GPU step model of {hw.name} (deploy/hardware.yaml: {hw.step.source})"
    return f"roofline of {hw.name} (default efficiencies)"
