"""Mixture-of-experts steps: the GPU step model and the roofline of a model with experts, expert parallelism.

Per rank of an instance of `ep` groups of `tp` GPUs (`Parallel.ep`; ep = 1: experts split only tp ways):
  experts touched  a step of n new tokens makes n x k uniform draws of k distinct experts out of E
                   (k = experts_per_token); the expected distinct experts are E (1 - (1 - k/E)^n) per MoE
                   layer (`expected_experts`: exact for uniform routing), 1/ep of them on each EP rank
  weight bytes     `step_weight_bytes`: attention, dense layers, router and shared expert on every rank
                   (tp-split; the router whole), plus the touched experts (each tp-split) and the LM head.
                   At n = 1 that is the active parameters; at large n every expert of the rank's share
  FLOPs            from the active parameters: each of the rank's n x k / ep assignments runs one expert
  grouped GEMM     one kernel per projection over all of a rank's touched experts (the engine's grouped
                   path; a fused-MoE kernel on GPUs): each touched expert's weights read once, and each pads
                   its rows to a tile (the GEMM constants' n_half per touched expert on the compute side)
  routing kernels  ROUTE_KERNELS small launches per MoE layer around the grouped GEMMs (top-k softmax, the
                   tokens' sort by expert into tile-aligned blocks, the weighted sum over the k outputs), each at
                   the GEMM kernel floor: what measured fused-MoE kernels spend at one token beyond their weight
                   reads (data/gpu_profiles/moe/, bench/checks/moe_measured_check.py: 15.7 us on an H100)
  all-to-all       ep > 1: each rank sends its n/ep tokens' k copies of the hidden state to their experts'
                   ranks and takes the results back: per MoE layer 2 x (latency + n/ep x k x hidden x
                   bytes x (ep-1)/ep / link), the link being the hardware entry's NVLink inside a node
                   (`intra_node_bw`), its inter-node link beyond; the latency is the step constants'
                   collective latency for tp x ep GPUs (the roofline: its all-reduce latency)
  attention        data-parallel over the EP groups: each group holds the KV of its own n/ep sequences and
                   runs their attention (DeepSeek's and SGLang's decode layout), so KV capacity and decode
                   attention scale with ep; inside a group, TP as for dense models
Memory (`search/configs.py`): every expert is held, split tp x ep ways; the rest tp ways on every group.

Not modelled: skewed routing (fewer experts touched, but a hotter rank: a slower all-to-all and expert GEMM),
fp8 dispatch, the all-to-all overlapped with compute (DeepEP, two-batch overlap), replicated hot experts
(EPLB), capacity factors and dropped tokens, MoE-specific GEMM efficiencies (the dense GEMM fit stands in: it
is 0.86-1.11 of measured bf16 fused-MoE kernels, 1.0-1.11 from 8 tokens up; `expert_mlp` is what they time).

Who calls: `profiles.latency_model` (models with experts), tests. Pure Python.
"""
from __future__ import annotations

import math

from cluster.planner.inputs.gpu_constants import StepConstants
from cluster.planner.inputs.hardware import Hardware
from cluster.planner.inputs.models import DTYPE_BYTES, ModelSpec
from cluster.planner.latency.base import Line, Parallel
from cluster.planner.latency.gpu_latency import QUERY_BLOCK, OperatorLatency, sampled_positions, small_bytes
from cluster.planner.latency.roofline import Calibration, RooflineLatency

ROUTE_KERNELS = 4  # top-k softmax, block alignment (count, sort), top-k weighted sum: launches per MoE layer


def expected_experts(experts: int, top_k: int, tokens: float) -> float:
    """Distinct experts among `tokens` tokens each routed to `top_k` distinct experts uniformly at random:
    an expert is missed by one token with probability 1 - k/E, by all of them (1 - k/E)^n."""
    if tokens <= 0 or experts <= 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def step_weight_bytes(model: ModelSpec, tokens: float, tp: int = 1, ep: int = 1, dtype: str = "bfloat16") -> float:
    """Weight bytes one rank reads in a step of `tokens` new tokens (the whole instance's), all layers and
    the LM head (the embedding gather of a few rows is left out). Dense models: every weight, tp-split."""
    m = model
    per_rank = (m.layers * m.attention_params + (m.layers - m.moe_layers) * m.dense_mlp_params) / tp
    if m.is_moe:
        touched = expected_experts(m.experts, m.experts_per_token, tokens) / ep
        per_rank += m.moe_layers * (m.hidden * m.experts + (3 * m.hidden * m.shared_expert_ffn
                                                            + touched * m.expert_params) / tp)
    return DTYPE_BYTES[dtype] * (per_rank + m.vocab * m.hidden / tp)


