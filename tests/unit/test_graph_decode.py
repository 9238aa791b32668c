"""The engine's CUDA decode path on CPU: attention through the Triton paged kernel (Triton's interpreter) and
the static-shape decode step that CUDA graphs capture (engine/kernels/cuda/graph_decode.py), run eagerly
through the same code. Float32 greedy tokens equal today's torch path; no pages leak; no host sync inside
the static step."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine import LLM, SamplingParams  # noqa: E402
from tests.conftest import assert_engine_empty  # noqa: E402
from tests.exactness import assert_greedy_equal  # noqa: E402
from tests.tiny_models import write_tiny  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LENGTHS = [3, 17, 60]  # ragged: rows decode at different context lengths, some join late


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory):
    return write_tiny("llama", tmp_path_factory.mktemp("gqa") / "m", num_attention_heads=8, num_key_value_heads=2,
                      initializer_range=0.1)


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in LENGTHS]


def _engine(model_dir, monkeypatch, attention: str, **kw):
    monkeypatch.setenv("PDSERVE_ATTENTION", attention)
    return LLM(model=str(model_dir), dtype="float32", num_pages=128, max_num_batched_tokens=64, max_num_seqs=8,
               max_model_len=256, **kw)


@pytest.fixture(scope="module")
def reference(gqa_dir):
    mp = pytest.MonkeyPatch()
    try:
        ref = _engine(gqa_dir, mp, "torch", keep_logits=True)
        outs = ref.generate(_prompts(), GREEDY)
        assert_engine_empty(ref)
    finally:
        mp.undo()
    return [o.token_ids for o in outs], [torch.stack(o.logits) for o in outs]


@pytest.fixture(scope="module")
def eager(gqa_dir):
    """(the engine, its outputs): the Triton kernel without the static step, GREEDY over the prompts. Run once:
    the [off] case checks it against the torch path, the deferred-output test reads its tokens and text."""
    mp = pytest.MonkeyPatch()
    try:
        llm = _engine(gqa_dir, mp, "triton", decode_graphs="off")
        return llm, llm.generate(_prompts(), GREEDY)
    finally:
        mp.undo()


@pytest.mark.parametrize("graphs", ["off", "static"])
def test_triton_decode_equals_torch_path(gqa_dir, monkeypatch, reference, eager, graphs):
    llm = eager[0] if graphs == "off" else _engine(gqa_dir, monkeypatch, "triton", decode_graphs=graphs)
    assert llm.backend.triton_paged and llm.backend.ragged_decode
    used = []
    if graphs == "static":
        real = llm.decode_graphs.launch
        llm.decode_graphs.launch = lambda batch: (used.append(len(batch.seqs)), real(batch))[1]
        outs = llm.generate(_prompts(), GREEDY)
    else:
        assert llm.decode_graphs is None
        outs = eager[1]
    assert_greedy_equal(reference[0], [o.token_ids for o in outs], reference[1])
    if graphs == "static":  # the static step served the plain decode steps, at several batch sizes
        assert len(used) >= GREEDY.max_tokens - 1 and len(set(used)) > 1
    assert_engine_empty(llm)


def test_static_step_samples_seeded_and_mixed_rows(gqa_dir, monkeypatch):
    """Greedy and seeded-sampling rows in one static step: each request its max_tokens, same seeded tokens
    as the eager Triton path (float32: identical logits up to rounding), pages freed."""
    params = [SamplingParams(max_tokens=6, temperature=0.8, top_k=20, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)]
    prompts = _prompts()[:3]
    eager = _engine(gqa_dir, monkeypatch, "triton", decode_graphs="off").generate(prompts, params)
    llm = _engine(gqa_dir, monkeypatch, "triton", decode_graphs="static")
    got = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in got] == [6, 6, 6]
    assert [o.token_ids for o in got] == [o.token_ids for o in eager]
    assert_engine_empty(llm)


SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero")


class _SyncDetector:
    """Patches the tensor methods that copy device values to the host; records every call."""

    def __init__(self, monkeypatch):
        self.calls = []
        for name in SYNCS:
            real = getattr(torch.Tensor, name)

            def spy(t, *a, _name=name, _real=real, **kw):
                self.calls.append(_name)
                return _real(t, *a, **kw)
            monkeypatch.setattr(torch.Tensor, name, spy)


def test_no_host_sync_inside_the_static_step(gqa_dir, monkeypatch):
    llm = _engine(gqa_dir, monkeypatch, "triton", decode_graphs="static")
    graphs = llm.decode_graphs
    # the shortest prompt: the bucket checked holds padding rows until a decode step fills it, whatever the prompt
    llm.add_request(_prompts()[0], GREEDY)
    llm.step()  # the prompt
    bucket = graphs.buckets[1, 1]
    with monkeypatch.context() as m:
        spy = _SyncDetector(m)
        graphs._forward(bucket)  # what a CUDA graph would capture
    assert spy.calls == [], f"host syncs inside the static step: {spy.calls}"
    with monkeypatch.context() as m:  # the detector can fail
        spy = _SyncDetector(m)
        bucket.dev[0].item()
    assert spy.calls == ["item"]
    llm.generate_until_idle()
    assert_engine_empty(llm)


def test_bad_mode_is_a_typed_error(gqa_dir, monkeypatch):
    from engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="decode_graphs"):
        _engine(gqa_dir, monkeypatch, "triton", decode_graphs="always")


def test_int8_pages_on_the_triton_path_equal_the_torch_path(gqa_dir, monkeypatch):
    """int8 pages read in place by the Triton kernel (dequantized as they load) in the static step: the
    same float32 greedy tokens as int8 pages through the torch path (same cells, same rotation)."""
    want = _engine(gqa_dir, monkeypatch, "torch", kv_storage="int8", keep_logits=True)
    ref = want.generate(_prompts(), GREEDY)
    llm = _engine(gqa_dir, monkeypatch, "triton", kv_storage="int8", decode_graphs="static")
    assert llm.backend.triton_paged and llm.decode_graphs is not None and llm.backend.ragged_decode
    got = llm.generate(_prompts(), GREEDY)
    assert_greedy_equal([o.token_ids for o in ref], [o.token_ids for o in got], [torch.stack(o.logits) for o in ref])
    assert_engine_empty(llm)


def test_verify_steps_take_the_static_step_and_stay_lossless(gqa_dir, monkeypatch, reference):
    """Draft-verify with the static step: verify rows (1 + k tokens, fewer drafts padded to the bucket's
    q_len) and plain rows in one static batch; the float32 greedy tokens equal plain decoding's."""
    spec = {"proposer": "ngram", "max_draft": 3, "gate": False}
    llm = _engine(gqa_dir, monkeypatch, "triton", decode_graphs="static", speculative=spec)
    graphs = llm.decode_graphs
    assert graphs.verify_len == 4 and (1, 4) in graphs.buckets
    qlens = []
    real = graphs.launch
    graphs.launch = lambda batch: (qlens.append(graphs._qlen(batch)), real(batch))[1]
    prompts = [p * 2 for p in _prompts()[:3]]  # a repeat: the n-gram proposer finds drafts
    ref = _engine(gqa_dir, monkeypatch, "torch", keep_logits=True)
    want = ref.generate(prompts, GREEDY)
    got = llm.generate(prompts, GREEDY)
    assert_greedy_equal([o.token_ids for o in want], [o.token_ids for o in got], [torch.stack(o.logits) for o in want])
    assert 4 in qlens and 1 in qlens, qlens  # verify steps and plain steps both ran static
    assert llm.spec_stats()["num_spec_steps"] > 0
    assert_engine_empty(llm)


