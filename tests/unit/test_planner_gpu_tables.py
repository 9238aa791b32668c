"""Measured GPU tables (Vidur's layout) -> fitted step constants -> `pdserve fit-gpu` / `pdserve plan
--profile TABLES`; bad tables refused by file, row and column; the GPU check on the repository's tables
(data/gpu_profiles/vidur) meets the issue's bands on the fitted set."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.planner.calibrate import gpu_check as check
from cluster.planner.calibrate.gpu_fit import fit_constants
from cluster.planner.calibrate.vidur_tables import ProfileTableError, load_tables
from cluster.planner.inputs.gpu_constants import entry_dict
from cluster.planner.inputs.hardware import load_hardware
from cluster.planner.inputs.models import load_model
from cluster.planner.latency.base import Parallel
from cluster.planner.latency.gpu_latency import OperatorLatency
from cluster.planner.latency.profiles import latency_model, load_profile

ROOT = Path(__file__).resolve().parents[2]

FIXTURE = ROOT / "tests" / "data" / "gpu_tables"  # made from these constants by the model itself
KNOWN = {"gemm": {"eff": 0.7, "mem_eff": 0.85, "floor_us": 6.0, "sharpness": 8.0, "n_half": 64.0},
         "small_ops": {"norm": {"floor_us": 4.0, "mem_eff": 0.35, "sharpness": 2.0},
                       "rope": {"floor_us": 3.0, "mem_eff": 0.4, "sharpness": 2.0},
                       "act": {"floor_us": 3.5, "mem_eff": 0.5, "sharpness": 2.0},
                       "add": {"floor_us": 2.0, "mem_eff": 0.9, "sharpness": 2.0},
                       "emb": {"floor_us": 5.0, "mem_eff": 0.15, "sharpness": 2.0}},
         "attention": {"prefill_floor_us": 8.0, "prefill_eff": 0.55, "prefill_occupancy": 250.0,
                       "decode_floor_us": 20.0, "decode_mem_eff": 0.85, "kv_write_floor_us": 2.0,
                       "kv_write_token_us": 0.3},
         "allreduce": {2: {"latency_us": 30.0, "bus_gbs": 150.0, "sharpness": 1.0},
                       4: {"latency_us": 35.0, "bus_gbs": 140.0, "sharpness": 1.0}}}


def _close(got, want, rel):
    if isinstance(want, dict):
        assert set(got) == set(want)
        for k in want:
            _close(got[k], want[k], rel)
    else:
        assert got == pytest.approx(want, rel=rel)


def test_the_fit_recovers_the_constants_the_tables_were_made_from():
    a100 = load_hardware("a100")
    tables = load_tables([FIXTURE])
    assert (len(tables.compute), len(tables.attention), len(tables.all_reduce)) == (1, 1, 1)
    assert sorted(tables.all_reduce[0].curves) == [2, 4]  # the cross-node row is not a TP ring
    step, report = fit_constants(tables, a100, a100.step)
    got = entry_dict(step)
    _close({k: got[k] for k in KNOWN}, KNOWN, rel=0.01)
    assert got["step_cpu_ms"] == entry_dict(a100.step)["step_cpu_ms"]  # not in tables: the entry's
    assert report["kept"] == ["p2p_latency", "step_cpu"] and report["gemm"]["max_rel_err"] < 1e-3
    # a compute table alone refits GEMMs and small ops; attention and links stay the entry's
    alone, rep = fit_constants(load_tables([FIXTURE / "a100_tiny_mlp.csv"]), a100, a100.step)
    assert alone.attention == a100.step.attention and alone.allreduce == a100.step.allreduce
    assert alone.gemm.eff == pytest.approx(0.7, rel=0.01) and "attention" in rep["kept"]


def _edit(tmp_path: Path, name: str, line: int, col: str, value: str | None) -> Path:
    """A copy of a fixture table with one cell replaced (value None: the column dropped)."""
    rows = [r.split(",") for r in (FIXTURE / name).read_text().splitlines()]
    i = rows[0].index(col)
    if value is None:
        rows = [r[:i] + r[i + 1:] for r in rows]
    else:
        rows[line - 1][i] = value
    out = tmp_path / name
    out.write_text("\n".join(",".join(r) for r in rows) + "\n")
    return out


MLP, UP = "a100_tiny_mlp.csv", "time_stats.mlp_up_proj.median"


@pytest.mark.parametrize("name,line,col,value,message", [
    (MLP, 1, "time_stats.mlp_act.median", None, "row 1, column 'time_stats.mlp_act.median': missing from the header"),
    (MLP, 4, UP, "abc", f"row 4, column '{UP}': 'abc' is not a number"),
    (MLP, 7, UP, "", f"row 7, column '{UP}': empty cell"),
    (MLP, 3, UP, "-0.5", f"row 3, column '{UP}': -0.5 is not a positive finite number"),
    (MLP, 2, "use_gated_mlp", "maybe", "row 2, column 'use_gated_mlp': 'maybe' is not true/false"),
    (MLP, 5, "num_tokens", "2.5", "row 5, column 'num_tokens': 2.5 is not a whole number"),
    (MLP, 9, "n_embd", "8192", "row 9, column 'n_embd': a second model shape in one table"),
    ("a100_tiny_attention.csv", 10, "kv_cache_size", "x", "row 10, column 'kv_cache_size': 'x' is not a number"),
    ("a100_tiny_attention.csv", 1, "is_prefill", None, "row 1, column 'is_prefill'"),
    ("a100_tiny_all_reduce.csv", 6, "size", "nan", "row 6, column 'size': nan is not a positive finite number"),
])
def test_a_malformed_table_is_refused_naming_file_row_and_column(tmp_path, name, line, col, value, message):
    bad = _edit(tmp_path, name, line, col, value)
    with pytest.raises(ProfileTableError) as e:
        load_tables([bad])
    assert str(e.value).startswith(f"{bad}: ") and message in str(e.value)


def test_incomplete_or_foreign_tables_are_refused(tmp_path):
    (tmp_path / "empty.csv").write_text("time_stats.mlp_up_proj.median,num_tokens\n")
    (tmp_path / "blank.csv").write_text((FIXTURE / MLP).read_text().splitlines()[0] + "\n,,\n")
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    (tmp_path / "ar.csv").write_text("time_stats.all_reduce.median,num_workers,size,devices_per_node\n0.1,4,2048,2\n")
    for name, message in (("empty.csv", "row 2: no data rows"), ("blank.csv", "row 2: no data rows"),
                          ("other.csv", "row 1: not a Vidur compute"),
                          ("ar.csv", "no single-node all-reduce rows")):
        with pytest.raises(ProfileTableError, match=message):
            load_tables([tmp_path / name])
    (tmp_path / "pts.json").write_text(json.dumps({"a100/Tiny": {"prefill": {"tp1": {"128": [0.01, 0.02]}},
                                                                  "decode": {}}}))
    shutil.copy(FIXTURE / MLP, tmp_path / "a100_tiny_mlp.csv")
    assert load_tables([tmp_path / "a100_tiny_mlp.csv", tmp_path / "pts.json"]).attention[0].prefill[(1, 128, 0)]
    (tmp_path / "pts.json").write_text(json.dumps({"a100/Tiny": {"prefill": {"tp1": {"128": ["fast", 0.02]}},
                                                                  "decode": {}}}))
    with pytest.raises(ProfileTableError, match=r"pts.json: entry 'a100/Tiny': 'fast' is not a positive time"):
        load_tables([tmp_path / "a100_tiny_mlp.csv", tmp_path / "pts.json"])
    with pytest.raises(ProfileTableError, match="no compute table of other"):
        (tmp_path / "p2.json").write_text(json.dumps({"a100/Other": {"prefill": {}, "decode": {}}}))
        load_tables([tmp_path / "p2.json"])


def test_fit_gpu_writes_a_profile_plan_reads(tmp_path, capsys):
    out = tmp_path / "tiny.json"
    assert main(["fit-gpu", str(FIXTURE), "--hardware", "a100", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "step: block for deploy/hardware.yaml" in text and "gemm: 48 rows" in text
    prof = load_profile(str(out))
    lat = latency_model(load_model("llama-3-8b"), load_hardware("a100"), Parallel(2, 1), profile=prof)
    assert isinstance(lat, OperatorLatency) and lat.c.gemm.eff == pytest.approx(0.7, rel=0.01)
    bad = _edit(tmp_path, MLP, 4, UP, "abc")
    assert main(["fit-gpu", str(bad), "--hardware", "a100"]) == 2
    assert f"error: {bad}: row 4, column '{UP}': 'abc' is not a number" in capsys.readouterr().err


def _plan(tmp_path, profile: str) -> list[str]:
    return ["plan", "--model", "smollm2-135m", "--hardware", "a100", "--nodes", "1", "--gpus-per-node", "1",
            "--input-len", "uniform:100:300", "--output-len", "20", "--rate", "5", "--ttft-ms", "200",
            "--tpot-ms", "50", "--profile", profile, "--out", str(tmp_path / "cluster.yaml")]


def test_plan_takes_measured_tables_as_its_profile(tmp_path, capsys):
    tables = f"{FIXTURE / MLP},{FIXTURE / 'a100_tiny_all_reduce.csv'}"
    assert main(_plan(tmp_path, tables)) == 0
    header = (tmp_path / "cluster.yaml").read_text()
    assert "latency model: GPU step model fitted from a100_tiny_mlp.csv,a100_tiny_all_reduce.csv" in header
    bad = _edit(tmp_path, MLP, 6, "time_stats.emb.median", "")
    assert main(_plan(tmp_path, str(bad))) == 2
    assert f"error: {bad}: row 6, column 'time_stats.emb.median': empty cell" in capsys.readouterr().err


def test_the_hardware_entries_are_the_fits_of_their_tables():
    """deploy/hardware.yaml's A100 block is the fit of the check's fitted rows; the H100 block the fit of
    the H100 rows (attention, p2p and CPU kept from the A100's)."""
    a100, h100 = load_hardware("a100"), load_hardware("h100")
    fitted, _ = fit_constants(load_tables([check.DEFAULT_TABLES / f for f in check.FIT_ON]), a100, a100.step)
    h100_files = ("h100_meta-llama_Llama-2-7b-hf_mlp.csv", "h100_meta-llama_Llama-2-70b-hf_mlp.csv",
                  "h100_dgx_all_reduce.csv")
    h_fit, _ = fit_constants(load_tables([check.DEFAULT_TABLES / f for f in h100_files]), h100, h100.step)
    for fit, entry in ((fitted, a100.step), (h_fit, h100.step)):
        want = {k: v for k, v in entry_dict(entry).items() if k != "source"}
        _close({k: v for k, v in entry_dict(fit).items() if k != "source"}, want, rel=2e-3)
    assert h100.step.attention == a100.step.attention


def test_the_gpu_check_meets_the_bands_on_the_fitted_and_the_held_out_sets():
    cases, report = check.run(check.DEFAULT_TABLES)
    assert "allreduce" in report["fitted"] and len(cases) == 312
    groups = dict(check.groups(cases))
    for phase in ("prefill", "decode"):
        for name in (f"fitted {phase}, TP 1/2/4", f"held-out {phase}, TP 1/2/4"):
            assert check.summary(groups[name])["pass"], (name, check.summary(groups[name]))
        old = [c.old_ratio for c in groups[f"fitted {phase}, TP 1/2/4"]]
        assert min(old) < check.CASE_BAND[0]  # the roofline before it missed these cases
    assert all(c.predicted > 0 and c.full > c.predicted for c in cases)
    # the 70B TP 1 prefill of 512 tokens on the H100 (1.35 with a soft compute/memory knee carried from the
    # A100): the token ramp (n_half) leaves the H100, whose ridge lies at twice the tokens, a sharper knee
    h = next(c for c in cases if (c.gpu, c.model, c.tp, c.what) == ("h100", "llama-2-70b-hf", 1, "N=512"))
    assert h.ratio < 1.3


def test_carrying_the_a100_link_to_the_h100_misses_only_the_small_two_gpu_all_reduces():
    """The documented reason for taking the H100 NVSwitch's own curve: with the A100's carried, only the
    decode steps of 8 KB all-reduces on 2 GPUs (7 us measured, 31 us carried) leave the band at TP 1/2/4."""
    cases, _ = check.run(check.DEFAULT_TABLES, h100="carried")
    out = {(c.gpu, c.model, c.tp, c.what) for c in cases if c.tp <= 4 and not
           check.CASE_BAND[0] <= c.ratio <= check.CASE_BAND[1]}
    assert out == {("h100", "llama-2-7b-hf", 2, "B=1,C=512"), ("h100", "llama-2-7b-hf", 2, "B=1,C=2048")}