def group_share(tokens: float, ep: int) -> float:
    """The share of a step's sequences the busiest of `ep` attention groups runs: ceil(n/ep)/n (whole
    sequences; 1/ep once the batch divides evenly). EP instances are decode instances: a prompt is one
    sequence and is not split between groups, so their prefill steps are not priced for use."""
    if ep <= 1 or tokens <= 0:
        return 1.0
    return math.ceil(tokens / ep - 1e-9) / tokens


def _smooth(floor: float, per: float, p: float, n: float) -> float:
    return (floor ** p + (per * n) ** p) ** (1 / p)


class MoEOperatorLatency(OperatorLatency):
    """`OperatorLatency` with MoE layers and EP groups: attention and dense parts as the parent prices them
    at each group's n/ep tokens; the MoE MLP as router + grouped expert GEMMs + all-to-all (module map)."""

    def __init__(self, parallel: Parallel, model: ModelSpec, hw: Hardware, constants: StepConstants,
                 dtype: str = "bfloat16", pp_link_bw: float | None = None, a2a_bw: float | None = None):
        super().__init__(parallel, model, hw, constants, dtype, pp_link_bw)
        c, nb, s, m = constants, self.nbytes, self.shape, model
        tp, ep, h = parallel.tp, parallel.ep, s.hidden
        self.ep, self.moe_frac = ep, m.moe_layers / m.layers
        self._attn_gemms, self._dense_gemms = self._gemms[:2], self._gemms[2:]  # (qkv, o), (up, down)

        def op(kind: str, per_token_bytes: float) -> tuple[float, float, float]:
            o = c.op(kind)
            return o.floor_s, per_token_bytes / (hw.hbm_bw * o.mem_eff), o.sharpness

        self._small_attn = tuple((2 if k == "norm" else 1, *op(k, small_bytes(k, s, 1.0, nb)))
                                 for k in ("norm", "rope", "add") if small_bytes(k, s, 1.0, nb) > 0)
        self._act_dense = op("act", small_bytes("act", s, 1.0, nb))
        eff, shared = m.expert_ffn / tp, m.shared_expert_ffn / tp
        self._router = self._gemm(h, m.experts)  # whole on every rank: each routes its own tokens
        self._experts = (self._gemm(h, 2 * eff), self._gemm(eff, h))  # gate+up, down of one expert
        self._act_expert = op("act", 3 * eff * nb)  # per assignment: gate and up read, one written
        self._shared = (self._gemm(h, 2 * shared), self._gemm(shared, h)) if shared else ()
        self._act_shared = op("act", 3 * shared * nb)
        self._a2a = None
        if ep > 1:  # per token of this group: k copies of its hidden state, (ep-1)/ep of them off the rank
            self._a2a = (c.link(tp * ep).latency_s,
                         m.experts_per_token * h * nb * (ep - 1) / ep / (a2a_bw or hw.intra_node_bw))

    @staticmethod
    def _grouped_at(g: tuple, assignments: float, touched: float) -> float:
        """One grouped GEMM over `touched` experts holding `assignments` token rows in all."""
        floor, flops, weights, per_token, p, n_half = g
        return floor + ((flops * (assignments + n_half * touched)) ** p
                        + (weights * touched + per_token * assignments) ** p) ** (1 / p)

    def expert_mlp(self, tokens: float) -> float:
        """Seconds of one MoE layer's routed experts on one rank for a step of `tokens` new tokens (the
        instance's): the routing kernels, both grouped GEMMs and the activation between them -- what a fused-MoE
        kernel benchmark times (router logits given; no shared expert, no all-to-all)."""
        m, local = self.model, tokens / self.ep
        if local <= 0:
            return 0.0
        assignments = local * m.experts_per_token  # uniform routing: every rank gets its share
        touched = expected_experts(m.experts, m.experts_per_token, tokens) / self.ep
        t = ROUTE_KERNELS * self.c.gemm.floor_s
        t += sum(self._grouped_at(g, assignments, touched) for g in self._experts)
        return t + _smooth(*self._act_expert, assignments)

    def moe_mlp(self, tokens: float) -> float:
        """Seconds of one MoE layer's MLP on one rank for a step of `tokens` new tokens (the instance's)."""
        local = tokens / self.ep
        if local <= 0:
            return 0.0
        t = self._gemm_at(self._router, local) + self.expert_mlp(tokens)
        if self._shared:
            t += sum(self._gemm_at(g, local) for g in self._shared) + _smooth(*self._act_shared, local)
        if self._a2a is not None:
            latency, per_token = self._a2a
            t += 2 * (latency + per_token * local)  # dispatch and combine
        return t

    def _layer(self, prefill_tokens: float, sq: float, batch: float, context: float) -> float:
        n = prefill_tokens + batch
        if n <= 0:
            return 0.0
        g = group_share(n, self.ep)  # the busiest group's share of the step's sequences
        local, pre = n * g, prefill_tokens * g
        t = sum(self._gemm_at(gm, local) for gm in self._attn_gemms)
        t += sum(count * _smooth(floor, per, p, local) for count, floor, per, p in self._small_attn)
        if prefill_tokens > 0:
            floor, per_sq, occupancy = self._prefill
            blocks = max(1.0, self.shape.heads * pre / QUERY_BLOCK)
            t += floor + per_sq * sq * g * (1 + occupancy / blocks)
        if batch > 0:
            t += self._decode[0] + self._decode[1] * context * g
        t += self._kv[0] + self._kv[1] * pre
        if self._ring is not None:
            latency, per_token, p = self._ring
            t += 2 * _smooth(latency, per_token, p, local)
        if self.moe_frac < 1:
            t += (1 - self.moe_frac) * (sum(self._gemm_at(gm, local) for gm in self._dense_gemms)
                                        + _smooth(*self._act_dense, local))
        return t + self.moe_frac * self.moe_mlp(n)

    def _stage(self, prefill_tokens: float, sq: float, batch: float, context: float) -> float:
        sampled = sampled_positions(prefill_tokens, sq) + batch  # each group samples its own rows
        g = group_share(prefill_tokens + batch, self.ep)
        return (self.stage_layers * self._layer(prefill_tokens, sq, batch, context)
                + self._once((prefill_tokens + batch) * g, sampled * g) / self.parallel.pp)

    def stage_decode_lines(self, batch: float) -> tuple[Line, Line]:
        slope = self.stage_layers * self._decode[1] * group_share(batch, self.ep)
        line = (self._stage(0.0, 0.0, batch, 0.0), slope if batch > 0 else 0.0)
        return line, line


