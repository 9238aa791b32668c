"""Fit the GPU step model's constants (`StepConstants`) to measured operator tables (`vidur_tables`).

    fit_constants(tables, hw, base) -> (StepConstants, report)
    table_profile("a.csv,b.csv" | DIR, hw) -> Profile   the tables fitted on the spot (`pdserve plan --profile`)

Each group is fitted where the tables have it, else kept from `base` (the hardware entry's block):
  gemm        attn_pre_proj, attn_post_proj, mlp_up_proj, mlp_down_proj of every compute table: floor, eff,
              mem_eff and n_half of `gpu_latency.gemm_time` (its smooth max held at GEMM_SHARPNESS, a hard
              max) by Nelder-Mead on the squared log ratio
  small ops   per kind (norm: both layernorms; rope, act, add, emb): smooth max of a floor and bytes /
              bandwidth, Nelder-Mead as the GEMMs
  attention   prefill rows: floor, 1/eff and occupancy/eff (linear in 1, FLOPs, FLOPs/query blocks);
              decode rows: floor + KV bytes; KV write: floor + prompt tokens (decode rows: the floor)
  allreduce   per GPU count of one node: smooth max of a latency and bytes x 2(n-1)/n / bus bandwidth
Rows are weighted so that each octave of tokens (bytes) counts alike: the profilers' grids are dense at
large sizes, decode lives at the small ones.
Linear groups use `fit.nonneg_lstsq` (relative error, coefficients >= 0). `p2p_latency` and `step_cpu`
are not in the tables: always `base`'s. Units: the tables' seconds; the hardware's datasheet peaks turn
seconds into efficiencies. Numpy, no torch. Who calls: `pdserve fit-gpu`, `commands/plan_inputs.py` (a
table given to `pdserve plan --profile`), bench/checks/planner_gpu_check.py.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from cluster.planner.calibrate.fit import nonneg_lstsq
from cluster.planner.calibrate.vidur_tables import LayerShape, Tables, load_tables
from cluster.planner.errors import BadConfigError
from cluster.planner.inputs.gpu_constants import SMALL_OPS, AttentionConst, GemmConst, LinkConst, OpConst, StepConstants
from cluster.planner.inputs.hardware import Hardware
from cluster.planner.latency.gpu_latency import QUERY_BLOCK, RankShape, small_bytes
from cluster.planner.latency.profiles import Profile

GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
SMALL_COLUMNS = {"norm": ("input_layernorm", "post_attention_layernorm"), "rope": ("attn_rope",),
                 "act": ("mlp_act",), "add": ("add",), "emb": ("emb",)}


def rank_shape(layer: LayerShape, tp: int) -> RankShape:
    hd = layer.head_dim
    kv_heads = max(1.0, layer.kv_heads / tp)
    return RankShape(layer.hidden, layer.heads / tp, layer.heads * hd / tp, kv_heads * hd, layer.ffn / tp,
                     layer.gated, True, layer.vocab / tp)


def gemm_shapes(s: RankShape, n: float) -> dict[str, tuple[float, float, float]]:
    """(n, k, m) of the four projections of a layer, by the compute tables' column names."""
    return {"attn_pre_proj": (n, s.hidden, s.q_dim + 2 * s.kv_dim), "attn_post_proj": (n, s.q_dim, s.hidden),
            "mlp_up_proj": (n, s.hidden, (2 if s.gated else 1) * s.ffn), "mlp_down_proj": (n, s.ffn, s.hidden)}


def nelder_mead(fun, x0, step: float = 0.3, iters: int = 2000, tol: float = 1e-12):
    """Minimise `fun` from `x0` (a small simplex search; deterministic)."""
    pts = [np.asarray(x0, float)] + [np.asarray(x0, float) + step * e for e in np.eye(len(x0))]
    vals = [fun(p) for p in pts]
    for _ in range(iters):
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < tol:
            break
        centre = np.mean(pts[:-1], axis=0)
        refl = centre + (centre - pts[-1])
        fr = fun(refl)
        if fr < vals[0]:
            exp = centre + 2 * (centre - pts[-1])
            fe = fun(exp)
            pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            con = centre + 0.5 * (pts[-1] - centre)
            fc = fun(con)
            if fc < vals[-1]:
                pts[-1], vals[-1] = con, fc
            else:
                pts = [pts[0]] + [pts[0] + 0.5 * (p - pts[0]) for p in pts[1:]]
                vals = [vals[0]] + [fun(p) for p in pts[1:]]
    best = int(np.argmin(vals))
    return pts[best], vals[best]


def octave_weights(sizes) -> np.ndarray:
    """1 / (rows in the same power-of-two size bucket): every octave of tokens or bytes counts alike (the
    profilers' grids are dense in large sizes; decode lives in the small ones)."""
    bucket = np.floor(np.log2(np.maximum(np.asarray(sizes, float), 1.0)))
    _, inverse, counts = np.unique(bucket, return_inverse=True, return_counts=True)
    return 1.0 / counts[inverse]


