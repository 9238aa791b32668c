"""Qwen3, Qwen2-MoE (shared expert), Qwen3-MoE and Mixtral on CUDA (skipped without a GPU): the engine's default
CUDA path (Triton paged attention, CUDA-graph decode steps, whose capture takes the MoE layer's dense path:
engine/moe.py) gives the CPU engine's float32 greedy tokens, for 8 ragged prompts with chunked prefill; bf16
runs."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
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


@pytest.mark.parametrize("arch", ["qwen3", "qwen2_moe", "qwen3_moe", "mixtral"])
def test_cuda_engine_equals_cpu_engine(tmp_path, arch):
    model = write_tiny_moe(arch, tmp_path / arch)
    kw = dict(dtype="float32", num_pages=256, page_size=16, max_num_batched_tokens=64)
    cpu = LLM(model=str(model), keep_logits=True, **kw)
    ref = cpu.generate(PROMPTS, PARAMS)
    gpu = LLM(model=str(model), device="cuda", max_num_seqs=8, **kw)
    assert gpu.decode_graphs is not None  # decode steps replay captured graphs
    got = gpu.generate(PROMPTS, PARAMS)
    assert_greedy_equal([o.token_ids for o in ref], [o.token_ids for o in got], [torch.stack(o.logits) for o in ref])
    assert_engine_empty(cpu)
    assert_engine_empty(gpu)
    bf16 = LLM(model=str(model), device="cuda", dtype="bfloat16", num_pages=256, page_size=16)
    outs = bf16.generate(PROMPTS, PARAMS)
    assert all(len(o.token_ids) == PARAMS.max_tokens for o in outs)
    assert_engine_empty(bf16)
