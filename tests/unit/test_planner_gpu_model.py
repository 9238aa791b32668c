"""The planner's GPU step model (`gpu_latency`): its terms pinned on hand-worked cases, and what the model
before it got wrong (TP priced as nearly free, the LM head on every prompt token, the embedding table read
every step) checked gone."""
from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.planner.inputs.gpu_constants import (SMALL_OPS, AttentionConst, GemmConst, LinkConst, OpConst,
                                                  StepConstants, StepEntry, entry_dict, smooth_max)
from cluster.planner.inputs.hardware import load_hardware
from cluster.planner.inputs.models import load_model
from cluster.planner.latency.base import Parallel
from cluster.planner.latency.gpu_latency import (OperatorLatency, RankShape, gemm_time, layer_terms,
                                                 sampled_positions, step_terms)
from cluster.planner.latency.profiles import latency_model
from cluster.planner.latency.roofline import RooflineLatency

# Round constants, smooth max p = 1 (a plain sum), so every term below is arithmetic on one line.
HAND = StepConstants(
    GemmConst(eff=0.75, mem_eff=0.8, floor_s=5e-6, sharpness=1.0),
    tuple((k, OpConst(4e-6, 0.5, 1.0)) for k in SMALL_OPS),
    AttentionConst(prefill_floor_s=8e-6, prefill_eff=0.5, prefill_occupancy=0.0, decode_floor_s=20e-6,
                   decode_mem_eff=0.8, kv_write_floor_s=2e-6, kv_write_token_s=0.25e-6),
    ((4, LinkConst(30e-6, 150e9, 1.0)),), p2p_latency_s=25e-6, step_cpu_s=1.2e-3)


def test_a_tp4_decode_step_of_llama_3_8b_by_hand():
    """Llama-3-8B, TP 4, 8 sequences with 1,024 tokens of context each, bf16, on A100 datasheet peaks."""
    m, hw = load_model("llama-3-8b"), load_hardware("a100")
    P, BW = 312e12, 2039e9
    assert (hw.peak_flops, hw.hbm_bw) == (P, BW)
    Pc, Bm, Bs = P * 0.75, BW * 0.8, BW * 0.5  # GEMM FLOP/s, GEMM bytes/s, small-op bytes/s
    # one rank: hidden 4096, q 32/4 heads x 128 = 1024, K and V 8/4 heads x 128 = 256 each, FFN 14336/4 = 3584
    n = 8  # new tokens: one per sequence
    hand = {
        "qkv": 5e-6 + 2 * n * 4096 * 1536 / Pc + 2 * (4096 * 1536 + n * 4096 + n * 1536) / Bm,
        "o": 5e-6 + 2 * n * 1024 * 4096 / Pc + 2 * (1024 * 4096 + n * 1024 + n * 4096) / Bm,
        "up": 5e-6 + 2 * n * 4096 * 7168 / Pc + 2 * (4096 * 7168 + n * 4096 + n * 7168) / Bm,  # gate + up
        "down": 5e-6 + 2 * n * 3584 * 4096 / Pc + 2 * (3584 * 4096 + n * 3584 + n * 4096) / Bm,
        "norm": 2 * (4e-6 + 2 * n * 4096 * 2 / Bs),  # two norms, each reads and writes n x hidden
        "rope": 4e-6 + 2 * n * (1024 + 256) * 2 / Bs,  # queries and keys
        "act": 4e-6 + n * 3 * 3584 * 2 / Bs,  # reads gate and up, writes one
        "add": 4e-6 + 3 * n * 4096 * 2 / Bs,
        "prefill_attention": 0.0,
        "decode_attention": 20e-6 + 8 * 1024 * 2 * 256 * 2 / (BW * 0.8),  # K and V of 8,192 context tokens
        "kv_write": 2e-6,  # no prompt tokens: the floor
        "allreduce": 2 * (30e-6 + n * 4096 * 2 * 2 * 3 / 4 / 150e9),  # two rings of 2(n-1)/n of the message
    }
    once = {"emb": 4e-6 + 2 * n * 4096 * 2 / Bs,
            # LM head on the 8 sampled positions (32064 vocab columns per rank) and the logits gather
            "lm_head": 5e-6 + 2 * n * 4096 * 32064 / Pc + 2 * (4096 * 32064 + n * 4096 + n * 32064) / Bm
            + 30e-6 + n * 32064 * 3 * 2 / 150e9,
            "cpu": 1.2e-3}
    s = RankShape.of(m, 4)
    got = layer_terms(HAND, hw, s, 4, 0, 0, 8, 8 * 1024)
    assert got == pytest.approx(hand, rel=1e-12)
    assert step_terms(HAND, hw, s, 4, 8, 8) == pytest.approx(once, rel=1e-12)
    total = 32 * sum(hand.values()) + sum(once.values())
    assert total == pytest.approx(7.8193e-3, rel=1e-4)  # the sum above, written out
    lat = OperatorLatency(Parallel(4, 1), m, hw, HAND)
    assert lat.decode(8, 8 * 1024) == pytest.approx(total, rel=1e-12)
    # the decode line's slope is the KV read per context token of all 32 layers
    (_, slope), _ = lat.decode_lines(8)
    assert slope == pytest.approx(32 * 2 * 256 * 2 / (BW * 0.8), rel=1e-12)