class MoERooflineLatency(RooflineLatency):
    """The roofline (entries without GPU step constants) with MoE weight reads and EP groups: matmuls are
    the larger of the active FLOPs and `step_weight_bytes`; attention and all-reduces at each group's
    share; the all-to-all as in the module map."""

    def __init__(self, parallel: Parallel, model: ModelSpec, hw: Hardware, dtype: str = "bfloat16",
                 cal: Calibration = Calibration(), pp_link_bw: float | None = None, a2a_bw: float | None = None):
        super().__init__(parallel, model, hw, dtype, cal, pp_link_bw)
        self.ep, self.dtype = parallel.ep, dtype
        ep = parallel.ep
        self._a2a_per_token = (model.experts_per_token * model.hidden * self.nbytes * (ep - 1) / ep
                               / (a2a_bw or hw.intra_node_bw))

    def _matmuls(self, tokens: float) -> float:
        p = self.parallel
        weights = step_weight_bytes(self.model, tokens, p.tp, p.ep, self.dtype) / p.pp
        return max(2 * self.matmul_params * tokens / p.ep / self.flops, weights / self.bw)

    def _fixed(self, tokens: float) -> float:
        t = self.cal.overhead_s + self._allreduce(tokens / self.ep)
        if self.ep > 1:
            moe_layers = self.model.moe_layers / self.parallel.pp
            t += 2 * moe_layers * (self.cal.allreduce_latency_s + self._a2a_per_token * tokens / self.ep)
        return t

    def _prefill_attention(self, tokens: float, sq: float) -> float:
        return super()._prefill_attention(tokens / self.ep, sq / self.ep)

    def _decode_attention_slope(self) -> float:
        return super()._decode_attention_slope() / self.ep
