"""The planner's step prediction from a GPU profile vs the engine's measured steps (issue 32's profile row).

Given a profile that `pdserve profile --device cuda` wrote and the JSON of measured steps from the same GPU,
print per row the planner's predicted step (`FittedLatency` over the profile's TP 1 coefficients: prefill
a + b*T + c*SQ, decode a + b*C + c*B, exactly what `pdserve plan --profile` simulates with) beside the
measured median, their ratio, and whether every row is within [--lo, --hi] (0.8-1.25 by default).

Measured steps it reads (any mix, several files):
  floor_*.json  (bench/gpu/decode_floor.py) decode rows {batch, mode, context, median_ms, kv}: the rows of
                --mode (default graphs, the engine's CUDA default) with bf16 pages; C = batch x (context + 1)
                (context: the rows' mean computed tokens; a step also attends its new token);
  steps_*.json  (bench/gpu/step_power.py) cases {phase, size, median_ms}: prefill of one `size`-token
                prompt (T = size, SQ = size^2); decode of `size` rows whose context grew from the file's
                `context` over the timed steps (mean: context + 4 + steps / 2 per row);
  rows.json     {"rows": [{"phase": "prefill", "lengths": [..], "median_ms": ..} | {"phase": "decode",
                "batch": B, "context": per-row tokens attended, "median_ms": ..}]}: anything else.

Run:  python bench/gpu/profile_check.py --profile OUT/profile_llama-3-8b.json --steps OUT/floor_random_llama-3-8b.json
      [--json OUT/profile_check.json]     exit 0: every row within; 1: some row outside; 2: bad input
Pure Python (no torch, no pydantic: the GPU machine lacks it): it runs there right after the measurements,
or here on the files they wrote. The profile is read as `pdserve plan --profile` reads its `tp.1` entry.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cluster.planner.latency.base import Coeffs, FittedLatency, Parallel  # noqa: E402


class StepsFileError(ValueError):
    """A measured-steps or profile file is none of the layouts above, or lacks a field."""


@dataclass(frozen=True)
class Row:
    source: str
    phase: str  # prefill | decode
    label: str  # what the row is, for the table
    measured_ms: float
    tokens: float = 0.0  # prefill: T
    sq: float = 0.0  # prefill: sum of squared prompt lengths
    batch: int = 0  # decode: B
    context: float = 0.0  # decode: C, the tokens all rows attend


def _prefill(source: str, lengths: list[int], ms: float) -> Row:
    label = f"{len(lengths)} x {lengths[0]}" if len(set(lengths)) == 1 else "+".join(map(str, lengths))
    return Row(source, "prefill", label, ms, tokens=sum(lengths), sq=sum(n * n for n in lengths))


def _decode(source: str, batch: int, per_row: float, ms: float, note: str = "") -> Row:
    return Row(source, "decode", f"b={batch} ctx={per_row:.0f}{note}", ms, batch=batch, context=batch * per_row)


def read_steps(path: Path, mode: str = "graphs") -> list[Row]:
    """The measured rows of one file (see the module map for the layouts)."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StepsFileError(f"{path}: {e}") from None
    src = path.name
    try:
        if "cases" in d:  # gpu_step_power.py
            rows = []
            for c in d["cases"]:
                if c["phase"] == "prefill":
                    rows.append(_prefill(src, [int(c["size"])], float(c["median_ms"])))
                else:
                    per_row = d["context"] + 4 + c["steps"] / 2
                    rows.append(_decode(src, int(c["size"]), per_row, float(c["median_ms"])))
            return rows
        if "rows" in d and d["rows"] and "mode" in d["rows"][0]:  # gpu_decode_floor.py
            return [_decode(src, int(r["batch"]), r["context"] + 1, float(r["median_ms"]), f" {mode}")
                    for r in d["rows"] if r["mode"] == mode and r.get("kv", "raw") == "raw"]
        if "rows" in d:  # the generic layout
            return [_prefill(src, [int(n) for n in r["lengths"]], float(r["median_ms"])) if r["phase"] == "prefill"
                    else _decode(src, int(r["batch"]), float(r["context"]), float(r["median_ms"]))
                    for r in d["rows"]]
    except (KeyError, TypeError, ValueError) as e:
        raise StepsFileError(f"{path}: a row lacks or mistypes {e}") from None
    raise StepsFileError(f"{path}: neither gpu_step_power's `cases`, gpu_decode_floor's `rows` nor generic `rows`")


