"""Pipeline parallelism: which layers a stage owns, which weights it reads, its pages, its micro-batches
(pure functions).

Called by `stage_worker.StageWorker` (and `check_supported` in `tp_runner.py` before launch). Layers are
split into contiguous stages, sizes differing by at most one with earlier stages taking the extra layers
(the last stage also runs the final norm and the LM head). The first stage reads the embedding, the last
the final norm and LM head (the embedding too when they are tied). Each stage's page pool holds only its
layers (`KVPageSpec.layer_start/layer_end`), with the same page ids as every other stage: the driver's
one allocator addresses all of them. A step's sequences are cut into micro-batches of similar token
counts so stage s works on micro-batch i + 1 while stage s + 1 works on micro-batch i; the cut depends only
on token counts, so every stage (with or without logits rows in its copy of the batch) cuts the same way.
"""
from __future__ import annotations

import dataclasses

from engine.batch import StepBatch
from engine.config import ModelConfig
from engine.kv_cache.spec import KVPageSpec
from engine.parallel.validate import PP_FIELD as FIELD, validate_pp  # noqa: F401 - judged with TP there

def stage_layers(num_layers: int, stage: int, size: int) -> range:
    """Global layer ids of `stage` of `size`: contiguous, earlier stages one larger when uneven."""
    base, extra = divmod(num_layers, size)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def stage_wants(name: str, cfg: ModelConfig, layers: range, tied: bool) -> bool:
    """Does the stage holding `layers` need checkpoint tensor `name`? `tied`: the LM head is the
    embedding (configured so, or the checkpoint has no lm_head.weight)."""
    first, last = layers.start == 0, layers.stop == cfg.num_layers
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) in layers
    if name == "model.embed_tokens.weight":
        return first or (last and tied)
    if name in ("model.norm.weight", "lm_head.weight"):
        return last
    return True  # anything else (buffers) travels everywhere


def stage_kv_spec(spec: KVPageSpec, layers: range) -> KVPageSpec:
    """A stage's page pool: the replica's spec restricted to the stage's layers."""
    assert spec.layer_start == 0 and spec.layer_end is None, "split the replica's whole spec"
    return dataclasses.replace(spec, layer_start=layers.start, layer_end=layers.stop)


def micro_batches(batch: StepBatch, count: int) -> list[StepBatch]:
    """Consecutive runs of the batch's sequences, at most `count`, each with roughly 1/count of the
    tokens (a sequence is never split)."""
    total, target = batch.num_tokens, max(1, -(-batch.num_tokens // max(1, count)))
    out, cur, cur_tokens = [], [], 0
    for s in batch.seqs:
        cur.append(s)
        cur_tokens += len(s.token_ids)
        if cur_tokens >= target and len(out) < count - 1:
            out.append(cur)
            cur, cur_tokens = [], 0
    if cur:
        out.append(cur)
    assert sum(len(s.token_ids) for mb in out for s in mb) == total
    return [StepBatch(seqs, batch.return_logits, batch.observe) for seqs in out]
