"""CUDA attention paths on a tiny GQA model (skipped without a GPU; needs no bundled weights): bucketed,
masked decode groups and chunked prefill under the SDPA backends engine/sdpa_backends.py names, greedy-equal
to the CPU engine in float32, and every backend list a user can name gives the same tokens."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.tiny_models import write_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
LENGTHS = [3, 17, 40, 90, 200, 333]  # spread: decode rows fall into length buckets with padding masks


def _prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(autouse=True)
def no_tf32():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("backends", [None, "efficient,math", "math"])
def test_masked_decode_buckets_on_cuda_equal_cpu(tmp_path, monkeypatch, backends):
    if backends:
        monkeypatch.setenv("PDSERVE_CUDA_SDPA", backends)
    model = write_tiny("llama", tmp_path / "gqa", num_attention_heads=8, num_key_value_heads=2,
                       initializer_range=0.1)
    kw = dict(dtype="float32", num_pages=256, page_size=16, max_num_batched_tokens=64)  # 64: chunked prefill
    cpu = LLM(model=str(model), keep_logits=True, **kw)
    ref = cpu.generate(_prompts(), PARAMS)
    gpu = LLM(model=str(model), device="cuda", **kw)
    got = gpu.generate(_prompts(), PARAMS)
    assert_greedy_equal([o.token_ids for o in ref], [o.token_ids for o in got], [torch.stack(o.logits) for o in ref])
    assert_engine_empty(cpu)
    assert_engine_empty(gpu)
