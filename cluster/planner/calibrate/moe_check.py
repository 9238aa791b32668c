"""The planner's mixture-of-experts step against public measured fused-MoE kernel times (issue 35).

    kernel_points(load_kernel_rows())   planner `expert_mlp` vs each measured kernel time (ratio per point)
    step_points(load_kernel_rows())     a decode step composed from the measured MoE layer vs the planner's
    serving_points(load_serving_rows()) a served decode step (mean TPOT) vs the planner's decode step

The data (data/gpu_profiles/moe/, README there: sources, settings, what each number is) are vLLM's
`benchmarks/kernels/benchmark_moe.py` outputs published in vLLM pull requests: one MoE layer's fused kernels
(top-k softmax, alignment, both grouped GEMMs, the activation, the weighted sum) for given tokens, with random
router logits (uniform routing, as the planner assumes) and without the router GEMM. That is the planner's
`MoEOperatorLatency.expert_mlp` on one rank of the same TP.
  kernel    planner / measured per row. fp8_w8a8 rows are priced as the bf16 model on a GPU with twice the
            bytes/s and FLOP/s (every operand is one byte, FP8 tensor cores run 2x bf16): a check of the
            experts-touched curve and the floors, not a supported dtype of the planner.
  step      the planner's decode step of `batch` sequences at `context` tokens each vs the same step with its
            MoE layers' `expert_mlp` replaced by the measured time (bf16 rows, batch <= 256: decode sizes). The
            rest of the step (attention, projections, norms, LM head, CPU) is the planner's own, fitted to
            Vidur's measured operator tables (bench/checks/planner_gpu_check.py: decode median 1.00).
  serving   mean TPOT of a served run at fixed concurrency c (vLLM's `benchmark_serving.py`, Tenstorrent's
            GPU reference sweep) vs the planner's decode step at batch c and the mean context (prompt + half
            the output) plus the share of the other c - 1 prompts' prefills that land in one request's steps.
GPUs: the table's names map to hardware entries (`GPUS`); the A100 PCIe 40GB is the a100 entry with its own
HBM bandwidth (datasheet: 1,555 GB/s; same 312 TFLOPS bf16). Who calls: bench/checks/moe_measured_check.py,
tests/unit/test_planner_moe_measured.py. Pure Python (csv).
"""
from __future__ import annotations

import csv
import dataclasses
import statistics
from dataclasses import dataclass
from pathlib import Path

from cluster.planner.calibrate.vidur_tables import ProfileTableError
from cluster.planner.errors import PlannerError
from cluster.planner.inputs.hardware import GB, GIB, Hardware, load_hardware
from cluster.planner.inputs.models import ModelSpec, load_model
from cluster.planner.latency.base import Parallel
from cluster.planner.latency.moe import MoEOperatorLatency, expected_experts

DEFAULT_DIR = Path(__file__).resolve().parents[3] / "data" / "gpu_profiles" / "moe"
KERNELS, SERVING = "fused_moe_kernels.csv", "serving_steps.csv"
# table name -> (hardware entry, HBM GB/s override, memory GiB override)
GPUS = {"H100-SXM-80GB": ("h100", None, None), "H100": ("h100", None, None), "A100": ("a100", None, None),
        "A100-PCIe-40GB": ("a100", 1555.0, 40 * GB / GIB)}  # "H100", "A100": variant not stated by the source
DTYPE_SPEED = {"bfloat16": 1.0, "fp8_w8a8": 2.0}  # bytes/s and FLOP/s multiplier of the bf16 model
STEP_CONTEXT = 2048  # tokens of context per sequence in the composed decode steps
DECODE_MAX = 256  # the largest decode batch a planned instance runs (max_num_seqs)
KERNEL_COLUMNS = ("source", "gpu", "dtype", "model", "tp", "experts", "top_k", "hidden", "expert_ffn", "config",
                  "tokens", "kernel_us")
SERVING_COLUMNS = ("source", "gpu", "dtype", "model", "tp", "concurrency", "prompts", "input_tokens",
                   "output_tokens", "mean_tpot_ms", "median_tpot_ms")


@dataclass(frozen=True)
class KernelRow:
    source: str
    gpu: str
    dtype: str
    model: str
    tp: int
    config: str
    tokens: int
    kernel_s: float


