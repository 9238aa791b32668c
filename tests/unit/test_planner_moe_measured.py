"""The planner's MoE step against public measured fused-MoE kernel times and a served step (issue 35), from
data/gpu_profiles/moe/ (sources in its README). The bands are the ones found, not targets: each assertion
message carries the ratios per point (planner / measured); bench/checks/moe_measured_check.py prints the
tables. Pure Python, milliseconds."""
from __future__ import annotations

import pytest

from cluster.planner.calibrate.moe_check import (hardware_for, kernel_points, latency_for, load_kernel_rows,
                                                 load_serving_rows, serving_points, spread, step_points)
from cluster.planner.calibrate.vidur_tables import ProfileTableError
from cluster.planner.latency import moe


def _ratios(points) -> str:
    return ", ".join(f"{p.row.tokens if hasattr(p.row, 'tokens') else p.row.concurrency}:{p.ratio:.2f}"
                     for p in points)


@pytest.fixture(scope="module")
def rows():
    return load_kernel_rows()


def test_tables_cover_the_catalog_shapes_they_name(rows):
    assert {(r.source, r.gpu, r.dtype, r.model, r.tp) for r in rows} == {
        ("vllm-pr-24700-mixtral", "H100-SXM-80GB", "bfloat16", "mixtral-8x7b", 2),
        ("vllm-pr-19049-qwen3", "A100-PCIe-40GB", "bfloat16", "qwen3-30b-a3b", 1),
        ("vllm-pr-24700-qwen3-fp8", "H100-SXM-80GB", "fp8_w8a8", "qwen3-30b-a3b", 1)}
    assert len(rows) == 43 and min(r.tokens for r in rows) == 1 and max(r.tokens for r in rows) == 4096
    pcie = hardware_for("A100-PCIe-40GB")
    assert pcie.hbm_bw == pytest.approx(1555e9) and pcie.peak_flops == pytest.approx(312e12)


def test_bf16_fused_moe_kernels_within_0_85_to_1_12_of_the_planner(rows):
    points = [p for p in kernel_points(rows) if p.row.dtype == "bfloat16"]
    assert len(points) == 25
    for source in ("vllm-pr-24700-mixtral", "vllm-pr-19049-qwen3"):
        mine = [p for p in points if p.row.source == source]
        assert all(0.85 <= p.ratio <= 1.12 for p in mine), f"{source}: {_ratios(mine)}"
        # from 8 tokens up (a decode batch's MoE layers read most touched experts whole): 1.0-1.1
        big = [p for p in mine if p.row.tokens >= 8]
        assert all(1.0 <= p.ratio <= 1.11 for p in big), f"{source}: {_ratios(big)}"
    median, low, high = spread([p.ratio for p in points])
    assert 1.0 <= median <= 1.08 and low >= 0.85 and high <= 1.12, _ratios(points)


def test_routing_kernels_close_the_one_token_gap(rows, monkeypatch):
    """Before the routing term (ROUTE_KERNELS launches at the GEMM floor) the planner was 0.68-0.89 at one
    token: the measured kernels' top-k, sort and sum launches beyond the experts' weight reads."""
    one = [r for r in rows if r.tokens == 1 and r.dtype == "bfloat16"]
    after = {p.row.source: p.ratio for p in kernel_points(one)}
    monkeypatch.setattr(moe, "ROUTE_KERNELS", 0)
    before = {p.row.source: p.ratio for p in kernel_points(one)}
    assert before["vllm-pr-24700-mixtral"] == pytest.approx(0.89, abs=0.01)
    assert before["vllm-pr-19049-qwen3"] == pytest.approx(0.68, abs=0.01)
    assert after["vllm-pr-24700-mixtral"] == pytest.approx(1.01, abs=0.01)
    assert after["vllm-pr-19049-qwen3"] == pytest.approx(0.86, abs=0.01)


