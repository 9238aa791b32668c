"""The device sampler on CUDA (skipped without a GPU): its tokens equal the same math on CPU tensors, a
captured sampling graph equals the eager pass, and an engine on CUDA (sampler "auto" = device, CUDA-graph
decode) gives a seeded request the same tokens twice, alone and in a batch, with sampled steps overlapped
(only their ids come back)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.device_sampler import pack_params, sample_rows
from engine.kernels.cuda.graph_sampling import StaticSampler
from engine.sampler import SampleRequest
from tests.conftest import assert_engine_empty
from tests.tiny_models import write_tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

KINDS = [dict(temperature=0.8, top_p=0.95), dict(temperature=1.0), dict(temperature=0.7, top_k=50),
         dict(temperature=1.2, min_p=0.05, top_p=0.9), dict(temperature=0.0)]


def _reqs(n: int, index: int = 0) -> list[SampleRequest]:
    return [SampleRequest(SamplingParams(**KINDS[i % len(KINDS)]), 1000 + i, index, [], []) for i in range(n)]


def test_cuda_tokens_equal_the_cpu_pass():
    logits = torch.randn(256, 32000, generator=torch.Generator().manual_seed(0)) * 3
    reqs = _reqs(256)
    params = torch.from_numpy(pack_params(reqs))
    want = sample_rows(logits, params, True)
    got = sample_rows(logits.cuda(), params.cuda(), True).cpu()
    assert int((got != want).sum()) <= 1  # a boundary within float rounding may move, at most once here


def test_captured_sampling_graph_equals_the_eager_pass():
    rows = 64
    logits = (torch.randn(rows, 49152, device="cuda") * 3).contiguous()
    s = StaticSampler(rows, torch.device("cuda"), pin=True)
    s.capture(logits, None)
    for index in range(3):
        reqs = _reqs(rows - 3, index)
        s.fill(reqs)
        s.upload()
        for filtered in (True, False):
            got = s.run(logits, filtered).clone()
            want = sample_rows(logits, s.dev, filtered)
            assert torch.equal(got, want)


@pytest.fixture(scope="module")
def gqa(tmp_path_factory):
    return write_tiny("llama", tmp_path_factory.mktemp("s") / "m", num_attention_heads=8, num_key_value_heads=2,
                      initializer_range=0.1)


def test_engine_seeded_sampling_on_cuda_graphs(gqa):
    llm = LLM(model=str(gqa), dtype="float32", device="cuda", num_pages=256, max_num_batched_tokens=256,
              max_num_seqs=8, max_model_len=256)
    assert llm.runner.sampler == "device" and llm.decode_graphs.use_graphs
    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (12, 40, 7, 90)]
    overlapped = []
    real = llm.decode_graphs.launch
    llm.decode_graphs.launch = lambda b: (lambda p: (overlapped.append(p.overlaps), p)[1])(real(b))
    first = llm.generate(prompts[0], seeded)[0].token_ids
    assert llm.generate(prompts[0], seeded)[0].token_ids == first
    assert overlapped and all(overlapped)
    others = [SamplingParams(max_tokens=20, temperature=1.0, top_k=20, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.9, repetition_penalty=1.1, seed=5, ignore_eos=True)]
    batch = llm.generate(prompts, [seeded] + others)
    assert batch[0].token_ids == first
    assert_engine_empty(llm)
