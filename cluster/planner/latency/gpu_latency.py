"""The GPU step model: one forward step as the kernels a GPU runs, from `StepConstants` (`gpu_constants`).

Per layer and TP rank (`layer_terms`; the rank's shape: query/KV heads and FFN split `tp` ways, a rank
keeps at least one whole KV head):
  GEMMs     qkv, o, up (gate+up when gated), down on every new token: shape-dependent (`gemm_time`: the
            smooth max of FLOPs and bytes, plus a kernel floor), so small batches read weights and large
            ones compute; the compute side ramps up in tokens (n_half: padded tensor-core tiles), a count of
            tokens of the order of a tile's rows and not a fraction of the ridge, so a GPU whose ridge lies at
            more tokens (H100) has a sharper knee
  small ops two norms, rope (none with learned positions), the activation and a residual add: the smooth
            max of a floor and their bytes
  attention prefill by FLOPs (2 x SQ x q_dim, causal), less efficient with few query blocks; decode by the
            KV bytes read (linear in total context: the simulator's decode lines); each with its floor
  KV write  floor + per prompt token
  TP        two all-reduces of tokens x hidden (after attention and after the MLP), from the measured
            latency + bandwidth curve of the interconnect for `tp` GPUs
Per step (`step_terms`): the embedding gather of the new tokens, the LM head on the sampled positions only
(one per prompt, one per decoding sequence) with the logits gather under TP, and the engine's fixed CPU
time. With PP each stage runs layers/pp layers; embedding, LM head and CPU time are spread over the
stages (the planner ignores stage imbalance) and a hop between stages is latency + activations / link.

Who calls: `profiles.latency_model` (GPU entries with a `step` block, or a fitted operator profile), the
fit (`calibrate/gpu_fit.py`) and bench/checks/planner_gpu_check.py (term by term against measured tables). Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass

from cluster.planner.inputs.gpu_constants import StepConstants, smooth_max
from cluster.planner.inputs.hardware import Hardware
from cluster.planner.inputs.models import DTYPE_BYTES, ModelSpec
from cluster.planner.latency.base import LatencyModel, Line, Parallel

QUERY_BLOCK = 128  # tokens of one head a FlashAttention-style kernel gives one thread block


STAGE_MEMO_MAX = 1 << 16  # stage times one model keeps (a plan computes ~16k)


@dataclass(frozen=True)
class RankShape:
    """One TP rank's share of a decoder layer."""
    hidden: int
    heads: float  # query heads on this rank
    q_dim: float
    kv_dim: float  # one of K or V: KV heads on this rank x head_dim
    ffn: float
    gated: bool
    rope: bool
    vocab: float  # LM head columns on this rank

    @classmethod
    def of(cls, model: ModelSpec, tp: int) -> "RankShape":
        kv_heads = max(1.0, model.kv_heads / tp)  # TP beyond the KV heads replicates one per rank
        return cls(model.hidden, model.heads / tp, model.heads * model.head_dim / tp, kv_heads * model.head_dim,
                   model.ffn / tp, model.gated_mlp, not model.learned_positions, model.vocab / tp)


def gemm_time(c: StepConstants, hw: Hardware, n: float, k: float, m: float, nbytes: int = 2) -> float:
    """[n, k] x [k, m]: floor + (tc^p + tm^p)^(1/p); tc = FLOPs x (1 + n_half / n); bytes = weights +
    input + output."""
    if n <= 0:
        return 0.0
    g = c.gemm
    tc = 2 * (n + g.n_half) * k * m / (hw.peak_flops * g.eff)
    tm = nbytes * (k * m + n * k + n * m) / (hw.hbm_bw * g.mem_eff)
    return g.floor_s + smooth_max(tc, tm, g.sharpness)


def small_bytes(kind: str, s: RankShape, n: float, nbytes: int = 2) -> float:
    """Bytes one small op moves for `n` tokens (read and written once)."""
    if kind in ("norm", "emb"):
        return 2 * n * s.hidden * nbytes
    if kind == "rope":  # queries and keys
        return 2 * n * (s.q_dim + s.kv_dim) * nbytes if s.rope else 0.0
    if kind == "act":  # gated: reads gate and up, writes one
        return n * (3 if s.gated else 2) * s.ffn * nbytes
    assert kind == "add", kind
    return 3 * n * s.hidden * nbytes


def small_time(c: StepConstants, hw: Hardware, kind: str, nbytes: float) -> float:
    if nbytes <= 0:
        return 0.0
    o = c.op(kind)
    return smooth_max(o.floor_s, nbytes / (hw.hbm_bw * o.mem_eff), o.sharpness)


def prefill_attention_time(c: StepConstants, hw: Hardware, s: RankShape, tokens: float, sq: float) -> float:
    if tokens <= 0:
        return 0.0
    a = c.attention
    blocks = max(1.0, s.heads * tokens / QUERY_BLOCK)
    return a.prefill_floor_s + 2 * sq * s.q_dim / (hw.peak_flops * a.prefill_eff) * (1 + a.prefill_occupancy / blocks)