def test_prefill_terms_by_hand_lm_head_on_the_last_positions_only():
    m, hw = load_model("llama-3-8b"), load_hardware("a100")
    s = RankShape.of(m, 1)
    one = step_terms(HAND, hw, s, 1, 4096, 1)["lm_head"]
    assert one == pytest.approx(5e-6 + 2 * 4096 * 128256 / (312e12 * 0.75)
                                + 2 * (4096 * 128256 + 4096 + 128256) / (2039e9 * 0.8), rel=1e-12)
    lat = OperatorLatency(Parallel(1, 1), m, hw, HAND)
    # one 4,096-token prompt samples one position; four 1,024-token prompts sample four (T^2 / SQ)
    assert (sampled_positions(4096, 4096 ** 2), sampled_positions(4096, 4 * 1024 ** 2)) == (1, 4)
    t = layer_terms(HAND, hw, s, 1, 4096, 4096 ** 2, 0, 0)
    assert lat.prefill(4096, 4096 ** 2) == pytest.approx(32 * sum(t.values()) + step_terms(HAND, hw, s, 1, 4096, 1)["emb"]
                                                          + one + 1.2e-3, rel=1e-12)
    assert t["prefill_attention"] == pytest.approx(8e-6 + 2 * 4096 ** 2 * 4096 / (312e12 * 0.5), rel=1e-12)
    assert t["kv_write"] == pytest.approx(2e-6 + 4096 * 0.25e-6, rel=1e-12)
    assert t["decode_attention"] == 0 and t["allreduce"] == 0
    # the embedding is a gather of the new tokens' rows, not a read of the 128k x 4096 table
    assert step_terms(HAND, hw, s, 1, 1, 1)["emb"] == pytest.approx(4e-6 + 2 * 4096 * 2 / (2039e9 * 0.5))


def test_gemm_knee_and_smooth_max():
    assert smooth_max(3.0, 4.0, 2.0) == pytest.approx(5.0)
    assert smooth_max(3.0, 4.0, 1.0) == pytest.approx(7.0)
    hw = load_hardware("a100")
    c = StepConstants(GemmConst(0.75, 0.8, 0.0, 8.0), HAND.small, HAND.attention, HAND.allreduce, 0.0, 0.0)
    k, mm = 4096, 14336
    big, small = gemm_time(c, hw, 8192, k, mm), gemm_time(c, hw, 1, k, mm)
    assert big == pytest.approx(2 * 8192 * k * mm / (312e12 * 0.75), rel=0.02)  # compute-bound
    assert small == pytest.approx(2 * (k * mm + k + mm) / (2039e9 * 0.8), rel=0.02)  # weight read


def test_gemm_compute_ramps_up_over_n_half_tokens_by_hand():
    """n_half: a GEMM of n tokens computes as if it had n + n_half (padded tensor-core tiles); with a plain
    sum (p = 1) the term is one line; the fast path prices it as `gemm_time` does."""
    m, hw = load_model("llama-3-8b"), load_hardware("a100")
    P, BW = 312e12, 2039e9
    c = StepConstants(GemmConst(0.75, 0.8, 5e-6, 1.0, n_half=64.0), HAND.small, HAND.attention, HAND.allreduce,
                      0.0, 0.0)
    # Llama-3-8B TP 4 qkv for 8 tokens: [8, 4096] x [4096, 1536]; compute of 8 + 64 = 72 token rows
    want = 5e-6 + 2 * 72 * 4096 * 1536 / (P * 0.75) + 2 * (4096 * 1536 + 8 * 4096 + 8 * 1536) / (BW * 0.8)
    assert gemm_time(c, hw, 8, 4096, 1536) == pytest.approx(want, rel=1e-12)
    # large batches: the ramp fades (4,096 tokens compute as 4,160)
    hard = replace(c, gemm=GemmConst(0.75, 0.8, 0.0, 8.0, n_half=64.0))
    assert gemm_time(hard, hw, 4096, 4096, 14336) == pytest.approx(
        2 * 4160 * 4096 * 14336 / (P * 0.75), rel=0.01)
    lat = OperatorLatency(Parallel(4, 1), m, hw, c)
    s = RankShape.of(m, 4)
    terms = layer_terms(c, hw, s, 4, 0, 0, 8, 8 * 1024)
    assert terms["qkv"] == pytest.approx(want, rel=1e-12)
    once = step_terms(c, hw, s, 4, 8, 8)
    assert lat.decode(8, 8 * 1024) == pytest.approx(32 * sum(terms.values()) + sum(once.values()), rel=1e-12)


