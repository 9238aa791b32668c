"""The device sampler (engine/device_sampler.py) on CPU tensors: its masks equal the CPU sampler's kept sets,
temperature 0 is argmax, its tokens equal the one-row reference's, its draws follow the masked softmax (and
a wrong temperature or mask fails the same check), seeded rows are reproducible and independent of their
batch, and `sample_step` routes penalty/logprob rows to the CPU sampler unchanged."""
from __future__ import annotations

import pytest
import torch

from engine.device_sampler import (device_eligible, kept_tokens, pack_params, reference_sample, resolve,
                                   sample_eligible, sample_rows, sample_step)
from engine.errors import InvalidRequestError
from engine.sampler import SampleRequest, filter_min_p, filter_top_k_top_p, sample_batch
from engine.sampling_params import SamplingParams

torch.set_num_threads(1)
VOCAB = 96
PARAMS = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=0.8, top_p=0.9),
          dict(temperature=1.0, top_k=5), dict(temperature=1.3, min_p=0.1),
          dict(temperature=0.7, top_k=20, top_p=0.5, min_p=0.05), dict(temperature=1.0, top_k=VOCAB + 5),
          dict(temperature=0.5, top_k=-1), dict(temperature=1.0, top_p=1e-6), dict(temperature=2.0, top_k=1),
          dict(temperature=1.0, min_p=1.0), dict(temperature=0.9, top_p=0.99), dict(temperature=1.0, top_k=3, top_p=0.7)]


def req(seed=0, index=0, **params) -> SampleRequest:
    return SampleRequest(SamplingParams(**params), seed, index, [], [])


