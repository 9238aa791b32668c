"""Tensor and pipeline parallel on CUDA with NCCL (skipped without enough GPUs): the same checks as
tests/integration/test_tensor_parallel.py / test_pipeline_parallel.py, rank r on cuda:r, against one
process on cuda:0. float32 with TF32 off, so greedy-equal and logits within 1e-4 still mean something."""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from tests.parallel_helpers import PROMPTS, assert_parallel_equal
from tests.tiny_models import write_tiny

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _tiny(tmp_path, heads: int, kv: int):
    return write_tiny("llama", tmp_path / f"l{heads}{kv}", num_attention_heads=heads, num_key_value_heads=kv,
                      initializer_range=0.1)


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA devices")
def test_tp2_nccl_equals_one_gpu(tmp_path):
    assert_parallel_equal(_tiny(tmp_path, 8, 4), PROMPTS, GREEDY, device="cuda", tensor_parallel_size=2)


@pytest.mark.skipif(GPUS < 4, reason="needs 4 CUDA devices")
def test_tp4_nccl_replicated_kv_heads_equals_one_gpu(tmp_path):
    assert_parallel_equal(_tiny(tmp_path, 8, 2), PROMPTS, GREEDY, device="cuda", tensor_parallel_size=4)


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA devices")
def test_pp2_nccl_equals_one_gpu(tmp_path):
    assert_parallel_equal(_tiny(tmp_path, 8, 4), PROMPTS, GREEDY, device="cuda", pipeline_parallel_size=2)
