"""The GPU step model against measured GPU steps (issue 24), offline from Vidur's published tables: the
library of bench/checks/planner_gpu_check.py (its command line and printout) and
tests/unit/test_planner_gpu_tables.py.

    run(tables_dir, h100) -> (cases, fit report)     every case, measured vs predicted
    groups(cases), summary(cases)                   the acceptance groups and their bands
    case_table(cases), summary_table(cases)         markdown

Order: (1) fit the step model's constants (`gpu_fit`) on the FITTED rows only: A100 Llama-3-8B and
Llama-2-7B compute tables, the Llama-3-8B A100 attention points and the A100 NVSwitch (DGX) all-reduce
curve; (2) carry the compute constants to the H100 by its datasheet (efficiencies are fractions of the
peaks), so no H100 compute row is fitted on; its collectives come from its own interconnect's curve
(H100_LINKS, below); (3) per model x GPU x TP x case, compose the measured step as Vidur does (layers x
(the four projections, both norms, rope, activation, add, the attention kernel and KV-cache write where the
tables have them, two all-reduces when TP > 1) + the embedding row) and the predicted step from the same
terms (`gpu_latency.layer_terms`); (4) every case, measured vs predicted and the ratio, summarised per set
(fitted / held-out), phase and TP, with the old roofline's ratio beside it (the script prints them).

Collectives are a property of the interconnect (NVLink generation, NVSwitch, NCCL), not of the GPU's
datasheet peaks: an A100 NVSwitch curve carried to the H100 keeps the A100's small-message latency (31 us
for 2 GPUs, fitted on rows of 46-60 us at 8-16 KB), where the H100 NVSwitch table measures 7-11 us up to
16 KB; a 2-GPU decode step of Llama-2-7B (8 KB all-reduces, 64 per step) then comes out 1.5x the measured
step. So the H100's all-reduce is the curve of its own NVSwitch (H100_LINKS: deploy/hardware.yaml's H100
`allreduce` block, fitted on h100_dgx_all_reduce.csv, the table the measured step takes its all-reduce
rows from: that one term is in-sample). `run(h100="carried")` (`--h100 carried`) carries the link too (no
H100 row at all; the 2-GPU B=1 decode cases miss); "entry" takes the whole H100 block (in-sample).
Which table: Vidur composes an H100 step on its only H100 node, the DGX (its README; network_device
h100_dgx, rows with num_workers == devices_per_node == TP); h100_pairwise_nvlink is a 4-GPU node of
NVLink-bridged pairs (TP 4 crosses PCIe: 2 ms at 64 MB against 0.3 ms on the DGX), not an H100 SXM's.
Vidur adds nccl_cpu_launch_overhead_ms (0.02) to every all-reduce; the check compares the tables' GPU
times and leaves that CPU cost out on both sides.

A term the tables lack is left out on both sides (the H100 and Llama-2-7B have no attention rows; the old
70B attention profile has no KV-cache write), so a ratio compares like with like; the LM head, sampling and
the CPU time are in no table (the `full` column adds them: what the planner uses). A measured all-reduce
is the median of the five table rows nearest in size (the rows are noisy at small sizes).
Cases: prefill of one N-token prompt, N in PREFILL; decode of B sequences at context C each, B x C in
DECODE. Bands (the issue's acceptance): median 0.9-1.1, every case 0.75-1.33, for TP 1/2/4.

"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from cluster.planner.calibrate.gpu_fit import carry_links, fit_constants, rank_shape
from cluster.planner.calibrate.vidur_tables import AllReduceTable, AttentionTable, ComputeTable, load_tables
from cluster.planner.inputs.hardware import load_hardware
from cluster.planner.inputs.models import ModelSpec
from cluster.planner.latency.base import Parallel
from cluster.planner.latency.gpu_latency import layer_terms, step_terms
from cluster.planner.latency.roofline import RooflineLatency

DEFAULT_TABLES = Path(__file__).resolve().parents[3] / "data" / "gpu_profiles" / "vidur"
PREFILL = (128, 512, 1024, 2048, 4096)
DECODE = tuple((b, c) for c in (512, 2048) for b in (1, 8, 32, 128))
TPS = (1, 2, 4, 8)
MEDIAN_BAND, CASE_BAND = (0.9, 1.1), (0.75, 1.33)
LAYERS = {"meta-llama-3-8b": 32, "llama-2-7b-hf": 32, "meta-llama-3-70b": 80, "llama-2-70b-hf": 80}
FIT_ON = ("a100_meta-llama_Meta-Llama-3-8B_mlp.csv", "a100_meta-llama_Llama-2-7b-hf_mlp.csv",
          "llama3_8b_a100_attention_points.json", "a100_dgx_all_reduce.csv")
SETS = (  # (set, gpu, compute table, attention source or None)
    ("fitted", "a100", "a100_meta-llama_Meta-Llama-3-8B_mlp.csv", "llama3_8b_a100_attention_points.json"),
    ("fitted", "a100", "a100_meta-llama_Llama-2-7b-hf_mlp.csv", None),
    ("held-out", "a100", "a100_meta-llama_Meta-Llama-3-70B_mlp.csv", "old_a100_attention.csv"),
    ("held-out", "a100", "a100_meta-llama_Llama-2-70b-hf_mlp.csv", "old_a100_attention.csv"),
    ("held-out", "h100", "h100_meta-llama_Llama-2-7b-hf_mlp.csv", None),
    ("held-out", "h100", "h100_meta-llama_Llama-2-70b-hf_mlp.csv", None),
)
NETWORK = {"a100": "a100_dgx_all_reduce.csv", "h100": "h100_dgx_all_reduce.csv"}
LAYER_OPS = {"qkv": ("attn_pre_proj",), "o": ("attn_post_proj",), "up": ("mlp_up_proj",), "down": ("mlp_down_proj",),
             "norm": ("input_layernorm", "post_attention_layernorm"), "rope": ("attn_rope",), "act": ("mlp_act",),
             "add": ("add",)}


@dataclass
class Case:
    set: str
    gpu: str
    model: str
    tp: int
    phase: str  # prefill | decode
    what: str  # N=... or B=..,C=..
    attention: bool
    measured: float  # seconds
    predicted: float  # the same terms
    full: float  # the planner's whole step (+ LM head, CPU)
    old: float | None  # the old roofline, same terms as the issue compared

    @property
    def ratio(self) -> float:
        return self.predicted / self.measured

    @property
    def old_ratio(self) -> float | None:
        return None if self.old is None else self.old / self.measured


def model_name(table: ComputeTable) -> str:
    name = Path(table.path).name.lower()
    return next(k for k in LAYERS if k in name)


def spec_of(table: ComputeTable) -> ModelSpec:
    s = table.shape
    m = ModelSpec(model_name(table), LAYERS[model_name(table)], s.hidden, s.heads, s.kv_heads, s.head_dim, s.ffn,
                  s.vocab, 4096, 0.0, s.gated)
    return replace(m, params=float(m.counted_params))


def measured_allreduce(table: AllReduceTable, tp: int, nbytes: float) -> float:
    """Median of the five rows nearest in log size (raises past the table's largest message)."""
    pts = table.curves[tp]
    if nbytes > pts[-1][0] * 1.0001:
        raise ValueError(f"{table.path}: {nbytes:.0f} bytes is past the largest row ({pts[-1][0]:.0f})")
    near = sorted(pts, key=lambda p: abs(math.log(p[0] / nbytes)))[:5]
    return statistics.median(t for _, t in near)


def _attention_row(att: AttentionTable | None, tp: int, phase: str, n: int, b: int, c: int):
    if att is None:
        return None
    return att.prefill.get((tp, n, 0)) if phase == "prefill" else att.decode.get((tp, b, c))


def compose(ct: ComputeTable, att: AttentionTable | None, net: AllReduceTable, hw, const, tp: int, phase: str,
            n: int = 0, b: int = 0, c: int = 0) -> tuple[float, float, float, bool, dict] | None:
    """(measured, predicted, full predicted, with attention, per-term detail) of one case, or None when
    the tables lack its rows."""
    tokens = n if phase == "prefill" else b
    ops = ct.rows.get((tp, tokens))
    if ops is None:
        return None
    s, model = rank_shape(ct.shape, tp), spec_of(ct)
    pre, sq, batch, ctx = (n, n * n, 0, 0) if phase == "prefill" else (0, 0, b, b * c)
    terms = layer_terms(const, hw, s, tp, pre, sq, batch, ctx)
    meas = {k: sum(ops[col] for col in cols) for k, cols in LAYER_OPS.items()}
    pred = {k: terms[k] for k in LAYER_OPS}
    row = _attention_row(att, tp, phase, n, b, c)
    if row is not None:
        key = f"{phase}_attention"
        meas[key], pred[key] = row[0], terms[key]
        if row[1] is not None:
            meas["kv_write"], pred["kv_write"] = row[1], terms["kv_write"]
    if tp > 1:
        meas["allreduce"], pred["allreduce"] = 2 * measured_allreduce(net, tp, tokens * s.hidden * 2), terms["allreduce"]
    once = step_terms(const, hw, s, tp, tokens, (1 if phase == "prefill" else b))
    measured = model.layers * sum(meas.values()) + ops["emb"]
    predicted = model.layers * sum(pred.values()) + once["emb"]
    full = model.layers * sum(terms.values()) + sum(once.values())
    detail = {k: (model.layers * meas[k], model.layers * pred[k]) for k in meas}
    return measured, predicted, full, row is not None, detail


def old_roofline(ct: ComputeTable, hw, tp: int, phase: str, attention: bool, n=0, b=0, c=0) -> float:
    """What the roofline before issue 24 predicted for the same case (its matmuls incl. the LM head on
    every token, fixed overhead and all-reduces; attention only where the tables have it)."""
    r = RooflineLatency(Parallel(tp, 1), spec_of(ct), hw)
    if phase == "prefill":
        return r._matmuls(n) + r._fixed(n) + (r._prefill_attention(n, n * n) if attention else 0.0)
    return r._matmuls(b) + r._fixed(b) + (b * c * r._decode_attention_slope() if attention else 0.0)


def constants(tables_dir: Path):
    """(A100 constants fitted on FIT_ON, H100 constants carried from them, fit report)."""
    a100, h100 = load_hardware("a100"), load_hardware("h100")
    base = a100.step if a100.step is not None else h100.step
    fitted, report = fit_constants(load_tables([tables_dir / f for f in FIT_ON]), a100, base)
    return {"a100": fitted, "h100": carry_links(fitted, a100, h100)}, report


H100_MODES = ("links", "carried", "entry")
H100_LINKS = "deploy/hardware.yaml h100 allreduce (fitted on h100_dgx_all_reduce.csv)"  # the default's links


def run(tables_dir: Path = DEFAULT_TABLES, h100: str = "links") -> tuple[list[Case], dict]:
    """Every case; `h100`: links (the A100 compute fit by datasheet, collectives from the H100 NVSwitch's
    own curve, H100_LINKS: compute held out), carried (links too by the NVLink ratio: nothing of the H100
    fitted on) or entry (the H100 entry of deploy/hardware.yaml, fitted on the H100 rows: in-sample)."""
    consts, report = constants(tables_dir)
    hws = {"a100": load_hardware("a100"), "h100": load_hardware("h100")}
    nets = {g: load_tables([tables_dir / f]).all_reduce[0] for g, f in NETWORK.items()}
    if h100 == "links":
        consts["h100"] = replace(consts["h100"], allreduce=hws["h100"].step.allreduce)
    elif h100 == "entry":
        consts["h100"] = hws["h100"].step
    cases = []
    for set_name, gpu, compute, att_name in SETS:
        tabs = load_tables([tables_dir / compute] + ([tables_dir / att_name] if att_name else []))
        ct = tabs.compute[0]
        att = next((a for a in tabs.attention if (a.shape.heads, a.shape.kv_heads, a.shape.hidden) ==
                    (ct.shape.heads, ct.shape.kv_heads, ct.shape.hidden)), None)
        for tp in TPS:
            grid = [("prefill", dict(n=n), f"N={n}") for n in PREFILL] + \
                   [("decode", dict(b=b, c=c), f"B={b},C={c}") for b, c in DECODE]
            for phase, kw, what in grid:
                got = compose(ct, att, nets[gpu], hws[gpu], consts[gpu], tp, phase, **kw)
                if got is None:
                    continue
                measured, predicted, full, with_att, _ = got
                old = old_roofline(ct, hws[gpu], tp, phase, with_att, **kw)
                label = "h100 in-sample" if gpu == "h100" and h100 == "entry" else set_name
                cases.append(Case(label, gpu, model_name(ct), tp, phase, what, with_att, measured, predicted,
                                  full, old))
    return cases, report


def summary(cases: list[Case]) -> dict:
    r = [c.ratio for c in cases]
    old = [c.old_ratio for c in cases if c.old_ratio is not None]
    out = {"n": len(r), "median": statistics.median(r), "min": min(r), "max": max(r),
           "outside": sum(1 for x in r if not CASE_BAND[0] <= x <= CASE_BAND[1])}
    if old:
        out.update(old_median=statistics.median(old), old_worst=max(old, key=lambda x: abs(math.log(x))))
    out["pass"] = MEDIAN_BAND[0] <= out["median"] <= MEDIAN_BAND[1] and out["outside"] == 0
    return out


def groups(cases: list[Case]) -> list[tuple[str, list[Case]]]:
    """The acceptance groups (set x phase over TP 1/2/4, and per TP) and the issue's rows."""
    out = []
    for set_name in dict.fromkeys(c.set for c in cases):
        for phase in ("prefill", "decode"):
            mine = [c for c in cases if c.set == set_name and c.phase == phase]
            out.append((f"{set_name} {phase}, TP 1/2/4", [c for c in mine if c.tp <= 4]))
            gpus = sorted({c.gpu for c in mine})
            for gpu in gpus if len(gpus) > 1 else ():
                out.append((f"{set_name} {phase}, {gpu.upper()} only, TP 1/2/4", [c for c in mine if c.tp <= 4 and c.gpu == gpu]))
            for tp in TPS:
                out.append((f"{set_name} {phase}, TP {tp}", [c for c in mine if c.tp == tp]))
    issue = [("Llama-3-8B A100 TP1", lambda c: c.model == "meta-llama-3-8b" and c.tp == 1 and c.attention),
             ("Llama-3-8B A100 TP4", lambda c: c.model == "meta-llama-3-8b" and c.tp == 4 and c.attention),
             ("Llama-3-70B A100 TP2", lambda c: c.model == "meta-llama-3-70b" and c.tp == 2 and c.attention),
             ("H100, without attention, TP1", lambda c: c.gpu == "h100" and c.tp == 1),
             ("H100, without attention, TP>1", lambda c: c.gpu == "h100" and c.tp > 1)]
    for name, pick in issue:
        for phase in ("prefill", "decode"):
            out.append((f"issue row: {name} {phase}", [c for c in cases if pick(c) and c.phase == phase]))
    return [(n, cs) for n, cs in out if cs]


def case_table(cases: list[Case]) -> str:
    lines = ["| set | GPU | model | TP | case | attention | measured ms | predicted ms | ratio | full step ms "
             "| old roofline ratio |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in cases:
        flag = "" if CASE_BAND[0] <= c.ratio <= CASE_BAND[1] else " **out**"
        lines.append(f"| {c.set} | {c.gpu} | {c.model} | {c.tp} | {c.phase} {c.what} | {'yes' if c.attention else 'no'} "
                     f"| {1e3 * c.measured:.2f} | {1e3 * c.predicted:.2f} | {c.ratio:.2f}{flag} | {1e3 * c.full:.2f} "
                     f"| {c.old_ratio:.2f} |")
    return "\n".join(lines)


def summary_table(cases: list[Case]) -> str:
    lines = ["| group | cases | median | min | max | outside 0.75-1.33 | pass | old roofline median / worst |",
             "|---|---|---|---|---|---|---|---|"]
    for name, cs in groups(cases):
        s = summary(cs)
        old = f"{s['old_median']:.2f} / {s['old_worst']:.2f}" if "old_median" in s else "-"
        lines.append(f"| {name} | {s['n']} | {s['median']:.2f} | {s['min']:.2f} | {s['max']:.2f} | {s['outside']} "
                     f"| {'yes' if s['pass'] else 'NO'} | {old} |")
    return "\n".join(lines)
