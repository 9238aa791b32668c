"""Analytic roofline latency for GPUs, per operator class: matmuls (weights streamed once per step, FLOPs
for every token) plus attention (prefill: compute; decode: reading the KV cache), plus a fixed
per-forward overhead and the tensor-parallel all-reduces. Matmuls and attention are separate kernels, so
their times add: a colocated step does not hide decode attention's KV reads under prefill's compute.

Per stage of `layers/pp` layers, per TP rank (matmul weights and heads split `tp` ways; KV heads split
too, but a rank keeps at least one whole KV head, so TP beyond the KV heads replicates them):
  matmuls(N tokens)   = max(2 * P_stage * N / FLOP/s, weight bytes / bandwidth)
  prefill attention   = max(2 * L_s * q_dim * SQ / FLOP/s, KV bytes written (T tokens) / bandwidth)
  decode attention    = max(4 * L_s * q_dim * C / FLOP/s, KV bytes read (C tokens) / bandwidth)
  all-reduce          = 2 per layer (after attention and MLP) of N x hidden x 2 bytes, ring: 2(tp-1)/tp
                        of the message over the intra-node link, plus a fixed latency each
FLOP/s and bandwidth are the datasheet peaks times `Calibration` efficiencies; `calibrate()` derives
them from a fitted TP=1 profile so the roofline extends a measured profile to TP/PP degrees and devices
that were not measured.
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster.planner.inputs.hardware import Hardware
from cluster.planner.inputs.models import DTYPE_BYTES, ModelSpec
from cluster.planner.latency.base import Coeffs, LatencyModel, Parallel


@dataclass(frozen=True)
class Calibration:
    compute_eff: float = 0.6  # achieved / peak FLOP/s in big matmuls (typical prefill MFU of vLLM-class engines)
    memory_eff: float = 0.8  # achieved / peak HBM bandwidth when streaming weights and KV
    overhead_s: float = 0.002  # per forward pass per stage: launches, scheduling, sampling
    allreduce_latency_s: float = 10e-6  # fixed cost of one NCCL all-reduce inside a node


class RooflineLatency(LatencyModel):
    def __init__(self, parallel: Parallel, model: ModelSpec, hw: Hardware, dtype: str = "bfloat16",
                 cal: Calibration = Calibration(), pp_link_bw: float | None = None):
        super().__init__(parallel)
        self.model, self.hw, self.cal = model, hw, cal
        self.nbytes = DTYPE_BYTES[dtype]
        tp, pp = parallel.tp, parallel.pp
        m = model
        self.stage_layers = m.layers / pp
        lm_head = m.vocab * m.hidden / pp  # spread over stages: the planner ignores stage imbalance
        self.matmul_params = (m.layers * m.layer_params / pp + lm_head) / tp
        self.weight_bytes = m.weight_bytes(dtype) / (tp * pp)
        kv_heads_per_rank = max(1.0, m.kv_heads / tp)
        self.kv_bytes_token = 2 * self.stage_layers * kv_heads_per_rank * m.head_dim * self.nbytes
        self.q_dim = m.heads * m.head_dim / tp
        self.flops = hw.peak_flops * cal.compute_eff
        self.bw = hw.hbm_bw * cal.memory_eff
        self.pp_link_bw = pp_link_bw or hw.intra_node_bw

    def _allreduce(self, tokens: float) -> float:
        tp = self.parallel.tp
        if tp == 1:
            return 0.0
        msg = tokens * self.model.hidden * self.nbytes
        per = 2 * (tp - 1) / tp * msg / self.hw.intra_node_bw + self.cal.allreduce_latency_s
        return 2 * self.stage_layers * per

    def _fixed(self, tokens: float) -> float:
        return self.cal.overhead_s + self._allreduce(tokens)

    def _matmuls(self, tokens: float) -> float:
        return max(2 * self.matmul_params * tokens / self.flops, self.weight_bytes / self.bw)

    def _prefill_attention(self, tokens: float, sq: float) -> float:
        return max(2 * self.stage_layers * self.q_dim * sq / self.flops, tokens * self.kv_bytes_token / self.bw)

    def _decode_attention_slope(self) -> float:
        """Seconds per context token of decode attention (the slower of its FLOPs and its KV reads)."""
        return max(4 * self.stage_layers * self.q_dim / self.flops, self.kv_bytes_token / self.bw)

    def stage_prefill(self, tokens: float, sq: float) -> float:
        return self._matmuls(tokens) + self._prefill_attention(tokens, sq) + self._fixed(tokens)

    def stage_decode_lines(self, batch: float):
        line = (self._matmuls(batch) + self._fixed(batch), self._decode_attention_slope())
        return line, line

    def stage_mixed(self, tokens: float, sq: float, batch: float, context: float) -> float:
        return (self._matmuls(tokens + batch) + self._prefill_attention(tokens, sq)
                + context * self._decode_attention_slope() + self._fixed(tokens + batch))

    def p2p(self, tokens: float) -> float:
        return tokens * self.model.hidden * self.nbytes / self.pp_link_bw + self.cal.allreduce_latency_s

    def is_compute_bound_prefill(self, tokens: float, sq: float) -> bool:
        return 2 * self.matmul_params * tokens / self.flops > self.weight_bytes / self.bw

    def is_memory_bound_decode(self, batch: float, context: float) -> bool:
        matmul_mem = self.weight_bytes / self.bw > 2 * self.matmul_params * batch / self.flops
        return matmul_mem and self.kv_bytes_token / self.bw > 4 * self.stage_layers * self.q_dim / self.flops


def calibrate(model: ModelSpec, hw: Hardware, coeffs: Coeffs, dtype: str = "bfloat16") -> Calibration:
    """Efficiency factors that make the TP=1 roofline match fitted coefficients measured on `hw`:
    prefill's per-token slope is compute (matmul FLOPs per token), decode's per-context-token slope is
    KV bytes read, decode's intercept is the weight read plus the fixed overhead."""
    r = RooflineLatency(Parallel(1, 1), model, hw, dtype, Calibration(1.0, 1.0, 0.0, 0.0))
    _, b_pre, _ = coeffs.prefill
    a_dec, b_dec, _ = coeffs.decode
    compute_eff = min(1.0, (2 * r.matmul_params / hw.peak_flops) / b_pre) if b_pre > 0 else 0.6
    memory_eff = min(1.0, (r.kv_bytes_token / hw.hbm_bw) / b_dec) if b_dec > 0 else 0.8
    weights_s = r.weight_bytes / (hw.hbm_bw * memory_eff)
    overhead = max(0.0, a_dec - weights_s)
    return Calibration(max(compute_eff, 1e-3), max(memory_eff, 1e-3), overhead)