def decode_attention_slope(c: StepConstants, hw: Hardware, s: RankShape, nbytes: int = 2) -> float:
    """Seconds per context token of one layer's decode attention (K and V read once)."""
    return 2 * s.kv_dim * nbytes / (hw.hbm_bw * c.attention.decode_mem_eff)


def layer_terms(c: StepConstants, hw: Hardware, s: RankShape, tp: int, prefill_tokens: float, sq: float,
                batch: float, context: float, nbytes: int = 2) -> dict[str, float]:
    """Seconds of each kernel of one layer on one rank: `prefill_tokens` new prompt tokens (sum of squared
    lengths `sq`) and `batch` decoding sequences with `context` tokens in all."""
    n = prefill_tokens + batch  # every new token goes through the GEMMs and small ops
    h, a = s.hidden, c.attention
    terms = {
        "qkv": gemm_time(c, hw, n, h, s.q_dim + 2 * s.kv_dim, nbytes),
        "o": gemm_time(c, hw, n, s.q_dim, h, nbytes),
        "up": gemm_time(c, hw, n, h, (2 if s.gated else 1) * s.ffn, nbytes),
        "down": gemm_time(c, hw, n, s.ffn, h, nbytes),
        "norm": 2 * small_time(c, hw, "norm", small_bytes("norm", s, n, nbytes)),  # two per layer
        "rope": small_time(c, hw, "rope", small_bytes("rope", s, n, nbytes)),
        "act": small_time(c, hw, "act", small_bytes("act", s, n, nbytes)),
        "add": small_time(c, hw, "add", small_bytes("add", s, n, nbytes)),
        "prefill_attention": prefill_attention_time(c, hw, s, prefill_tokens, sq),
        "decode_attention": (a.decode_floor_s + context * decode_attention_slope(c, hw, s, nbytes)) if batch > 0 else 0.0,
        "kv_write": (a.kv_write_floor_s + prefill_tokens * a.kv_write_token_s) if n > 0 else 0.0,
        "allreduce": 2 * c.link(tp).allreduce(n * h * nbytes, tp) if tp > 1 and n > 0 else 0.0,
    }
    return terms


def sampled_positions(prefill_tokens: float, sq: float) -> float:
    """Prompts in a prefill batch from (T, SQ): T^2/SQ (exact for equal lengths, fewer otherwise)."""
    return prefill_tokens * prefill_tokens / sq if sq > 0 else 0.0


def step_terms(c: StepConstants, hw: Hardware, s: RankShape, tp: int, tokens: float, sampled: float,
               nbytes: int = 2) -> dict[str, float]:
    """Once per step (all stages together): embedding, LM head on `sampled` positions, CPU time."""
    lm = gemm_time(c, hw, sampled, s.hidden, s.vocab, nbytes)
    if tp > 1 and sampled > 0:  # the logits of every rank gathered for the sampler
        link = c.link(tp)
        lm += link.latency_s + sampled * s.vocab * (tp - 1) * nbytes / link.bus_bw
    return {"emb": small_time(c, hw, "emb", small_bytes("emb", s, tokens, nbytes)), "lm_head": lm, "cpu": c.step_cpu_s}


