"""The engine on CUDA (skipped without a GPU): SmolLM2 greedy-equal to the CPU engine, no leaked pages."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.prompts import token_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PARAMS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def test_cuda_matches_cpu_float32():
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 for the comparison
    torch.backends.cudnn.allow_tf32 = False
    cpu = LLM(dtype="float32", num_pages=256, keep_logits=True)
    prompts = token_prompts(cpu.tokenizer, [16, 200, 700])
    ref = cpu.generate(prompts, PARAMS)
    gpu = LLM(dtype="float32", device="cuda", num_pages=256)
    got = gpu.generate(prompts, PARAMS)
    assert_greedy_equal([o.token_ids for o in ref], [o.token_ids for o in got],
                        [torch.stack(o.logits) for o in ref])
    assert_engine_empty(cpu)
    assert_engine_empty(gpu)


def test_cuda_bfloat16_batch_runs_and_frees_pages():
    gpu = LLM(dtype="bfloat16", device="cuda", num_pages=64, max_num_batched_tokens=128)
    prompts = token_prompts(gpu.tokenizer, [50, 300, 600, 20])
    outs = gpu.generate(prompts, SamplingParams(max_tokens=40, temperature=0.7, seed=3, ignore_eos=True))
    assert all(len(o.token_ids) == 40 for o in outs)
    assert gpu.scheduler.stats.num_chunked_prefills > 0
    assert_engine_empty(gpu)
