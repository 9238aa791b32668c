"""The CUDA decode path (skipped without a GPU): the Triton paged kernel compiled (its for loop, bf16 tensor-core
dots) against the torch reference; CUDA-graph decode greedy-equal to the CPU engine in float32 and
token-equal to the same static step run eagerly in bfloat16; no host sync inside the static step."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.tiny_models import write_tiny
from tests.unit.test_triton_paged_attention import CASES, _inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", CASES)
def test_compiled_kernel_matches_reference(case, dtype, atol):
    from engine.kernels.cuda.paged_attention import paged_attention
    from engine.kernels.reference import paged_attention as reference

    q, k, v, table, lens = (t.cuda() for t in _inputs(case, dtype))
    got = paged_attention(q, k, v, table, lens, case[3] ** -0.5, case[5], case[6])
    want = reference(q, k, v, table, lens, case[3] ** -0.5, case[5])
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=atol, rtol=atol)


def _prompts(n=8):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (int(x),), generator=g).tolist() for x in torch.linspace(5, 400, n)]


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    return write_tiny("llama", tmp_path_factory.mktemp("g") / "m", num_attention_heads=8, num_key_value_heads=2,
                      initializer_range=0.1)


def _llm(model, **kw):
    return LLM(model=str(model), num_pages=512, max_num_batched_tokens=256, max_num_seqs=16, max_model_len=512, **kw)


def test_graphs_float32_equal_cpu(gqa):
    cpu = _llm(gqa, dtype="float32", keep_logits=True)
    ref = cpu.generate(_prompts(), GREEDY)
    gpu = _llm(gqa, dtype="float32", device="cuda")
    assert gpu.decode_graphs is not None and gpu.decode_graphs.use_graphs
    got = gpu.generate(_prompts(), GREEDY)
    assert_greedy_equal([o.token_ids for o in ref], [o.token_ids for o in got], [torch.stack(o.logits) for o in ref])
    assert_engine_empty(gpu)


def test_graphs_bf16_equal_static_eager(gqa):
    eager = _llm(gqa, dtype="bfloat16", device="cuda", decode_graphs="static").generate(_prompts(), GREEDY)
    gpu = _llm(gqa, dtype="bfloat16", device="cuda")
    got = gpu.generate(_prompts(), GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in eager]
    assert_engine_empty(gpu)


def test_no_host_sync_in_static_step(gqa):
    llm = _llm(gqa, dtype="bfloat16", device="cuda", decode_graphs="static")
    bucket = llm.decode_graphs.buckets[4, 1]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        llm.decode_graphs._forward(bucket)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_engine_empty(llm)


def test_compiled_fused_ops_match_reference():
    """Compiled, the fused kernels round like torch: the residual add bit-exact in bfloat16."""
    from engine.kernels import reference as ref
    from engine.kernels.cuda import fused_ops

    g = torch.Generator(device="cuda").manual_seed(0)
    x, delta = (torch.randn(7, 4096, device="cuda", generator=g).bfloat16() for _ in range(2))
    w = torch.randn(4096, device="cuda", generator=g).bfloat16()
    out, res = fused_ops.add_rms_norm(x, delta, w, 1e-5)
    want_out, want_res = ref.add_rms_norm(x, delta, w, 1e-5)
    assert torch.equal(res, want_res)
    torch.testing.assert_close(out.float(), want_out.float(), atol=6e-2, rtol=6e-2)
    gu = torch.randn(7, 2 * 14336, device="cuda", generator=g).bfloat16()
    torch.testing.assert_close(fused_ops.silu_mul(gu).float(), ref.silu_mul(gu).float(), atol=6e-2, rtol=6e-2)


def test_quest_on_cuda_equals_cpu_float32(gqa):
    """Sparse (Quest) decode on CUDA (the choice on the GPU, the Triton kernel over each KV head's pages):
    the CPU torch sparse path's float32 greedy tokens."""
    sparse = {"method": "quest", "budget": 64, "sink_pages": 1, "recent": 16, "min_context": 0}
    cpu = _llm(gqa, dtype="float32", keep_logits=True, sparse_attention=sparse)
    ref = cpu.generate(_prompts(), GREEDY)
    gpu = _llm(gqa, dtype="float32", device="cuda", sparse_attention=sparse)
    got = gpu.generate(_prompts(), GREEDY)
    assert_greedy_equal([o.token_ids for o in ref], [o.token_ids for o in got], [torch.stack(o.logits) for o in ref])
    assert_engine_empty(gpu)