def rows(n: int, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def params_of(reqs) -> torch.Tensor:
    return torch.from_numpy(pack_params(reqs))


def test_masks_equal_the_cpu_samplers_kept_sets():
    x = rows(len(PARAMS), seed=1)
    reqs = [req(**p) for p in PARAMS]
    got = kept_tokens(x, params_of(reqs))
    for i, r in enumerate(reqs):
        p = r.params
        if p.greedy:
            continue
        y = x[i] / p.temperature
        y = filter_min_p(y, p.min_p) if p.min_p > 0 else y
        want = torch.isfinite(filter_top_k_top_p(y, p.top_k, p.top_p))
        assert torch.equal(got[i], want), (PARAMS[i], got[i].sum(), want.sum())
    assert got[3].sum() == 5 and got[9].sum() == 1 and got[10].sum() == 1 and got[8].sum() == 1
    assert got[6].all() and got[7].all() and got[1].all()  # top_k above the vocabulary / -1: off


def test_temperature_zero_is_argmax_and_tokens_equal_the_reference():
    x = rows(len(PARAMS), seed=2)
    for trial in range(40):
        reqs = [req(seed=97 * trial + i, index=trial, **p) for i, p in enumerate(PARAMS)]
        got = sample_eligible(x, reqs).tolist()
        assert got == [reference_sample(x[i], r) for i, r in enumerate(reqs)]
        assert got[0] == int(x[0].argmax())
        assert [got[i] for i in (8, 9, 10)] == [int(x[i].argmax()) for i in (8, 9, 10)]  # top_p 1e-6, k 1, min_p 1
    greedy = [req(temperature=0.0) for _ in range(6)]
    assert sample_eligible(rows(6, seed=3), greedy).tolist() == rows(6, seed=3).argmax(-1).tolist()


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    if (counts[~keep] > 0).any():
        return float("inf")  # a token outside the support
    exp = probs[keep] * counts.sum()
    return float(((counts[keep] - exp) ** 2 / exp).sum())


CASES = [dict(temperature=0.7), dict(temperature=1.0, top_k=3), dict(temperature=1.0, top_p=0.8),
         dict(temperature=1.5, min_p=0.2, top_p=0.9)]


@pytest.mark.parametrize("params", CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_draws_follow_the_masked_softmax_and_a_wrong_one_fails(params):
    logits = torch.tensor([1.0, 0.6, 0.2, 0.0, -0.3, -0.7, -1.2, -2.0])
    n = 6000
    reqs = [req(seed=s, index=s % 7, **params) for s in range(n)]
    tokens = sample_eligible(logits.repeat(n, 1), reqs)
    counts = torch.bincount(tokens, minlength=len(logits)).double()
    p = SamplingParams(**params)
    y = filter_min_p(logits / p.temperature, p.min_p) if p.min_p > 0 else logits / p.temperature
    want = filter_top_k_top_p(y, p.top_k, p.top_p).softmax(-1).double()
    dof = int((want > 0).sum()) - 1
    # P(chi2 > 5 * dof + 15) is below 1e-5 for dof <= 7 under the right law: loose, and it can still fail
    assert _chi_square(counts, want) < 5 * dof + 15, (counts, want * n)
    wrong_temp = filter_top_k_top_p(y * p.temperature / (2 * p.temperature), p.top_k, p.top_p).softmax(-1).double()
    assert _chi_square(counts, wrong_temp) > 3 * (5 * dof + 15)  # temperature doubled
    if p.top_k or p.top_p < 1 or p.min_p:
        unmasked = (logits / p.temperature).softmax(-1).double()
        assert _chi_square(counts, unmasked) > 3 * (5 * dof + 15)  # the mask left out
    if p.top_k or p.top_p < 1:  # a mask one token narrower: the draws hold a token outside it
        narrower = filter_top_k_top_p(y, p.top_k - 1 if p.top_k else 0, p.top_p - 0.12 if p.top_p < 1 else 1.0)
        assert _chi_square(counts, narrower.softmax(-1).double()) == float("inf")


def test_seeded_rows_are_reproducible_and_independent_of_their_batch():
    x = rows(len(PARAMS), seed=4, scale=0.5)  # flat-ish: the noise decides
    reqs = [req(seed=1000 + i, index=3, **p) for i, p in enumerate(PARAMS)]
    alone = [int(sample_eligible(x[i:i + 1], [r])[0]) for i, r in enumerate(reqs)]
    assert sample_eligible(x, reqs).tolist() == alone
    perm = torch.randperm(len(reqs), generator=torch.Generator().manual_seed(0)).tolist()
    assert sample_eligible(x[perm], [reqs[i] for i in perm]).tolist() == [alone[i] for i in perm]
    plain = [i for i, r in enumerate(reqs) if r.params.top_k <= 0 and r.params.top_p == 1 and not r.params.min_p]
    params = params_of([reqs[i] for i in plain])  # plain-temperature rows: the same with or without the sort
    assert sample_rows(x[plain], params, False).tolist() == sample_rows(x[plain], params, True).tolist()
    assert [alone[i] for i in plain] == sample_rows(x[plain], params, False).tolist()
    # a different output index draws anew: over 40 indices a flat row gives many distinct tokens
    flat = torch.zeros(40, VOCAB)
    drawn = sample_eligible(flat, [req(seed=5, index=i, temperature=1.0) for i in range(40)]).tolist()
    assert len(set(drawn)) >= 15


def test_sample_step_routes_penalty_and_logprob_rows_to_the_cpu_sampler():
    x = rows(6, seed=5, scale=0.5)
    reqs = [req(seed=1, temperature=0.8, top_p=0.9), req(seed=2, temperature=1.0, repetition_penalty=1.3),
            req(seed=3, temperature=0.0, logprobs=2), req(seed=4, temperature=0.0),
            req(seed=5, index=0, temperature=1.0, min_tokens=2, max_tokens=4), req(seed=6, temperature=0.7, top_k=4)]
    assert [device_eligible(r) for r in reqs] == [True, False, False, True, False, True]
    cpu = sample_batch(x, reqs)
    got = sample_step(x, reqs, "device")
    dev = sample_eligible(x[[0, 5]], [reqs[0], reqs[5]]).tolist()
    assert [got[0].token_id, got[5].token_id] == dev
    for i in (1, 2, 3, 4):  # the CPU sampler's own tokens (and logprobs) for the rest
        assert (got[i].token_id, got[i].logprob, got[i].top_logprobs) == \
            (cpu[i].token_id, cpu[i].logprob, cpu[i].top_logprobs)
    assert [t.token_id for t in sample_step(x, reqs, "cpu")] == [t.token_id for t in cpu]


def test_the_sampler_choice_is_checked_and_auto_means_device_on_cuda_only():
    assert resolve("auto", "cpu") == "cpu" and resolve("auto", "cuda:0") == "device"
    assert resolve("device", "cpu") == "device" and resolve("cpu", "cuda") == "cpu"
    with pytest.raises(InvalidRequestError, match="sampler"):
        resolve("gpu", "cpu")
    with pytest.raises(InvalidRequestError, match="top_p"):  # parameters keep their typed errors
        SamplingParams(temperature=0.8, top_p=0.0).validate(VOCAB)


def test_no_host_sync_inside_the_batched_pass(monkeypatch):
    """What a CUDA graph captures: no tensor method that copies device values to the host is called."""
    x, reqs = rows(len(PARAMS), seed=6), [req(seed=i, **p) for i, p in enumerate(PARAMS)]
    params = params_of(reqs)
    calls = []
    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _n=name, _r=real, **k: (calls.append(_n), _r(t, *a, **k))[1])
    for filtered in (True, False):
        sample_rows(x, params, filtered)
    torch.zeros(1).item()  # the spy sees a sync
    assert calls == ["item"], calls