@pytest.mark.parametrize("graphs", ["off", "static"])
def test_quest_on_the_triton_path_equals_the_torch_sparse_path(gqa_dir, monkeypatch, graphs):
    """Sparse (Quest) decode with the Triton kernel reading each KV head's chosen pages: the same float32
    greedy tokens as the torch sparse path (the same choice, attended over gathered pages). "static": the
    static step chooses on the device at fixed shapes (engine/kernels/cuda/quest.py) and keeps the written
    pages' summaries from extents the host uploads."""
    sparse = {"method": "quest", "budget": 32, "sink_pages": 1, "recent": 16, "min_context": 0}
    kw = dict(sparse_attention=sparse, page_size=8)
    want = _engine(gqa_dir, monkeypatch, "torch", keep_logits=True, decode_graphs="off", **kw)
    ref = want.generate(_prompts(), GREEDY)
    llm = _engine(gqa_dir, monkeypatch, "triton", decode_graphs=graphs, **kw)
    assert llm.backend.triton_paged and llm.backend.sparse is not None
    assert (llm.decode_graphs is not None) == (graphs == "static")
    calls, static = [], []
    import engine.kernels.cuda.paged_attention as pa
    real = pa.paged_attention
    monkeypatch.setattr(pa, "paged_attention", lambda *a, **k: (calls.append(a[3].dim()), real(*a, **k))[1])
    if graphs == "static":
        launch = llm.decode_graphs.launch
        llm.decode_graphs.launch = lambda batch: (static.append(len(batch.seqs)), launch(batch))[1]
    ids = [llm.add_request(p, GREEDY) for p in _prompts()]
    final, checked = {}, 0
    while llm.has_unfinished():
        final.update((o.request_id, o) for o in llm.step() if o.finished)
        if len(static) == 4 and not checked:  # mid-decode: the summaries the steps kept equal recomputed ones
            s = llm.backend.summaries
            for page in range(llm.allocator.num_pages):
                if (filled := int(s.extent[page])):
                    lo, hi = s.expected(0, page, filled)
                    assert torch.equal(s.lo[0][page], lo) and torch.equal(s.hi[0][page], hi), page
                    checked += 1
    got = [final[i] for i in ids]
    assert_greedy_equal([o.token_ids for o in ref], [o.token_ids for o in got], [torch.stack(o.logits) for o in ref])
    assert 3 in calls  # per-(row, KV head) page tables went to the kernel
    assert bool(static) == (graphs == "static") and (checked > 0) == (graphs == "static")
    assert_engine_empty(llm)


