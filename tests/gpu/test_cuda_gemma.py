"""Gemma 3 text on CUDA (skipped without a GPU; not yet run on one): the engine's CUDA path (local layers'
windowed groups through SDPA, global layers' decode and verify groups through the Triton paged kernel, here at
head_dim 32 and at Gemma's 256; no CUDA-graph decode for local windows) gives the CPU engine's float32 greedy
tokens for 8 ragged prompts past the window of 8, with chunked prefill; bf16 runs."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.tiny_gemma_models import write_tiny_gemma

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(10 + i, 10 + i + n)) for i, n in enumerate([3, 40, 11, 1, 27, 6, 19, 33])]


@pytest.fixture(autouse=True)
def no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("head_dim", [32, 256])
def test_cuda_engine_equals_cpu_engine(tmp_path, head_dim):
    model = write_tiny_gemma(tmp_path / f"gemma{head_dim}", head_dim=head_dim)
    kw = dict(dtype="float32", num_pages=256, page_size=16, max_num_batched_tokens=64)
    cpu = LLM(model=str(model), keep_logits=True, **kw)
    ref = cpu.generate(PROMPTS, PARAMS)
    gpu = LLM(model=str(model), device="cuda", max_num_seqs=8, **kw)
    assert gpu.decode_graphs is None  # local windows: decode steps run eagerly
    got = gpu.generate(PROMPTS, PARAMS)
    assert_greedy_equal([o.token_ids for o in ref], [o.token_ids for o in got], [torch.stack(o.logits) for o in ref])
    assert_engine_empty(cpu)
    assert_engine_empty(gpu)
    bf16 = LLM(model=str(model), device="cuda", dtype="bfloat16", num_pages=256, page_size=16)
    outs = bf16.generate(PROMPTS, PARAMS)
    assert all(len(o.token_ids) == PARAMS.max_tokens for o in outs)
    assert_engine_empty(bf16)
