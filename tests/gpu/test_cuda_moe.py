"""Qwen3, Qwen2-MoE (shared expert), Qwen3-MoE and Mixtral on CUDA (skipped without a GPU): the engine's default
CUDA path (Triton paged attention, CUDA-graph decode steps; MoE layers grouped, dense in graphs) and the same with
the Triton grouped MoE kernel (`PDSERVE_MOE=triton`, eager and captured: engine/moe.py) give the CPU engine's
float32 greedy tokens, for 8 ragged prompts with chunked prefill; bf16 runs. The Triton MoE kernel (engine/kernels/cuda/moe_grouped.py) against `grouped`'s torch
path on CUDA: float32 and bf16, an expert-parallel half, 16-, 32- and 64-row blocks, and replayed in a CUDA graph at
Qwen3-30B-A3B's widths with new routings copied in."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams, moe
from engine.config import MoEConfig
from engine.linear import Linear
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.tiny_moe_models import write_tiny_moe

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(10 + i, 10 + i + n)) for i, n in enumerate([3, 40, 11, 1, 27, 6, 19, 33])]


@pytest.fixture(autouse=True)
def no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("impl", ["auto", "triton"])  # today's CUDA default (grouped / dense in graphs), the kernel
@pytest.mark.parametrize("arch", ["qwen3", "qwen2_moe", "qwen3_moe", "mixtral"])
def test_cuda_engine_equals_cpu_engine(tmp_path, arch, impl, monkeypatch):
    model = write_tiny_moe(arch, tmp_path / arch)
    kw = dict(dtype="float32", num_pages=256, page_size=16, max_num_batched_tokens=64)
    cpu = LLM(model=str(model), keep_logits=True, **kw)
    ref = cpu.generate(PROMPTS, PARAMS)
    monkeypatch.setenv("PDSERVE_MOE", impl)
    gpu = LLM(model=str(model), device="cuda", max_num_seqs=8, **kw)
    assert gpu.decode_graphs is not None  # decode steps replay captured graphs
    assert moe.moe_choice(torch.device("cuda")) == ("grouped" if impl == "auto" else "triton")
    got = gpu.generate(PROMPTS, PARAMS)
    assert_greedy_equal([o.token_ids for o in ref], [o.token_ids for o in got], [torch.stack(o.logits) for o in ref])
    assert_engine_empty(cpu)
    assert_engine_empty(gpu)
    bf16 = LLM(model=str(model), device="cuda", dtype="bfloat16", num_pages=256, page_size=16)
    outs = bf16.generate(PROMPTS, PARAMS)
    assert all(len(o.token_ids) == PARAMS.max_tokens for o in outs)
    assert_engine_empty(bf16)


def _layer(experts, top_k, hidden, inter, dtype, first=0, held=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g, device="cuda") * hidden ** -0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g, device="cuda") * inter ** -0.5).to(dtype)
    held = experts if held is None else held
    gate_up, down = gate_up[first:first + held].contiguous(), down[first:first + held].contiguous()
    cfg = MoEConfig(experts, top_k, inter, True, (0,), False, "qwen")
    router = torch.zeros(experts, hidden, dtype=dtype, device="cuda")  # unused: the tests route themselves
    return moe.MoELayer(cfg, router, gate_up, down, [Linear(t) for t in gate_up], [Linear(t) for t in down], first)


def _routing(tokens, experts, top_k, hidden, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, device="cuda").to(dtype)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, experts, generator=g, device="cuda"), -1), top_k)
    return h, (weights / weights.sum(-1, keepdim=True)).to(dtype), ids


def _tol(want, dtype):  # float32: IEEE products in both; bf16: the same roundings, sums in other orders
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=float(want.abs().max()) / 32, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,first,held", [(1, 0, None), (33, 0, None), (33, 8, 8), (300, 0, None)],
                         ids=["t1", "t33", "t33-ep-upper-half", "t300"])
def test_triton_moe_equals_grouped_on_cuda(dtype, tokens, first, held):
    layer = _layer(16, 4, 512, 256, dtype, first, held, seed=tokens)
    h, weights, ids = _routing(tokens, 16, 4, 512, dtype, seed=tokens + 1)
    want = moe.grouped(layer, h, weights, ids)
    got = moe.IMPLS["triton"](layer, h, weights, ids)
    torch.testing.assert_close(got, want, **_tol(want, dtype))
    untouched = ~((ids >= first) & (ids < first + (held or 16))).any(dim=1)
    assert torch.equal(got[untouched], torch.zeros_like(got[untouched]))


@torch.inference_mode()
def test_triton_moe_replays_in_a_cuda_graph():
    """Qwen3-30B-A3B's expert widths (128 experts of 768, hidden 2048, top-8), 4 tokens: captured once, replayed
    with new routings copied into its inputs, each equal to `grouped` run eagerly."""
    from engine.kernels.cuda.moe_grouped import moe_grouped

    dtype, e, k, hidden, inter = torch.bfloat16, 128, 8, 2048, 768
    layer = _layer(e, k, hidden, inter, dtype, seed=1)
    h, weights, ids = _routing(4, e, k, hidden, dtype, seed=2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        moe_grouped(h, ids, weights, layer.gate_up, layer.down)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_grouped(h, ids, weights, layer.gate_up, layer.down)
    for seed in (3, 4, 5):
        nh, nw, nids = _routing(4, e, k, hidden, dtype, seed=seed)
        h.copy_(nh)
        weights.copy_(nw)
        ids.copy_(nids)
        graph.replay()
        want = moe.grouped(layer, nh, nw, nids)
        torch.testing.assert_close(out, want, **_tol(want, dtype))
