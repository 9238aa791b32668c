"""A Hub id served on CUDA (issue 22, skipped without a GPU): SmolLM2 laid out as a Hub cache and loaded by
its id offline gives the bundled name's greedy tokens on the GPU, in bfloat16 as served, and frees its pages."""
from __future__ import annotations

import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.loader import resolve_model
from tests.conftest import assert_engine_empty
from tests.hub_cache import hub_env, lay_out
from tests.prompts import token_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_hub_id_on_cuda_equals_bundled_name(tmp_path, monkeypatch):
    lay_out(tmp_path / "hf", REPO, resolve_model("smollm2-135m"))
    hub_env(monkeypatch, tmp_path / "hf")
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    bundled = LLM(dtype="bfloat16", device="cuda", num_pages=1024, max_num_batched_tokens=2048)
    prompts = token_prompts(bundled.tokenizer, [16, 200, 700] * 4)
    want = [o.token_ids for o in bundled.generate(prompts, params)]
    by_id = LLM(model=REPO, dtype="bfloat16", device="cuda", num_pages=1024, max_num_batched_tokens=2048)
    assert by_id.model_dir != bundled.model_dir  # the snapshot folder, not the bundled conversion
    by_id.generate(prompts[:1], params)  # warm-up
    torch.cuda.synchronize()
    t = time.perf_counter()
    got = [o.token_ids for o in by_id.generate(prompts, params)]
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    assert got == want
    print(f"\n{REPO} on {torch.cuda.get_device_name()}: {len(prompts)} requests x 64 tokens in {dt:.2f} s "
          f"= {len(prompts) * 64 / dt:.0f} output tokens/s (bfloat16, greedy)")
    assert_engine_empty(bundled)
    assert_engine_empty(by_id)