SHARPNESS = (0.5, 8.0)  # the smooth max's p is kept in here: a step-like table (NCCL switching protocols)
# otherwise drives it to a degenerate curve (p -> 0 with an absurd bandwidth)


GEMM_SHARPNESS = SHARPNESS[1]  # a GEMM's compute and weight streaming overlap (a hard max); what softens the
# measured knee is the tile quantization of few tokens (`n_half`). On one GPU the two forms are confounded (its
# ridge sits at one token count: on the A100 rows a free soft knee fits a little better, mean error 6.3% vs
# 6.8%); carried to the H100, whose ridge lies at twice the tokens, only the token ramp holds (the soft knee
# put a 512-token Llama-2-70B prefill at 1.35x the measured step; bench/checks/planner_gpu_check.py)


def _sharp(p):
    return np.clip(p, *SHARPNESS)


def fit_log(predict, x0, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Parameters (log space) minimising the weighted mean squared log ratio of predict(x) to y."""
    x, _ = nelder_mead(lambda x: float(np.sum(w * np.log(predict(x) / y) ** 2) / np.sum(w)), np.log(x0))
    return x


def _errors(pred: np.ndarray, y: np.ndarray) -> dict:
    rel = np.abs(pred - y) / y
    return {"points": int(len(y)), "mean_rel_err": round(float(rel.mean()), 4), "max_rel_err": round(float(rel.max()), 4)}


def fit_gemm(tables: Tables, hw: Hardware) -> tuple[GemmConst, dict]:
    """floor, eff, mem_eff and n_half of `gpu_latency.gemm_time`, its smooth max held at GEMM_SHARPNESS."""
    rows = [(*gemm_shapes(rank_shape(t.shape, tp), n)[op], ops[op])
            for t in tables.compute for (tp, n), ops in t.rows.items() for op in GEMM_OPS]
    n, k, m, y = (np.array(col, float) for col in zip(*rows))
    flops, nbytes = 2 * k * m / hw.peak_flops, 2 * (k * m + n * k + n * m) / hw.hbm_bw
    p = GEMM_SHARPNESS

    def predict(x):
        floor, eff, mem_eff, n_half = np.exp(x)
        return floor + ((flops * (n + n_half) / eff) ** p + (nbytes / mem_eff) ** p) ** (1 / p)

    x = fit_log(predict, [5e-6, 0.7, 0.8, 64.0], y, octave_weights(n))
    floor, eff, mem_eff, n_half = np.exp(x)
    return GemmConst(float(eff), float(mem_eff), float(floor), p, float(n_half)), _errors(predict(x), y)


def _line(x: list[list[float]], y: list[float], what: str) -> tuple[np.ndarray, dict]:
    if len(y) < len(x[0]):
        raise BadConfigError(f"{what}: {len(y)} measurements, {len(x[0])} needed to fit")
    xa, ya = np.array(x, float), np.array(y, float)
    coef = nonneg_lstsq(xa, ya)
    return coef, _errors(xa @ coef, ya)


def _eff(inverse: float) -> float:
    return 1.0 / inverse if inverse > 0 else 1.0  # a zero slope: the term never binds; peak is the bound


def fit_small(tables: Tables, hw: Hardware) -> tuple[tuple[tuple[str, OpConst], ...], dict]:
    out, report = [], {}
    for kind in SMALL_OPS:
        rows = [(n, small_bytes(kind, rank_shape(t.shape, tp), n) / hw.hbm_bw, ops[col])
                for t in tables.compute for (tp, n), ops in t.rows.items() for col in SMALL_COLUMNS[kind]]
        n, seconds, y = (np.array(col, float) for col in zip(*rows))
        floor, eff, p, report[kind] = _fit_knee(seconds, y, n, [4e-6, 0.5, 2.0])
        out.append((kind, OpConst(floor, eff, p)))
    return tuple(out), report


def _fit_knee(work: np.ndarray, y: np.ndarray, scale: np.ndarray, start: list[float]):
    """(a, b, p, errors) of y ~ (a^p + (work / b)^p)^(1/p): a fixed floor and a rate, joined by a soft knee
    of sharpness p; points weighted per octave of `scale`."""
    def predict(x):
        a, b, p = np.exp(x)
        p = _sharp(p)
        return (a ** p + (work / b) ** p) ** (1 / p)

    x = fit_log(predict, start, y, octave_weights(scale))
    a, b, p = np.exp(x)
    return float(a), float(b), float(_sharp(p)), _errors(predict(x), y)


def fit_attention(tables: Tables, hw: Hardware) -> tuple[AttentionConst, dict]:
    pre_x, pre_y, dec_x, dec_y, kv_x, kv_y = [], [], [], [], [], []
    for t in tables.attention:
        for (tp, chunk, cached), (attn, kv) in t.prefill.items():
            s = rank_shape(t.shape, tp)
            flops = 2 * chunk * (2 * cached + chunk) * s.q_dim / hw.peak_flops
            pre_x.append([1.0, flops, flops / max(1.0, s.heads * chunk / QUERY_BLOCK)])
            pre_y.append(attn)
            if kv is not None and kv > 0:
                kv_x.append([1.0, chunk])
                kv_y.append(kv)
        for (tp, batch, context), (attn, kv) in t.decode.items():
            s = rank_shape(t.shape, tp)
            dec_x.append([1.0, batch * context * 2 * s.kv_dim * 2 / hw.hbm_bw])
            dec_y.append(attn)
            if kv is not None and kv > 0:
                kv_x.append([1.0, 0.0])
                kv_y.append(kv)
    pre, r_pre = _line(pre_x, pre_y, "prefill attention")
    dec, r_dec = _line(dec_x, dec_y, "decode attention")
    kv, r_kv = _line(kv_x, kv_y, "KV-cache write") if kv_y else (np.zeros(2), {"points": 0})
    eff = _eff(pre[1])
    occupancy = pre[2] / pre[1] if pre[1] > 0 else 0.0
    return (AttentionConst(float(pre[0]), eff, float(occupancy), float(dec[0]), _eff(dec[1]), float(kv[0]), float(kv[1])),
            {"prefill": r_pre, "decode": r_dec, "kv_write": r_kv})


def fit_allreduce(tables: Tables) -> tuple[tuple[tuple[int, LinkConst], ...], dict]:
    curves: dict[int, list] = {}
    for t in tables.all_reduce:
        for n, pts in t.curves.items():
            curves.setdefault(n, []).extend(pts)
    out, report = [], {}
    for n, pts in sorted(curves.items()):
        size, y = (np.array(col, float) for col in zip(*pts))
        ring = size * 2 * (n - 1) / n
        latency, bus_bw, p, report[n] = _fit_knee(ring, y, size, [30e-6, 100e9, 1.5])
        out.append((n, LinkConst(latency, bus_bw, p)))
    return tuple(out), report


def fit_constants(tables: Tables, hw: Hardware, base: StepConstants) -> tuple[StepConstants, dict]:
    """Constants fitted from `tables` measured on `hw`; groups the tables lack stay `base`'s."""
    c, report = base, {"tables": tables.paths, "hardware": hw.name, "fitted": [], "kept": []}
    if tables.compute:
        gemm, report["gemm"] = fit_gemm(tables, hw)
        small, report["small_ops"] = fit_small(tables, hw)
        c = replace(c, gemm=gemm, small=small)
        report["fitted"] += ["gemm", "small_ops"]
    else:
        report["kept"] += ["gemm", "small_ops"]
    if tables.attention:
        attention, report["attention"] = fit_attention(tables, hw)
        c = replace(c, attention=attention)
        report["fitted"].append("attention")
    else:
        report["kept"].append("attention")
    if tables.all_reduce:
        links, report["allreduce"] = fit_allreduce(tables)
        c = replace(c, allreduce=links)
        report["fitted"].append("allreduce")
    else:
        report["kept"].append("allreduce")
    report["kept"] += ["p2p_latency", "step_cpu"]
    names = ", ".join(sorted({p.rsplit("/", 1)[-1] for p in tables.paths}))
    return replace(c, source=f"fitted on {hw.name} from {names} ({', '.join(report['fitted'])}); "
                             f"kept: {', '.join(report['kept'])}"), report


def carry_links(c: StepConstants, src: Hardware, dst: Hardware) -> StepConstants:
    """`c`'s collective curves moved from `src`'s interconnect to `dst`'s: same latency, bus bandwidth
    scaled by the datasheet link ratio (for a device whose own curve was not measured)."""
    ratio = dst.intra_node_bw / src.intra_node_bw
    return replace(c, allreduce=tuple((n, LinkConst(k.latency_s, k.bus_bw * ratio)) for n, k in c.allreduce))


def table_profile(name_or_path: str, hardware: Hardware) -> Profile:
    """Fit the GPU step model to measured tables (Vidur's layout) taken on `hardware`."""
    if hardware.step is None:
        raise BadConfigError(f"{name_or_path}: measured GPU tables need a GPU --hardware with a `step:` block in "
                             f"deploy/hardware.yaml ({hardware.name} has none)")
    step, _ = fit_constants(load_tables(name_or_path.split(",")), hardware, hardware.step)
    name = ",".join(Path(p).name for p in name_or_path.split(","))
    return Profile(name, "", "bfloat16", hardware.name, step=step)
