"""The GPU step model's constants (`StepConstants`, frozen) and their YAML/JSON edge (`StepEntry`, pydantic).

One set per accelerator: the `step:` block of a `deploy/hardware.yaml` entry, or what `pdserve fit-gpu`
fits from measured operator tables (`gpu_fit`). `gpu_latency.OperatorLatency` reads them. Efficiencies are
fractions of the entry's datasheet peaks (FLOP/s, HBM bytes/s), floors are seconds per kernel launch,
so a fit on one GPU carries to another by its datasheet (how the H100 entry is made from the A100 fit).

    gemm          t = floor + (tc^p + tm^p)^(1/p); tc = FLOPs x (1 + n_half / tokens) / (peak x eff),
                  tm = bytes / (HBM x mem_eff): compute reaches half its large-batch rate at n_half tokens
                  (tile quantization: a tensor-core tile spans 64-256 token rows, so a few tokens pay for
                  padded rows), a count of tokens and not a fraction of the GPU's ridge point
    small ops     t = smooth max(floor, bytes / (HBM x mem_eff)), one entry per kind (norm, rope, act,
                  add, emb)
    attention     prefill: floor + FLOPs / (peak x eff) x (1 + occupancy / query blocks);
                  decode: floor + KV bytes / (HBM x mem_eff); KV write: floor + prompt tokens x token_s
    allreduce     per GPU count: smooth max(latency, bytes x 2(n-1)/n / bus bandwidth) (NCCL's bus bandwidth)
    p2p_latency   a pipeline send's fixed cost; step_cpu: the engine's CPU time per step (scheduling,
                  input preparation, sampling) that the GPU tables do not contain
YAML units are readable ones (us, ms, GB/s); the dataclasses hold base units (s, bytes/s).
"""
from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

SMALL_OPS = ("norm", "rope", "act", "add", "emb")
US, MS, GB = 1e-6, 1e-3, 1e9


@dataclass(frozen=True)
class GemmConst:
    eff: float  # achieved / peak FLOP/s of a large GEMM
    mem_eff: float  # achieved / peak HBM bandwidth streaming a weight matrix
    floor_s: float  # per GEMM kernel
    sharpness: float  # p of the smooth max of the compute and memory times (large p: a hard max)
    n_half: float = 0.0  # tokens at which the compute side runs at half its large-batch efficiency


@dataclass(frozen=True)
class OpConst:
    floor_s: float
    mem_eff: float
    sharpness: float = 2.0  # smooth max of the floor and the bandwidth time


def smooth_max(a: float, b: float, p: float) -> float:
    """(a^p + b^p)^(1/p): max(a, b) for large p, a soft knee for small p (1: the sum)."""
    return (a ** p + b ** p) ** (1 / p)


@dataclass(frozen=True)
class AttentionConst:
    prefill_floor_s: float
    prefill_eff: float  # of peak FLOP/s with the GPU full of query blocks
    prefill_occupancy: float  # query blocks (128 tokens x one head) at which the efficiency is half
    decode_floor_s: float
    decode_mem_eff: float  # of HBM bandwidth reading the KV cache
    kv_write_floor_s: float
    kv_write_token_s: float  # per prompt token written to the paged cache (decode tokens: the floor only)


@dataclass(frozen=True)
class LinkConst:
    latency_s: float
    bus_bw: float  # bytes/s, NCCL's bus bandwidth
    sharpness: float = 1.0  # time = smooth max (p) of the latency and bytes x 2(n-1)/n / bus_bw

    def allreduce(self, nbytes: float, n: int) -> float:
        return smooth_max(self.latency_s, nbytes * 2 * (n - 1) / n / self.bus_bw, self.sharpness)


@dataclass(frozen=True)
class StepConstants:
    gemm: GemmConst
    small: tuple[tuple[str, OpConst], ...]  # SMALL_OPS in order
    attention: AttentionConst
    allreduce: tuple[tuple[int, LinkConst], ...]  # GPU count -> curve, ascending
    p2p_latency_s: float
    step_cpu_s: float
    source: str = ""

    def op(self, kind: str) -> OpConst:
        return dict(self.small)[kind]

    def link(self, n: int) -> LinkConst:
        """The curve measured for `n` GPUs; else the nearest larger count (rings grow slower with
        more GPUs), else the largest."""
        curves = dict(self.allreduce)
        if n in curves:
            return curves[n]
        larger = [k for k in curves if k > n]
        return curves[min(larger)] if larger else curves[max(curves)]


