"""Latency models: seconds for a prefill batch, a decode step, or a mixed (colocated) step.

Features, not requests: a prefill batch is (T = sum of prompt tokens, SQ = sum of squared lengths, the
attention term); a decode step is (B = sequences, C = sum of their context lengths). A chunk of a
prompt that already has `p` tokens cached adds c*(2p + c) to SQ, so a prompt chunked any way sums to l^2.

    LatencyModel(parallel)            one engine instance of TP x PP devices
      stage_prefill(T, SQ)            one pipeline stage (subclasses: `FittedLatency` here, `roofline`)
      stage_decode(B, C), stage_mixed(...), p2p(tokens)
      prefill / prefill_interval      full latency / time until the instance takes the next batch
      decode / mixed                  one step of every running sequence (PP: pp micro-batches)

Pipeline parallelism: every stage holds layers/pp; a prefill batch takes pp stage times plus pp-1
activation hops, and the first stage is free again after one stage time (the simulator pipelines
batches with `prefill_interval`). Decode keeps pp micro-batches of ~B/pp sequences in flight, so one
step of all B sequences costs pp stage times at B/pp each: with B < pp the pipeline runs with bubbles.
Who calls: `simulator` (through these methods only), `search`, `report`. Pure Python.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Parallel:
    """TP x PP, and for mixture-of-experts decode instances EP: `ep` groups of `tp` GPUs, each running the
    attention of its own share of the batch, the experts split `ep` ways between them (latency/moe.py)."""
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.ep

    @property
    def stage_gpus(self) -> int:
        """GPUs of one pipeline stage (what must share a node)."""
        return self.tp * self.ep

    def __str__(self) -> str:
        return f"tp{self.tp}pp{self.pp}" + (f"ep{self.ep}" if self.ep > 1 else "")


Line = tuple[float, float]  # seconds = intercept + slope * context (for a fixed batch size)


@dataclass(frozen=True)
class Coeffs:
    """DistServe's fitted forms for one TP degree, whole model on one stage:
    prefill t = a + b*T + c*SQ; decode t = a + b*C + c*B (seconds)."""
    prefill: tuple[float, float, float]
    decode: tuple[float, float, float]


class LatencyModel:
    """Pipeline composition shared by the fitted and the roofline models. `admission_s`: seconds from a
    request's arrival until its instance can schedule it (a serving runtime's HTTP, routing and RPCs;
    0 for the bare engine); the simulators delay arrivals by it, so it counts in TTFT. `drift`: a
    `drift.Drift` (the machine's slow spells) the simulators apply to every step, or None."""

    admission_s: float = 0.0
    drift = None

    def __init__(self, parallel: Parallel):
        self.parallel = parallel

    # ---- per stage (subclasses) ----------------------------------------------------------------
    def stage_prefill(self, tokens: float, sq: float) -> float:
        raise NotImplementedError

    def stage_decode_lines(self, batch: float) -> tuple[Line, Line]:
        """One stage's decode step for `batch` sequences as max of two lines in their total context
        (roofline: compute and memory; fitted: one line twice): the simulator sums runs of steps in
        closed form from these."""
        raise NotImplementedError

    def stage_mixed(self, tokens: float, sq: float, batch: float, context: float) -> float:
        raise NotImplementedError

    def p2p(self, tokens: float) -> float:
        """Send `tokens` activations from one pipeline stage to the next."""
        return 0.0

    # ---- whole instance --------------------------------------------------------------------------
    def prefill(self, tokens: float, sq: float) -> float:
        pp = self.parallel.pp
        return pp * self.stage_prefill(tokens, sq) + (pp - 1) * self.p2p(tokens)

    def prefill_interval(self, tokens: float, sq: float) -> float:
        return self.stage_prefill(tokens, sq) + (self.p2p(tokens) if self.parallel.pp > 1 else 0.0)

    def decode_lines(self, batch: int) -> tuple[Line, Line]:
        """`decode(batch, C) = max(a1 + b1*C, a2 + b2*C)`; cached per batch size."""
        cache = self.__dict__.setdefault("_lines", {})
        if batch not in cache:
            pp = self.parallel.pp
            micro = math.ceil(batch / pp)  # sequences per micro-batch; fewer than pp leave bubbles
            share = micro / batch
            extra = (pp - 1) * self.p2p(micro) if pp > 1 else 0.0
            cache[batch] = tuple((pp * a + extra, pp * b * share) for a, b in self.stage_decode_lines(micro))
        return cache[batch]

    def decode(self, batch: int, context: float) -> float:
        (a1, b1), (a2, b2) = self.decode_lines(batch)
        return max(a1 + b1 * context, a2 + b2 * context)

    def mixed(self, tokens: float, sq: float, batch: int, context: float) -> float:
        """A colocated step: prompt chunks (tokens, sq) plus `batch` decoding sequences (context)."""
        if tokens <= 0:
            return self.decode(batch, context)
        pp = self.parallel.pp
        if pp == 1:
            return self.stage_mixed(tokens, sq, batch, context)
        # the prompt chunk crosses every stage whole, as in `prefill` (splitting it into micro-batches
        # would cut a prompt's latency by pp, which a prefill instance is not granted); decode sequences
        # ride in pp micro-batches as in `decode`. Steps do not overlap across stages (conservative).
        return pp * self.stage_mixed(tokens, sq, batch / pp, context / pp) + (pp - 1) * self.p2p(tokens + batch / pp)


class FittedLatency(LatencyModel):
    """A profile's fitted coefficients for this TP degree. PP divides the per-token terms by pp (each
    stage runs layers/pp) and keeps the intercept per stage (launch and scheduling overhead)."""

    def __init__(self, parallel: Parallel, coeffs: Coeffs, p2p_s_per_token: float = 0.0, admission_s: float = 0.0,
                 drift=None):
        super().__init__(parallel)
        self.coeffs = coeffs
        self.p2p_s_per_token = p2p_s_per_token
        self.admission_s, self.drift = admission_s, drift

    def stage_prefill(self, tokens: float, sq: float) -> float:
        a, b, c = self.coeffs.prefill
        return a + (b * tokens + c * sq) / self.parallel.pp

    def stage_decode(self, batch: float, context: float) -> float:
        a, b, c = self.coeffs.decode
        return a + (b * context + c * batch) / self.parallel.pp

    def stage_decode_lines(self, batch: float) -> tuple[Line, Line]:
        a, b, c = self.coeffs.decode
        line = (a + c * batch / self.parallel.pp, b / self.parallel.pp)
        return line, line

    def stage_mixed(self, tokens: float, sq: float, batch: float, context: float) -> float:
        # a mixed step reads the weights once: both intercepts stand for that fixed cost, count one
        if tokens <= 0:
            return self.stage_decode(batch, context)
        if batch <= 0:
            return self.stage_prefill(tokens, sq)
        overlap = min(self.coeffs.prefill[0], self.coeffs.decode[0])
        return self.stage_prefill(tokens, sq) + self.stage_decode(batch, context) - overlap

    def p2p(self, tokens: float) -> float:
        return self.p2p_s_per_token * tokens


class ZeroLatency(LatencyModel):
    """Stands in for the phase not under test: free and instantaneous."""

    def __init__(self):
        super().__init__(Parallel())

    def stage_prefill(self, tokens, sq):
        return 0.0

    def stage_decode_lines(self, batch):
        return (0.0, 0.0), (0.0, 0.0)

    def stage_mixed(self, tokens, sq, batch, context):
        return 0.0