def _stream(llm, prompts, params, abort_at=None):
    """Step by hand: every output in order per request; `abort_at=(step, index)` aborts one request then."""
    ids = [llm.add_request(p, params) for p in prompts]
    seen = {i: [] for i in ids}
    n = 0
    while llm.has_unfinished():
        for o in llm.step():
            seen[o.request_id].append(o)
        n += 1
        if abort_at is not None and n == abort_at[0]:
            llm.abort(ids[abort_at[1]])
            seen[ids[abort_at[1]]].append("aborted")
    return [seen[i] for i in ids]


def test_deferred_outputs_stream_stop_strings_and_aborts_as_eager(gqa_dir, monkeypatch, eager):
    """Plain greedy static steps hand their tokens to the next step to detokenize (on a GPU that work
    overlaps the device's): the streamed deltas add up to each final output, a stop string found one step
    late ends the request with the eager path's tokens and text (the token computed past it dropped), an
    abort while a request's output is deferred emits nothing more for it, and no page leaks."""
    params, n = GREEDY, GREEDY.max_tokens
    prompts = _prompts()
    plain = eager[1]  # the same prompts and params through the Triton kernel without the static step
    stops = [o.text[len(o.text) // 2:len(o.text) // 2 + 2] for o in plain]  # hit mid-way through each output
    assert all(stops), [o.text for o in plain]
    stop_params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, stop=stops)
    eager = _engine(gqa_dir, monkeypatch, "triton", decode_graphs="off")
    want = [s[-1] for s in _stream(eager, prompts, stop_params)]
    llm = _engine(gqa_dir, monkeypatch, "triton", decode_graphs="static")
    deferred = []
    real = llm.decode_graphs.launch
    llm.decode_graphs.launch = lambda batch: (lambda p: (deferred.append(p.overlaps), p)[1])(real(batch))
    got = _stream(llm, prompts, stop_params)
    assert any(deferred), "no static step overlapped"
    assert any(o.finish_reason == "stop" and len(o.token_ids) < n for o in want)
    for outs, w in zip(got, want):
        final = outs[-1]
        assert final.finished and [o.finished for o in outs].count(True) == 1
        assert (final.token_ids, final.text, final.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        assert [t for o in outs for t in o.new_token_ids] == final.token_ids  # deltas add up
        assert "".join(o.new_text for o in outs) == final.text
    assert_engine_empty(llm)

    aborted = _stream(llm, prompts, params, abort_at=(4, 1))
    assert aborted[1][-1] == "aborted" and not any(o.finished for o in aborted[1][:-1])
    for k in (0, 2):
        assert aborted[k][-1].token_ids == plain[k].token_ids
    assert_engine_empty(llm)