@dataclass(frozen=True)
class ServingRow:
    source: str
    gpu: str
    dtype: str
    model: str
    tp: int
    concurrency: int
    input_len: float  # mean prompt tokens
    output_len: float  # mean output tokens
    tpot_s: float  # mean TPOT


@dataclass(frozen=True)
class KernelPoint:
    row: KernelRow
    touched: float  # expected distinct experts per layer
    planner_s: float

    @property
    def ratio(self) -> float:
        return self.planner_s / self.row.kernel_s


@dataclass(frozen=True)
class StepPoint:
    row: KernelRow
    context: int  # per sequence
    planner_s: float
    composed_s: float
    moe_share: float  # of the composed step, the measured MoE layers'

    @property
    def ratio(self) -> float:
        return self.planner_s / self.composed_s


@dataclass(frozen=True)
class ServingPoint:
    row: ServingRow
    decode_s: float
    prefill_share_s: float

    @property
    def planner_s(self) -> float:
        return self.decode_s + self.prefill_share_s

    @property
    def ratio(self) -> float:
        return self.planner_s / self.row.tpot_s


def _read(path: Path, columns: tuple[str, ...]) -> list[tuple[int, dict[str, str]]]:
    if not path.is_file():
        raise ProfileTableError(f"{path}: no such file")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise ProfileTableError(f"{path}: missing column(s) {', '.join(missing)}")
        return [(n, row) for n, row in enumerate(reader, start=2)]


def _cell(path: Path, line: int, row: dict[str, str], column: str, kind: type, positive: bool = True):
    raw = (row.get(column) or "").strip()
    try:
        value = kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ProfileTableError(f"{path}:{line}: column {column}: {raw!r} is not {what}") from None
    if positive and value <= 0:
        raise ProfileTableError(f"{path}:{line}: column {column}: {raw!r} must be positive")
    return value


def _model(path: Path, line: int, row: dict[str, str]) -> ModelSpec:
    name, gpu, dtype = row["model"].strip(), row["gpu"].strip(), row["dtype"].strip()
    if gpu not in GPUS:
        raise ProfileTableError(f"{path}:{line}: column gpu: {gpu!r} is none of {', '.join(GPUS)}")
    if dtype not in DTYPE_SPEED:
        raise ProfileTableError(f"{path}:{line}: column dtype: {dtype!r} is none of {', '.join(DTYPE_SPEED)}")
    try:
        m = load_model(name)
    except PlannerError as e:  # the catalog's own typed errors (unknown, malformed), re-raised with the row
        raise ProfileTableError(f"{path}:{line}: column model: {e}") from None
    if not m.is_moe:
        raise ProfileTableError(f"{path}:{line}: column model: {name} has no experts")
    return m