def test_pipeline_stage_terms():
    m, hw = load_model("llama-3-8b"), load_hardware("a100")
    one, pp2 = OperatorLatency(Parallel(1, 1), m, hw, HAND), OperatorLatency(Parallel(1, 2), m, hw, HAND)
    hop = 25e-6 + 2048 * 4096 * 2 / hw.intra_node_bw
    assert pp2.p2p(2048) == pytest.approx(hop)
    # a prompt crosses both stages of 16 layers and one hop: the whole model plus the hop
    assert pp2.prefill(2048, 2048 ** 2) == pytest.approx(one.prefill(2048, 2048 ** 2) + hop, rel=1e-9)


def test_hardware_entries_carry_step_constants_and_tp_is_not_nearly_free():
    a100 = load_hardware("a100")
    assert a100.step is not None and load_hardware("h100").step is not None and load_hardware("h200").step
    assert load_hardware("cpu-local").step is None and load_hardware("l40s").step is None
    m = load_model("llama-3-8b")
    tp1, tp4 = (latency_model(m, a100, Parallel(t, 1)) for t in (1, 4))
    assert isinstance(tp1, OperatorLatency)
    speedup = tp1.prefill(4096, 4096 ** 2) / tp4.prefill(4096, 4096 ** 2)
    old = RooflineLatency(Parallel(1, 1), m, a100).prefill(4096, 4096 ** 2) / \
        RooflineLatency(Parallel(4, 1), m, a100).prefill(4096, 4096 ** 2)
    assert speedup < 3.0 < old  # measured all-reduces and floors: TP 4 is not 3.5x faster
    assert tp4.decode(1, 1000) > tp1.decode(1, 1000) / 2.5
    assert isinstance(latency_model(m, load_hardware("cpu-local"), Parallel(2, 1)), RooflineLatency)


def test_step_entry_round_trips_and_rejects_bad_blocks():
    block = entry_dict(HAND)
    assert entry_dict(StepEntry.model_validate(block).constants()) == block
    assert StepEntry.model_validate(block).constants().link(4).latency_s == pytest.approx(30e-6)
    with pytest.raises(ValueError, match="small_ops needs exactly"):
        StepEntry.model_validate({**block, "small_ops": {k: v for k, v in block["small_ops"].items() if k != "rope"}})
    with pytest.raises(ValueError, match="extra"):
        StepEntry.model_validate({**block, "gemm": {**block["gemm"], "speed": 1}})


def test_the_fast_stage_equals_the_sum_of_its_terms():
    """OperatorLatency precomputes each kernel's coefficients; it must price a step as `layer_terms` and
    `step_terms` do, for every mix of prompt and decode tokens, TP and PP, and every GPU entry."""
    import random

    rng = random.Random(0)
    for hw_name, model, tp, pp in (("a100", "llama-3-8b", 4, 1), ("h100", "llama-3-70b", 8, 1),
                                   ("a100", "opt-13b", 2, 1), ("h200", "qwen2.5-7b", 1, 2), ("a100", "llama-3-8b", 1, 1)):
        m, hw = load_model(model), load_hardware(hw_name)
        lat = OperatorLatency(Parallel(tp, pp), m, hw, hw.step)
        s = RankShape.of(m, tp)
        for _ in range(30):
            prompts = [rng.randint(1, 3000) for _ in range(rng.randint(0, 3))]
            t, sq = sum(prompts), sum(x * x for x in prompts)
            b = rng.choice((0, 1, 7, 64)) if prompts else rng.choice((1, 7, 64))
            ctx = b * rng.randint(1, 4000)
            terms = layer_terms(hw.step, hw, s, tp, t, sq, b, ctx)
            once = step_terms(hw.step, hw, s, tp, t + b, sampled_positions(t, sq) + b)
            want = m.layers / pp * sum(terms.values()) + sum(once.values()) / pp
            assert lat.stage_mixed(t, sq, b, ctx) == pytest.approx(want, rel=1e-9)


def test_stage_times_are_memoised_within_a_bound(monkeypatch):
    """A stage's time is computed once per (prefill tokens, SQ, batch, context) and the memo never holds more
    than STAGE_MEMO_MAX entries (a long-lived model sees ever new contexts); the answers are the uncached ones."""
    from cluster.planner.latency import gpu_latency

    monkeypatch.setattr(gpu_latency, "STAGE_MEMO_MAX", 3)
    lat = OperatorLatency(Parallel(1, 1), load_model("llama-3-8b"), load_hardware("a100"), HAND)
    for ctx in range(0, 10 * 1024, 1024):
        assert lat.stage_mixed(64, 64, 8, ctx) == lat._stage(64, 64, 8, ctx)
        assert len(lat._stages) <= 3
    assert lat.stage_mixed(64, 64, 8, 9 * 1024) == lat._stage(64, 64, 8, 9 * 1024)