def test_fp8_kernels_follow_the_experts_curve_at_decode_sizes_only(rows):
    """fp8 priced as bf16 at twice the bytes/s and FLOP/s: 0.83-0.94 up to 128 tokens (the experts-touched curve
    of E=128, k=8 holds); beyond, the untuned fp8 kernel computes far below 2x bf16 (not planned: bf16 only)."""
    points = [p for p in kernel_points(rows) if p.row.dtype == "fp8_w8a8"]
    small = [p for p in points if p.row.tokens <= 128]
    assert all(0.8 <= p.ratio <= 0.95 for p in small), _ratios(small)
    large = [p for p in points if p.row.tokens >= 256]
    assert all(p.ratio < 0.7 for p in large) and large[-1].ratio < 0.3, _ratios(large)
    assert [p.ratio for p in large] == sorted((p.ratio for p in large), reverse=True)


def test_decode_steps_composed_from_measured_moe_layers_within_0_9_to_1_1(rows):
    points = step_points(rows)
    assert len(points) == 22 and max(p.row.tokens for p in points) == 256  # bf16 rows at decode batch sizes
    assert all(0.9 <= p.ratio <= 1.1 for p in points), _ratios(points)
    median, _, _ = spread([p.ratio for p in points])
    assert 1.0 <= median <= 1.06, _ratios(points)
    # the MoE layers are most of a decode step: the composition tests them, not the attention around them
    assert all(0.45 <= p.moe_share <= 0.8 for p in points)


def test_served_qwen3_steps_alone_match_and_at_batch_10_are_overpredicted_by_a_quarter():
    """Served Qwen3-30B-A3B (vLLM, bf16, TP 1). One request at a time on an A100 (Tenstorrent's GPU reference
    sweep): 0.90-0.95, a token's 8 experts whatever the routing. Concurrency 10 on an H100 (mean TPOT 13.18 ms)
    vs the planner's decode step at batch 10 plus the other prompts' prefills: 1.25. Uniform routing reads 60
    distinct experts a layer there (0.57 GB, 170 us at the H100's peak bandwidth); the measured step leaves the
    experts about 150 us a layer: the served tokens touch fewer experts than uniform routing (skew; not
    modelled). Different GPUs and engines' versions, one batch-10 point: no term fitted to it."""
    points = serving_points(load_serving_rows())
    (ten,) = [p for p in points if p.row.concurrency == 10]
    assert ten.ratio == pytest.approx(1.25, abs=0.03)
    lat = latency_for("qwen3-30b-a3b", 1, "H100")
    assert lat.model.moe_layers * lat.expert_mlp(10) > 0.6 * ten.decode_s  # experts: most of the step
    alone = [p for p in points if p.row.concurrency == 1]
    assert len(alone) == 7 and all(0.88 <= p.ratio <= 0.97 for p in alone), _ratios(alone)
    assert all(p.prefill_share_s == 0 for p in alone)


def test_tables_refuse_bad_cells_naming_file_row_and_column(tmp_path):
    good = load_kernel_rows()
    header = ("source,gpu,dtype,model,tp,experts,top_k,hidden,expert_ffn,config,tokens,kernel_us\n")
    cases = (("s,H100,bfloat16,mixtral-8x7b,2,8,2,4096,14336,tuned,1,144\n", "column expert_ffn: 14336 is not"),
             ("s,B300,bfloat16,mixtral-8x7b,2,8,2,4096,7168,tuned,1,144\n", "column gpu: 'B300'"),
             ("s,H100,int4,mixtral-8x7b,2,8,2,4096,7168,tuned,1,144\n", "column dtype: 'int4'"),
             ("s,H100,bfloat16,llama-3-8b,1,8,2,4096,7168,tuned,1,144\n", "column model: llama-3-8b has no experts"),
             ("s,H100,bfloat16,no-such-model,1,8,2,4096,7168,tuned,1,144\n", "column model: .*no-such-model"),
             ("s,H100,bfloat16,mixtral-8x7b,2,8,2,4096,7168,tuned,1,-3\n", "column kernel_us: '-3' must be positive"),
             ("s,H100,bfloat16,mixtral-8x7b,2,8,2,4096,7168,tuned,one,144\n", "column tokens: 'one' is not an integer"))
    path = tmp_path / "k.csv"
    for line, message in cases:
        path.write_text(header + line)
        with pytest.raises(ProfileTableError, match=f"k.csv:2: {message}"):
            load_kernel_rows(path)
    path.write_text("source,gpu\n")
    with pytest.raises(ProfileTableError, match="missing column"):
        load_kernel_rows(path)
    assert good  # the shipped table loads