# ---- the YAML / JSON edge -------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Gemm(_Strict):
    eff: float = Field(gt=0, le=1)
    mem_eff: float = Field(gt=0, le=1.2)
    floor_us: float = Field(ge=0)
    sharpness: float = Field(gt=0)
    n_half: float = Field(0.0, ge=0)


class _Op(_Strict):
    floor_us: float = Field(ge=0)
    mem_eff: float = Field(gt=0, le=1.2)
    sharpness: float = Field(2.0, gt=0)


class _Attention(_Strict):
    prefill_floor_us: float = Field(ge=0)
    prefill_eff: float = Field(gt=0, le=1)
    prefill_occupancy: float = Field(ge=0)
    decode_floor_us: float = Field(ge=0)
    decode_mem_eff: float = Field(gt=0, le=1.2)
    kv_write_floor_us: float = Field(ge=0)
    kv_write_token_us: float = Field(ge=0)


class _Link(_Strict):
    latency_us: float = Field(ge=0)
    bus_gbs: float = Field(gt=0)
    sharpness: float = Field(1.0, gt=0)


class StepEntry(_Strict):
    """A `step:` block (hardware.yaml) or a fitted profile's `step` object."""
    gemm: _Gemm
    small_ops: dict[str, _Op]
    attention: _Attention
    allreduce: dict[int, _Link]
    p2p_latency_us: float = Field(ge=0)
    step_cpu_ms: float = Field(ge=0)
    source: str = ""

    def model_post_init(self, _context) -> None:
        missing = [k for k in SMALL_OPS if k not in self.small_ops]
        unknown = [k for k in self.small_ops if k not in SMALL_OPS]
        if missing or unknown:
            raise ValueError(f"small_ops needs exactly {', '.join(SMALL_OPS)} "
                             f"(missing: {', '.join(missing) or '-'}; unknown: {', '.join(unknown) or '-'})")
        if not self.allreduce or min(self.allreduce) < 2:
            raise ValueError("allreduce needs at least one GPU count >= 2")

    def constants(self) -> StepConstants:
        g, a = self.gemm, self.attention
        return StepConstants(
            GemmConst(g.eff, g.mem_eff, g.floor_us * US, g.sharpness, g.n_half),
            tuple((k, OpConst(self.small_ops[k].floor_us * US, self.small_ops[k].mem_eff, self.small_ops[k].sharpness))
                  for k in SMALL_OPS),
            AttentionConst(a.prefill_floor_us * US, a.prefill_eff, a.prefill_occupancy, a.decode_floor_us * US,
                           a.decode_mem_eff, a.kv_write_floor_us * US, a.kv_write_token_us * US),
            tuple((n, LinkConst(c.latency_us * US, c.bus_gbs * GB, c.sharpness)) for n, c in sorted(self.allreduce.items())),
            self.p2p_latency_us * US, self.step_cpu_ms * MS, self.source)


def entry_dict(c: StepConstants, digits: int = 4) -> dict:
    """`StepConstants` -> the YAML/JSON block (`StepEntry` reads it back), rounded to `digits` significant
    digits."""
    r = lambda x: float(f"{x:.{digits}g}")  # noqa: E731
    g, a = c.gemm, c.attention
    return {
        "gemm": {"eff": r(g.eff), "mem_eff": r(g.mem_eff), "floor_us": r(g.floor_s / US), "sharpness": r(g.sharpness),
                 "n_half": r(g.n_half)},
        "small_ops": {k: {"floor_us": r(o.floor_s / US), "mem_eff": r(o.mem_eff), "sharpness": r(o.sharpness)}
                      for k, o in c.small},
        "attention": {"prefill_floor_us": r(a.prefill_floor_s / US), "prefill_eff": r(a.prefill_eff),
                      "prefill_occupancy": r(a.prefill_occupancy), "decode_floor_us": r(a.decode_floor_s / US),
                      "decode_mem_eff": r(a.decode_mem_eff), "kv_write_floor_us": r(a.kv_write_floor_s / US),
                      "kv_write_token_us": r(a.kv_write_token_s / US)},
        "allreduce": {n: {"latency_us": r(k.latency_s / US), "bus_gbs": r(k.bus_bw / GB), "sharpness": r(k.sharpness)}
                      for n, k in c.allreduce},
        "p2p_latency_us": r(c.p2p_latency_s / US),
        "step_cpu_ms": r(c.step_cpu_s / MS),
        "source": c.source,
    }
