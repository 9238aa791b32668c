"""The engine with the device sampler selected (`LLM(sampler="device")`, what "auto" means on CUDA), on CPU
tensors: a seeded request samples the same tokens run after run and alone or in a mixed batch; the CPU
default is unchanged; in the static decode step (the code CUDA graphs capture, run eagerly) sampled rows take
the overlapped path (only their ids come back, one step later) with the eager engine's tokens."""
from __future__ import annotations

import pytest
import torch

import engine.device_sampler as device_sampler
from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from tests.conftest import assert_engine_empty
from tests.tiny_models import write_tiny

SEEDED = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
OTHERS = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=5, temperature=1.0, top_k=8, seed=3, ignore_eos=True),
          SamplingParams(max_tokens=7, temperature=0.9, repetition_penalty=1.2, seed=5, ignore_eos=True),
          SamplingParams(max_tokens=4, temperature=0.7, seed=11, logprobs=1, ignore_eos=True)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny("llama", tmp_path_factory.mktemp("devsample") / "m", num_attention_heads=8,
                      num_key_value_heads=2, initializer_range=0.1)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (k,), generator=g).tolist() for k in (9, 21, 5, 14, 30)[:n]]


def _engine(model_dir, **kw) -> LLM:
    kw = {"max_num_seqs": 8, **kw}
    return LLM(model=str(model_dir), dtype="float32", num_pages=96, max_num_batched_tokens=64, max_model_len=128,
               **kw)


def _counting(monkeypatch) -> list[int]:
    calls = []
    real = device_sampler.sample_rows

    def spy(logits, params, filtered):
        calls.append(logits.shape[0])
        return real(logits, params, filtered)
    monkeypatch.setattr(device_sampler, "sample_rows", spy)
    return calls


def test_seeded_request_alone_twice_and_in_a_mixed_batch(model_dir, monkeypatch):
    llm = _engine(model_dir, sampler="device")
    assert llm.runner.sampler == "device" and llm.decode_graphs is None  # CPU: the eager runner
    calls = _counting(monkeypatch)
    prompt = _prompts(1)[0]
    first = llm.generate([prompt], SEEDED)[0].token_ids
    assert calls and len(first) == SEEDED.max_tokens
    assert llm.generate([prompt], SEEDED)[0].token_ids == first
    batch = llm.generate([_prompts(5)[1], prompt] + _prompts(5)[2:], [OTHERS[0], SEEDED] + OTHERS[1:])
    assert batch[1].token_ids == first
    assert [len(o.token_ids) for o in batch] == [6, 8, 5, 7, 4]
    assert len(batch[4].logprobs) == 4 and all(t.logprob is not None for t in batch[4].logprobs)  # the CPU's
    assert_engine_empty(llm)
    cpu = _engine(model_dir)  # the CPU default: the CPU sampler's own tokens, not these
    assert cpu.runner.sampler == "cpu"
    n = len(calls)
    assert cpu.generate([prompt], SEEDED)[0].token_ids != first and len(calls) == n


def test_draft_verify_with_the_device_sampler_is_lossless(model_dir):
    """Verify draws each row with the engine's sampler: drafts of the device-sampled continuation (oracle)
    and always-wrong drafts both give exactly the plain device-sampled tokens."""
    prompts = _prompts(3)
    params = [SamplingParams(**dict(vars(SEEDED), seed=40 + i, top_k=12 * i)) for i in range(3)]
    plain = [o.token_ids for o in _engine(model_dir, sampler="device").generate(prompts, params)]
    futures = {tuple(p): o for p, o in zip(prompts, plain)}
    for name in ("oracle", "always_wrong"):
        spec = dict(proposer=name, max_draft=3, gate=False, proposer_options={"futures": futures})
        llm = _engine(model_dir, sampler="device", speculative=spec)
        assert [o.token_ids for o in llm.generate(prompts, params)] == plain
        assert llm.spec.stats.num_verifies > 0 and (llm.spec.stats.num_accepted > 0) == (name == "oracle")
        assert_engine_empty(llm)


def test_bad_sampler_name_is_a_typed_error(model_dir):
    with pytest.raises(InvalidRequestError, match="sampler"):
        _engine(model_dir, sampler="gpu")


def test_static_step_samples_on_the_device_and_overlaps(model_dir, monkeypatch):
    pytest.importorskip("triton")
    # sampled (top-p), sampled (top-k), greedy: device-eligible; a penalty row (the CPU's) done after 2 tokens
    params = [SamplingParams(**dict(vars(p), max_tokens=n)) for p, n in zip((SEEDED, *OTHERS[1::-1], OTHERS[2]),
                                                                           (5, 5, 5, 2))]
    prompts = _prompts(4)
    monkeypatch.setenv("PDSERVE_ATTENTION", "torch")  # the reference: eager SDPA (float32: the same logits up to
    want = [o.token_ids for o in _engine(model_dir, sampler="device").generate(prompts, params)]  # rounding)
    monkeypatch.setenv("PDSERVE_ATTENTION", "triton")
    llm = _engine(model_dir, sampler="device", decode_graphs="static", max_num_seqs=4)
    graphs = llm.decode_graphs
    assert graphs.sampler == "device" and graphs.buckets[1, 1].sampler is not None
    overlapped = []
    real = graphs.launch
    graphs.launch = lambda batch: (lambda pending: (overlapped.append(pending.overlaps), pending)[1])(real(batch))
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    # with the penalty row in the batch the step samples from the logits (not overlapped); once it is done,
    # the rest come back as their ids only, one step later
    assert overlapped[0] is False and overlapped[-2:] == [True, True], overlapped
    assert_engine_empty(llm)