def predict(model: FittedLatency, row: Row) -> float:
    """The planner's seconds for the row's step."""
    if row.phase == "prefill":
        return model.prefill(row.tokens, row.sq)
    return model.decode(row.batch, row.context)


def read_profile(path: str) -> tuple[dict, Coeffs]:
    """The profile's JSON and its TP 1 coefficients (the bare engine: no serving or co-run factors)."""
    try:
        d = json.loads(Path(path).read_text())
        tp1 = d["tp"]["1"]
        coeffs = Coeffs(*(tuple(float(x) for x in tp1[k]) for k in ("prefill", "decode")))
    except (OSError, ValueError) as e:
        raise StepsFileError(f"{path}: {e}") from None
    except (KeyError, TypeError) as e:
        raise StepsFileError(f"{path}: no TP 1 coefficients ({e}); not a `pdserve profile` output") from None
    if any(len(c) != 3 for c in (coeffs.prefill, coeffs.decode)):
        raise StepsFileError(f"{path}: tp.1 prefill and decode are three coefficients each")
    return d, coeffs


def check(profile_path: str, steps: list[Path], mode: str = "graphs", lo: float = 0.8, hi: float = 1.25) -> dict:
    """Every measured row beside its prediction; `ok`: all within [lo, hi]."""
    profile, coeffs = read_profile(profile_path)
    model = FittedLatency(Parallel(1, 1), coeffs)
    rows = [r for p in steps for r in read_steps(p, mode)]
    warnings = []
    for p in steps:
        other = _model_of(p)
        if other and profile.get("model") and other != profile["model"]:
            warnings.append(f"{p.name} measured {other}, the profile {profile['model']}")
    if not rows:
        raise StepsFileError(f"no {mode} rows in {', '.join(map(str, steps))}")
    out = []
    for r in rows:
        pred_ms = predict(model, r) * 1e3
        ratio = pred_ms / r.measured_ms
        out.append({**asdict(r), "predicted_ms": round(pred_ms, 3), "ratio": round(ratio, 3),
                    "within": lo <= ratio <= hi})
    return {"profile": profile_path, "profile_model": profile.get("model", ""), "hardware": profile.get("hardware", ""),
            "fit": profile["tp"]["1"].get("fit", {}), "lo": lo, "hi": hi, "rows": out, "warnings": warnings,
            "ok": all(r["within"] for r in out)}


def _model_of(path: Path) -> str:
    try:
        return str(json.loads(path.read_text()).get("model", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def table(result: dict) -> str:
    lines = [f"profile {result['profile']} ({result['profile_model']}, {result['hardware']}): planner prediction / "
             f"measured step, target {result['lo']}-{result['hi']}",
             "| source | phase | row | measured ms | predicted ms | predicted / measured | within |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['source']} | {r['phase']} | {r['label']} | {r['measured_ms']:.3f} | "
                     f"{r['predicted_ms']:.3f} | {r['ratio']:.3f} | {'yes' if r['within'] else 'NO'} |")
    lines += [f"warning: {w}" for w in result.get("warnings", [])]
    ratios = [r["ratio"] for r in result["rows"]]
    bad = sum(not r["within"] for r in result["rows"])
    lines.append(f"{len(ratios)} rows, ratio {min(ratios):.3f}-{max(ratios):.3f}: "
                 + ("all within" if result["ok"] else f"{bad} outside") + f" {result['lo']}-{result['hi']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True, help="a profile JSON from `pdserve profile --device cuda`")
    ap.add_argument("--steps", nargs="+", type=Path, required=True, help="measured-steps JSON files")
    ap.add_argument("--mode", default="graphs", help="gpu_decode_floor rows of this mode (graphs|triton|torch)")
    ap.add_argument("--lo", type=float, default=0.8)
    ap.add_argument("--hi", type=float, default=1.25)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args(argv)
    try:
        result = check(a.profile, a.steps, a.mode, a.lo, a.hi)
    except StepsFileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table(result))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
