"""Verification is lossless: chi-square tests on a tiny model's real next-token distributions.

Setting: vocabulary of 8, one draft token d after a fixed prompt. The target law of the next two tokens
is P(x1, x2) = p0(x1) p1[x1](x2), with p0 the prediction after the prompt and p1[x] after prompt + x.
Each procedure below plays one verify step (and, when only one token came out, the next plain step) and
the counts of (x1, x2) over many trials are tested against P. The engine's procedure (keyed sampler per
row + `verify_greedy`) and Leviathan's `rejection_sample` (one-hot q and a stochastic q) pass; the
deliberately broken verifiers kept here (bonus token from the wrong row, residual not excluding the
proposal) must fail, so the test can fail.
"""
from __future__ import annotations

import pytest
import torch

from engine.sampler import SampleRequest, sample_one
from engine.sampling_params import SamplingParams
from engine.spec_decode.verify import accepted_length, rejection_sample, sample_from, verify_greedy
from tests.tiny_models import write_tiny

VOCAB = 8
TRIALS = 6000
PROMPT = [3, 5, 7, 4]


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """p0 [V] and p1 [V, V] (row x: after prompt + [x]) from a tiny random model, temperature 1."""
    from transformers import AutoModelForCausalLM

    d = write_tiny("llama", tmp_path_factory.mktemp("v8") / "llama", vocab_size=VOCAB, initializer_range=0.5,
                   seed=3)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    with torch.inference_mode():
        ids = torch.tensor([PROMPT + [x] for x in range(VOCAB)])
        logits = model(ids).logits.float()  # [V, len + 1, V]
    p0, p1 = logits[0, -2].softmax(-1), logits[:, -1].softmax(-1)
    assert 0.2 < float(p0.max()) < 0.9, "want a draft that is sometimes accepted, sometimes not"
    d = int(p0.argmax())
    assert float((p1[d] - p0).abs().sum()) > 0.3, "bonus row must differ from the first row"
    return p0, p1


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of counts against probs (cells with expectation < 5 pooled)."""
    n = float(counts.sum())
    exp, obs = probs.flatten() * n, counts.flatten().double()
    small = exp < 5
    exp = torch.cat([exp[~small], exp[small].sum().view(1)]) if small.any() else exp
    obs = torch.cat([obs[~small], obs[small].sum().view(1)]) if small.any() else obs
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def run(procedure, p0, p1) -> float:
    gen = torch.Generator().manual_seed(1234)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.long)
    for trial in range(TRIALS):
        x = procedure(trial, p0, p1, gen)
        if len(x) == 1:  # one token came out: the next (plain) step samples x2 given x1
            x.append(sample_from(p1[x[0]], gen))
        counts[x[0], x[1]] += 1
    joint = p0[:, None] * p1  # [V, V]
    return chi_square_pvalue(counts, joint.double())


# ---- procedures: the engine's, Leviathan's, and broken ones ----------------------------------------
def engine_keyed(trial, p0, p1, gen):
    """What SpecDecoder does: every row sampled by the keyed sampler (seed, output index), then the
    longest matching prefix plus one token."""
    d = int(p0.argmax())
    params = SamplingParams(temperature=1.0)
    rows = [p0.log(), p1[d].log()]
    targets = [sample_one(rows[j].clone(), SampleRequest(params, trial, j, PROMPT, [d][:j])).token_id for j in (0, 1)]
    out = verify_greedy([d], targets)
    if len(out) == 1:  # the plain step after a rejection draws output index 1 with the same keyed noise
        x1 = out[0]
        out.append(sample_one(p1[x1].log(), SampleRequest(params, trial, 1, PROMPT, [x1])).token_id)
    return out


def leviathan_one_hot(trial, p0, p1, gen):
    d = int(p0.argmax())
    return rejection_sample([d], torch.stack([p0, p1[d]]), None, gen)


def leviathan_stochastic(trial, p0, p1, gen):
    q = torch.linspace(1.0, 2.0, VOCAB).flip(0)
    q = q / q.sum()  # a proposal unlike p0
    d = sample_from(q, gen)
    return rejection_sample([d], torch.stack([p0, p1[d]]), q[None], gen)


def broken_bonus_from_wrong_row(trial, p0, p1, gen):
    """Bug: the bonus token is drawn from the last draft's row (p0) instead of the row after it."""
    d = int(p0.argmax())
    return rejection_sample([d], torch.stack([p0, p0]), None, gen)


def broken_residual(trial, p0, p1, gen):
    """Bug: after a rejection, resample from p instead of the residual max(0, p - q)."""
    d = int(p0.argmax())
    if float(torch.rand((), generator=gen)) < float(p0[d]):
        return [d, sample_from(p1[d], gen)]
    return [sample_from(p0, gen)]


def broken_keyed_residual(trial, p0, p1, gen):
    """Bug in the keyed form: on a mismatch emit a fresh draw of row 0 (it may be the rejected draft)."""
    out = engine_keyed(trial, p0, p1, gen)
    d = int(p0.argmax())
    if out[0] != d:
        out = [sample_from(p0, gen)]
    return out


@pytest.mark.parametrize("procedure", [engine_keyed, leviathan_one_hot, leviathan_stochastic])
def test_verifiers_follow_the_target_distribution(procedure, dists):
    p = run(procedure, *dists)
    assert p > 1e-3, f"{procedure.__name__}: chi-square p-value {p:.2e}"


@pytest.mark.parametrize("procedure", [broken_bonus_from_wrong_row, broken_residual, broken_keyed_residual])
def test_broken_verifiers_fail_the_same_test(procedure, dists):
    p = run(procedure, *dists)
    assert p < 1e-6, f"{procedure.__name__} passed the chi-square test (p = {p:.2e}): the test is too weak"


def test_greedy_verify_accepts_the_longest_matching_prefix_plus_one():
    assert verify_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus
    assert verify_greedy([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # correction at the first mismatch
    assert verify_greedy([5], [4, 1]) == [4]
    assert verify_greedy([], [3]) == [3]
    assert accepted_length([1, 2, 3], [1, 2, 0, 0]) == 2
    with pytest.raises(AssertionError):
        accepted_length([1, 2], [1, 2])  # the bonus row is missing
