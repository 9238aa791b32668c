"""Pipeline stages (engine/parallel/stages.py) and the staged forward, in one process.

Layer splits (contiguous, earlier stages take the extra layer), degree validation (typed, naming the
field), which checkpoint tensors a stage reads, a stage's KV page spec, micro-batch cuts that depend only
on token counts, and stage models run one after another (hidden states handed on by hand) equal to the
whole model, bit for bit in float32.
"""
from __future__ import annotations

import pytest
import torch

from engine.attention_context import SeqLayout, build_context
from engine.batch import SeqStep, StepBatch
from engine.kv_cache.backend import make_backend
from engine.kv_cache.spec import KVPageSpec
from engine.loader import load_config, load_weights
from engine.model import LlamaForward
from engine.parallel.errors import ParallelConfigError
from engine.parallel.rank_worker import without_logits
from engine.parallel.stages import micro_batches, stage_kv_spec, stage_layers, stage_wants, validate_pp
from tests.prompts import MIXED
from tests.tiny_models import write_tiny


@pytest.fixture(scope="module")
def tiny5(tmp_path_factory):
    return write_tiny("llama", tmp_path_factory.mktemp("pp") / "l5", num_hidden_layers=5, initializer_range=0.1)


@pytest.mark.parametrize("layers, size, expect", [
    (30, 2, [(0, 15), (15, 30)]), (5, 2, [(0, 3), (3, 5)]), (5, 3, [(0, 2), (2, 4), (4, 5)]),
    (4, 4, [(0, 1), (1, 2), (2, 3), (3, 4)]), (7, 1, [(0, 7)])])
def test_stage_layers_are_contiguous_and_balanced(layers, size, expect):
    assert [(r.start, r.stop) for r in (stage_layers(layers, s, size) for s in range(size))] == expect


def test_degrees_are_validated(tiny5):
    cfg = load_config(tiny5)
    validate_pp(cfg, 5)
    for bad, what in ((6, "num_hidden_layers"), (0, "positive integer"), (2.0, "positive integer")):
        with pytest.raises(ParallelConfigError, match=what) as e:
            validate_pp(cfg, bad)
        assert e.value.field == "pipeline_parallel_size"


def test_stage_reads_only_its_tensors(tiny5):
    cfg, names = load_config(tiny5), list(load_weights(tiny5))
    first = {n for n in names if stage_wants(n, cfg, range(0, 3), tied=False)}
    last = {n for n in names if stage_wants(n, cfg, range(3, 5), tied=False)}
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert {"lm_head.weight", "model.norm.weight"} <= last and "model.embed_tokens.weight" not in last
    assert not any(n.startswith(("model.layers.3.", "model.layers.4.")) for n in first)
    assert first | last == set(names) and not any(n.startswith("model.layers.") for n in first & last)
    assert stage_wants("model.embed_tokens.weight", cfg, range(3, 5), tied=True)  # the tied LM head


def test_stage_kv_spec_holds_its_layers_and_signs_them():
    spec = KVPageSpec(5, 2, 8, 4, "float32")
    a, b = stage_kv_spec(spec, range(0, 3)), stage_kv_spec(spec, range(3, 5))
    assert list(a.local_layers) == [0, 1, 2] and list(b.local_layers) == [3, 4]
    assert len({spec.signature(), a.signature(), b.signature()}) == 3


def seq(rid: str, n: int, logits: bool = True) -> SeqStep:
    return SeqStep(rid, list(range(n)), 0, 0, [0], [n - 1] if logits else [])


def test_micro_batches_cut_by_tokens_and_agree_without_logits():
    batch = StepBatch([seq("a", 40), seq("b", 1), seq("c", 1), seq("d", 20), seq("e", 1)])
    for count in (1, 2, 3, 8):
        mbs = micro_batches(batch, count)
        assert 1 <= len(mbs) <= count
        assert [s.request_id for mb in mbs for s in mb.seqs] == list("abcde")
        stripped = micro_batches(without_logits(batch), count)
        assert [[s.request_id for s in mb.seqs] for mb in mbs] == [[s.request_id for s in mb.seqs] for mb in stripped]
    assert [[s.request_id for s in mb.seqs] for mb in micro_batches(batch, 2)] == [["a"], ["b", "c", "d", "e"]]


def test_stages_in_sequence_equal_the_whole_model(tiny5):
    cfg, full = load_config(tiny5), load_weights(tiny5)
    spec = KVPageSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8, "float32")
    ids = torch.tensor(MIXED)
    pos = torch.arange(len(ids))
    ctx = build_context([SeqLayout("a", len(ids), 0, [0, 1])], spec.page_size, cfg.head_dim ** -0.5)
    with torch.inference_mode():
        whole = LlamaForward(cfg, full, torch.float32)
        reference = whole.logits(whole.forward(ids, pos, ctx, make_backend(spec, 2)))
        hidden = None
        for s in range(3):
            layers = stage_layers(cfg.num_layers, s, 3)
            model = LlamaForward(cfg, full, torch.float32, layers=layers)
            assert model.is_first == (s == 0) and model.is_last == (s == 2)
            hidden = model.forward(ids, pos, ctx, make_backend(stage_kv_spec(spec, layers), 2), hidden=hidden)
        assert torch.equal(model.logits(hidden), reference)  # same ops in the same order