class OperatorLatency(LatencyModel):
    """`layer_terms` x layers + `step_terms`, with each kernel's coefficients in the token counts computed
    once (the simulator calls a stage hundreds of thousands of times per plan)."""

    def __init__(self, parallel: Parallel, model: ModelSpec, hw: Hardware, constants: StepConstants,
                 dtype: str = "bfloat16", pp_link_bw: float | None = None):
        super().__init__(parallel)
        self.model, self.hw, self.c = model, hw, constants
        self.nbytes = DTYPE_BYTES[dtype]
        self.shape = s = RankShape.of(model, parallel.tp)
        self.stage_layers = model.layers / parallel.pp
        self.pp_link_bw = pp_link_bw or hw.intra_node_bw
        c, nb, tp = constants, self.nbytes, parallel.tp
        h = s.hidden
        shapes = ((h, s.q_dim + 2 * s.kv_dim), (s.q_dim, h), (h, (2 if s.gated else 1) * s.ffn), (s.ffn, h))
        self._gemms = tuple(self._gemm(k, m) for k, m in shapes)  # (floor, s/token, bytes, bytes/token, p, n_half)
        # small ops: (count per layer, floor, seconds per token at their bandwidth, p)
        self._small = tuple((2 if kind == "norm" else 1, c.op(kind).floor_s,
                             small_bytes(kind, s, 1.0, nb) / (hw.hbm_bw * c.op(kind).mem_eff), c.op(kind).sharpness)
                            for kind in ("norm", "rope", "act", "add") if small_bytes(kind, s, 1.0, nb) > 0)
        a = c.attention
        self._prefill = (a.prefill_floor_s, 2 * s.q_dim / (hw.peak_flops * a.prefill_eff), a.prefill_occupancy)
        self._decode = (a.decode_floor_s, decode_attention_slope(c, hw, s, nb))
        self._kv = (a.kv_write_floor_s, a.kv_write_token_s)
        link = c.link(tp)
        self._ring = (link.latency_s, h * nb * 2 * (tp - 1) / tp / link.bus_bw, link.sharpness) if tp > 1 else None
        emb = c.op("emb")
        self._emb = (emb.floor_s, small_bytes("emb", s, 1.0, nb) / (hw.hbm_bw * emb.mem_eff), emb.sharpness)
        self._lm = self._gemm(h, s.vocab)
        self._gather = (link.latency_s, s.vocab * (tp - 1) * nb / link.bus_bw) if tp > 1 else None
        # `_stage` seconds keyed on its (prefill tokens, SQ, batch, context): a pure function of them and of
        # the coefficients above, which nothing changes after construction; a simulation asks the same
        # steps again and again (equal prompt lengths, the same batch sizes), so each is computed once
        self._stages: dict[tuple[float, float, float, float], float] = {}

    def _gemm(self, k: float, m: float) -> tuple[float, ...]:
        g, nb = self.c.gemm, self.nbytes
        mem = self.hw.hbm_bw * g.mem_eff
        return (g.floor_s, 2 * k * m / (self.hw.peak_flops * g.eff), nb * k * m / mem, nb * (k + m) / mem,
                g.sharpness, g.n_half)

    @staticmethod
    def _gemm_at(g: tuple, n: float) -> float:
        floor, flops, weights, per_token, p, n_half = g
        return floor + ((flops * (n + n_half)) ** p + (weights + per_token * n) ** p) ** (1 / p)

    def _layer(self, prefill_tokens: float, sq: float, batch: float, context: float) -> float:
        """`sum(layer_terms(...).values())`, from the precomputed coefficients."""
        n = prefill_tokens + batch
        if n <= 0:
            return 0.0
        t = sum(self._gemm_at(g, n) for g in self._gemms)
        t += sum(count * (floor ** p + (per_token * n) ** p) ** (1 / p) for count, floor, per_token, p in self._small)
        if prefill_tokens > 0:
            floor, per_sq, occupancy = self._prefill
            blocks = max(1.0, self.shape.heads * prefill_tokens / QUERY_BLOCK)
            t += floor + per_sq * sq * (1 + occupancy / blocks)
        if batch > 0:
            t += self._decode[0] + self._decode[1] * context
        t += self._kv[0] + self._kv[1] * prefill_tokens
        if self._ring is not None:
            latency, per_token, p = self._ring
            t += 2 * (latency ** p + (per_token * n) ** p) ** (1 / p)
        return t

    def _once(self, tokens: float, sampled: float) -> float:
        """`sum(step_terms(...).values())`."""
        t = self.c.step_cpu_s
        if tokens > 0:
            floor, per_token, p = self._emb
            t += (floor ** p + (per_token * tokens) ** p) ** (1 / p)
        if sampled > 0:
            t += self._gemm_at(self._lm, sampled)
            if self._gather is not None:
                t += self._gather[0] + self._gather[1] * sampled
        return t

    def _stage(self, prefill_tokens: float, sq: float, batch: float, context: float) -> float:
        sampled = sampled_positions(prefill_tokens, sq) + batch
        return (self.stage_layers * self._layer(prefill_tokens, sq, batch, context)
                + self._once(prefill_tokens + batch, sampled) / self.parallel.pp)

    def _stage_memo(self, prefill_tokens: float, sq: float, batch: float, context: float) -> float:
        key = (prefill_tokens, sq, batch, context)
        t = self._stages.get(key)
        if t is None:
            if len(self._stages) >= STAGE_MEMO_MAX:  # bounded: a long-lived model (a simulator run for hours)
                self._stages.clear()                 # sees ever new contexts
            t = self._stages[key] = self._stage(prefill_tokens, sq, batch, context)
        return t

    def stage_prefill(self, tokens: float, sq: float) -> float:
        return self._stage_memo(tokens, sq, 0.0, 0.0)

    def stage_decode_lines(self, batch: float) -> tuple[Line, Line]:
        slope = self.stage_layers * self._decode[1]
        line = (self._stage(0.0, 0.0, batch, 0.0), slope if batch > 0 else 0.0)
        return line, line

    def stage_mixed(self, tokens: float, sq: float, batch: float, context: float) -> float:
        return self._stage_memo(tokens, sq, batch, context)

    def p2p(self, tokens: float) -> float:
        return self.c.p2p_latency_s + tokens * self.model.hidden * self.nbytes / self.pp_link_bw