def load_kernel_rows(path: Path = DEFAULT_DIR / KERNELS) -> list[KernelRow]:
    """Measured fused-MoE kernel times; each row's shape must be its catalog model's at its TP."""
    rows = []
    for line, r in _read(path, KERNEL_COLUMNS):
        m = _model(path, line, r)
        tp = _cell(path, line, r, "tp", int)
        shape = {"experts": m.experts, "top_k": m.experts_per_token, "hidden": m.hidden,
                 "expert_ffn": m.expert_ffn // tp}
        for column, want in shape.items():
            got = _cell(path, line, r, column, int)
            if got != want:
                raise ProfileTableError(f"{path}:{line}: column {column}: {got} is not {m.name}'s {want} at tp {tp}")
        rows.append(KernelRow(r["source"].strip(), r["gpu"].strip(), r["dtype"].strip(), m.name, tp,
                              r["config"].strip(), _cell(path, line, r, "tokens", int),
                              _cell(path, line, r, "kernel_us", float) * 1e-6))
    return rows


def load_serving_rows(path: Path = DEFAULT_DIR / SERVING) -> list[ServingRow]:
    rows = []
    for line, r in _read(path, SERVING_COLUMNS):
        m = _model(path, line, r)
        prompts = _cell(path, line, r, "prompts", int)
        rows.append(ServingRow(r["source"].strip(), r["gpu"].strip(), r["dtype"].strip(), m.name,
                               _cell(path, line, r, "tp", int), _cell(path, line, r, "concurrency", int),
                               _cell(path, line, r, "input_tokens", int) / prompts,
                               _cell(path, line, r, "output_tokens", int) / prompts,
                               _cell(path, line, r, "mean_tpot_ms", float) * 1e-3))
    return rows


def hardware_for(gpu: str, dtype: str = "bfloat16") -> Hardware:
    entry, hbm_gbs, memory_gib = GPUS[gpu]
    hw = load_hardware(entry)
    if hbm_gbs is not None:
        hw = dataclasses.replace(hw, name=gpu.lower(), hbm_bw=hbm_gbs * GB, memory=memory_gib * GIB)
    speed = DTYPE_SPEED[dtype]
    return hw if speed == 1.0 else dataclasses.replace(hw, hbm_bw=hw.hbm_bw * speed, peak_flops=hw.peak_flops * speed)


def latency_for(model: str, tp: int, gpu: str, dtype: str = "bfloat16") -> MoEOperatorLatency:
    hw = hardware_for(gpu, dtype)
    assert hw.step is not None, f"{gpu}: its hardware entry has no GPU step constants"
    return MoEOperatorLatency(Parallel(tp), load_model(model), hw, hw.step)


def kernel_points(rows: list[KernelRow]) -> list[KernelPoint]:
    out = []
    for r in rows:
        lat = latency_for(r.model, r.tp, r.gpu, r.dtype)
        m = lat.model
        out.append(KernelPoint(r, expected_experts(m.experts, m.experts_per_token, r.tokens), lat.expert_mlp(r.tokens)))
    return out


def step_points(rows: list[KernelRow], context: int = STEP_CONTEXT, max_batch: int = DECODE_MAX) -> list[StepPoint]:
    """bf16 rows at decode batch sizes: the planner's decode step vs the step with the measured MoE layers."""
    out = []
    for r in rows:
        if r.dtype != "bfloat16" or r.tokens > max_batch:
            continue
        lat = latency_for(r.model, r.tp, r.gpu)
        planner = lat.decode(r.tokens, r.tokens * context)
        moe_layers = lat.model.moe_layers
        composed = planner + moe_layers * (r.kernel_s - lat.expert_mlp(r.tokens))
        out.append(StepPoint(r, context, planner, composed, moe_layers * r.kernel_s / composed))
    return out


def serving_points(rows: list[ServingRow]) -> list[ServingPoint]:
    out = []
    for r in rows:
        lat = latency_for(r.model, r.tp, r.gpu, r.dtype)
        c = r.concurrency
        decode = lat.decode(c, c * (r.input_len + r.output_len / 2))
        # the other c - 1 requests' prompts are prefilled once each during this request's output_len steps
        prefill = lat.prefill(r.input_len, r.input_len ** 2) * (c - 1) / max(1.0, r.output_len - 1)
        out.append(ServingPoint(r, decode, prefill))
    return out


def spread(ratios: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of ratios."""
    return statistics.median(ratios), min(ratios), max(ratios)


def kernel_table(points: list[KernelPoint]) -> str:
    lines = ["| source | GPU | dtype | model | TP | tokens | experts touched | measured us | planner us | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        r = p.row
        lines.append(f"| {r.source} | {r.gpu} | {r.dtype} | {r.model} | {r.tp} | {r.tokens} | {p.touched:.1f} | "
                     f"{r.kernel_s * 1e6:.1f} | {p.planner_s * 1e6:.1f} | {p.ratio:.2f} |")
    return "\n".join(lines)


def step_table(points: list[StepPoint]) -> str:
    lines = ["| source | model | TP | batch | context/seq | composed ms | planner ms | measured MoE share | ratio |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        r = p.row
        lines.append(f"| {r.source} | {r.model} | {r.tp} | {r.tokens} | {p.context} | {p.composed_s * 1e3:.2f} | "
                     f"{p.planner_s * 1e3:.2f} | {p.moe_share:.0%} | {p.ratio:.2f} |")
    return "\n".join(lines)


def serving_table(points: list[ServingPoint]) -> str:
    lines = ["| source | GPU | model | TP | concurrency | in/out | measured TPOT ms | planner ms (decode + prefills) "
             "| ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        r = p.row
        lines.append(f"| {r.source} | {r.gpu} | {r.model} | {r.tp} | {r.concurrency} | {r.input_len:.0f}/"
                     f"{r.output_len:.0f} | {r.tpot_s * 1e3:.2f} | {p.planner_s * 1e3:.2f} ({p.decode_s * 1e3:.2f} + "
                     f"{p.prefill_share_s * 1e3:.2f}) | {p.ratio:.2f} |")
    return "\n".join(lines)
