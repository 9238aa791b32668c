"""Sampler: keyed randomness, greedy/top-k/top-p/min-p, min_tokens masking, temperature statistics,
penalties, logprobs; and `SamplingParams.validate` naming the bad field."""
from __future__ import annotations

import math

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sampler import SampleRequest, apply_penalties, noise_key, sample_batch, sample_one
from engine.sampling_params import SamplingParams

torch.set_num_threads(1)
VOCAB = 64


def req(seed=0, index=0, prompt=(), output=(), eos=(), **params) -> SampleRequest:
    return SampleRequest(SamplingParams(**params), seed, index, list(prompt), list(output), eos)


def rand_logits(n: int, vocab: int = VOCAB, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * scale


# ---- keyed randomness --------------------------------------------------------------------------
def test_same_seed_and_index_sample_the_same_token_in_any_batch():
    rows = rand_logits(5, scale=0.3)  # flat-ish: many tokens are plausible
    reqs = [req(seed=s, index=i, temperature=1.0) for s, i in [(1, 0), (2, 7), (3, 3), (1, 1), (9, 0)]]
    alone = [sample_one(rows[i], r).token_id for i, r in enumerate(reqs)]
    together = [t.token_id for t in sample_batch(rows, reqs)]
    assert together == alone
    perm = [3, 0, 4, 2, 1]
    shuffled = [t.token_id for t in sample_batch(rows[perm], [reqs[i] for i in perm])]
    assert shuffled == [alone[i] for i in perm]
    # Mixed with greedy, penalised and logprob rows, sampled rows still get the same tokens.
    extra_rows = rand_logits(3, seed=5)
    extra = [req(temperature=0.0), req(temperature=0.0, logprobs=2), req(seed=4, repetition_penalty=1.3,
                                                                         output=[1, 2])]
    mixed = sample_batch(torch.cat([extra_rows, rows]), extra + reqs)
    assert [t.token_id for t in mixed[3:]] == alone


def test_same_key_is_reproducible_and_noise_depends_on_index_and_seed():
    row = torch.zeros(VOCAB)  # uniform: the token is decided by the noise alone
    by_index = [sample_one(row, req(seed=123, index=i)).token_id for i in range(40)]
    again = [sample_one(row.clone(), req(seed=123, index=i)).token_id for i in range(40)]
    assert by_index == again
    assert len(set(by_index)) >= 15  # about 30 distinct expected from 40 draws over 64 tokens
    by_seed = [sample_one(row, req(seed=s, index=0)).token_id for s in range(40)]
    assert len(set(by_seed)) >= 15
    keys = {noise_key(s, i) for s in range(20) for i in range(20)}
    assert len(keys) == 400 and all(0 <= k < 2 ** 63 for k in keys)


# ---- greedy, top-k, top-p ----------------------------------------------------------------------
def test_greedy_is_argmax():
    rows = rand_logits(16, seed=1)
    expected = rows.argmax(-1).tolist()
    assert [t.token_id for t in sample_batch(rows, [req(temperature=0.0) for _ in range(16)])] == expected
    # the non-batched path (logprobs asked) agrees
    assert [sample_one(rows[i], req(temperature=0.0, logprobs=0)).token_id for i in range(16)] == expected


def test_top_k_one_equals_greedy():
    rows = rand_logits(32, seed=2, scale=0.5)
    for i in range(32):
        assert sample_one(rows[i], req(seed=i, index=i, top_k=1)).token_id == int(rows[i].argmax())


def test_tiny_top_p_keeps_only_the_top_token():
    rows = rand_logits(32, seed=3, scale=0.5)
    for i in range(32):
        assert sample_one(rows[i], req(seed=i, index=i, top_p=1e-6)).token_id == int(rows[i].argmax())


def test_top_k_samples_only_from_the_k_largest():
    row = rand_logits(1, seed=4, scale=0.2)[0]
    top = set(torch.topk(row, 5).indices.tolist())
    got = {sample_one(row, req(seed=7, index=i, top_k=5)).token_id for i in range(300)}
    assert got == top  # never outside, and (300 draws, near-flat logits) every one of the five shows up


def test_top_p_samples_only_from_the_nucleus():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    # smallest prefix of the sorted distribution whose mass reaches 0.6: tokens 0 and 1 (0.7)
    got = [sample_one(logits, req(seed=11, index=i, top_p=0.6)).token_id for i in range(400)]
    assert set(got) == {0, 1}
    frac0 = got.count(0) / len(got)
    assert abs(frac0 - 0.4 / 0.7) < 0.08  # renormalised within the nucleus


def test_min_p_keeps_tokens_above_min_p_times_the_top_probability_after_temperature():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    got = [sample_one(logits, req(seed=5, index=i, min_p=0.3)).token_id for i in range(400)]
    assert set(got) == {0, 1, 2}  # threshold 0.3 x 0.4 = 0.12
    assert abs(got.count(0) / len(got) - 0.4 / 0.85) < 0.08  # renormalised among the kept
    # as vLLM, min-p sees the tempered distribution: at temperature 2 the probabilities are ~ sqrt(p), so
    # 0.55 x max keeps three tokens (0.55 x 0.4 on the raw ones would keep two)
    got = {sample_one(logits, req(seed=6, index=i, temperature=2.0, min_p=0.55)).token_id for i in range(400)}
    assert got == {0, 1, 2}
    rows = rand_logits(32, seed=9, scale=0.3)
    assert [sample_one(rows[i], req(seed=i, index=i, min_p=1.0)).token_id for i in range(32)] == \
        rows.argmax(-1).tolist()  # min_p = 1 keeps only the top token


def test_min_tokens_masks_eos_and_stop_ids_below_the_count():
    row = torch.zeros(VOCAB)
    row[5], row[7], row[9] = 9.0, 8.0, 7.0  # EOS 5 is the argmax, stop id 7 second
    kw = dict(temperature=0.0, min_tokens=3, stop_token_ids=[7], eos=(5,))
    got = [sample_one(row, req(index=i, **kw)).token_id for i in range(5)]
    assert got == [9, 9, 9, 5, 5]
    assert [t.token_id for t in sample_batch(row.repeat(5, 1), [req(index=i, **kw) for i in range(5)])] == got
    assert sample_one(row, req(index=0, **dict(kw, ignore_eos=True))).token_id == 9  # EOS masked anyway (vLLM)
    assert sample_one(row, req(index=0, temperature=0.0, min_tokens=3, eos=(5,))).token_id == 7  # only EOS masked
    sampled = {sample_one(row, req(seed=s, index=2, **dict(kw, temperature=1.0))).token_id for s in range(300)}
    assert 5 not in sampled and 7 not in sampled and 9 in sampled
    assert 5 in {sample_one(row, req(seed=s, index=3, **dict(kw, temperature=1.0))).token_id for s in range(50)}


# ---- temperature statistics --------------------------------------------------------------------
def _chi_square(counts: list[int], probs: torch.Tensor) -> float:
    n = sum(counts)
    return sum((c - n * float(p)) ** 2 / (n * float(p)) for c, p in zip(counts, probs))


def test_temperature_sampling_matches_softmax_frequencies():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0])
    t, n = 0.7, 4000
    counts = [0] * 5
    for i in range(n):
        counts[sample_one(logits, req(seed=2024, index=i, temperature=t)).token_id] += 1
    chi2 = _chi_square(counts, torch.softmax(logits / t, -1))
    # 4 degrees of freedom: P(chi2 > 25) ~ 5e-5 for a correct sampler; loose but it can fail.
    assert chi2 < 25, (counts, chi2)
    # Power check: the same draws are far from what temperature 1 (or 0.35) would give.
    assert _chi_square(counts, torch.softmax(logits, -1)) > 60
    assert _chi_square(counts, torch.softmax(logits / 0.35, -1)) > 60


# ---- penalties ---------------------------------------------------------------------------------
def test_penalty_arithmetic_matches_hand_computation():
    logits = torch.tensor([1.0, 2.0, -1.0, 0.5, 3.0, -2.0])
    r = req(prompt=[1, 2], output=[2, 4, 4], repetition_penalty=2.0, presence_penalty=0.5,
            frequency_penalty=0.25)
    got = apply_penalties(logits.clone(), r)
    # repetition (HF style) over prompt + output tokens {1, 2, 4}: positive / 2, negative * 2
    # then OpenAI style over output tokens: - 0.25 * count - 0.5 * (count > 0)
    expected = torch.tensor([
        1.0,                       # token 0: untouched
        2.0 / 2,                   # token 1: prompt only -> repetition only
        -1.0 * 2 - 0.25 * 1 - 0.5,  # token 2: prompt and output once
        0.5,                       # token 3: untouched
        3.0 / 2 - 0.25 * 2 - 0.5,  # token 4: output twice
        -2.0,                      # token 5: untouched
    ])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_presence_and_frequency_ignore_prompt_tokens():
    logits = torch.zeros(4)
    got = apply_penalties(logits.clone(), req(prompt=[0, 1], output=[], presence_penalty=1.0,
                                              frequency_penalty=1.0))
    assert got.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_penalties_change_greedy_choice_and_leave_input_untouched():
    logits = torch.tensor([0.0, 3.0, 2.5, 1.0])
    before = logits.clone()
    assert sample_one(logits, req(temperature=0.0, output=[1], frequency_penalty=1.0)).token_id == 2
    assert sample_one(logits, req(temperature=0.0, prompt=[1], repetition_penalty=1.5)).token_id == 2
    assert sample_batch(logits[None], [req(temperature=0.0, output=[1], presence_penalty=1.0)])[0].token_id == 2
    assert torch.equal(logits, before)


# ---- logprobs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [
    dict(temperature=0.0), dict(temperature=0.8, top_k=5), dict(temperature=1.3, top_p=0.5),
    dict(temperature=0.7, repetition_penalty=1.5, frequency_penalty=0.5),
])
def test_logprobs_are_log_softmax_of_raw_logits(params):
    rows = rand_logits(4, seed=8, scale=2.0)
    for i in range(4):
        r = req(seed=i, index=i, prompt=[1, 2, 3], output=[4, 4], logprobs=3, **params)
        t = sample_one(rows[i], r)
        lp = torch.log_softmax(rows[i].double(), -1)
        assert math.isclose(t.logprob, float(lp[t.token_id]), abs_tol=1e-5)
        top = sorted(range(VOCAB), key=lambda j: -float(lp[j]))[:3]
        assert [j for j, _ in t.top_logprobs] == top
        for j, v in t.top_logprobs:
            assert math.isclose(v, float(lp[j]), abs_tol=1e-5)


def test_logprobs_zero_returns_chosen_only_and_none_returns_nothing():
    row = rand_logits(1, seed=9)[0]
    t = sample_one(row, req(temperature=0.0, logprobs=0))
    assert t.top_logprobs == [] and t.logprob is not None
    u = sample_batch(row[None], [req(temperature=0.0)])[0]
    assert u.logprob is None and u.top_logprobs is None and u.token_id == t.token_id


# ---- SamplingParams.validate ------------------------------------------------------------------
@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 1.5), ("max_tokens", True), ("max_tokens", "8"),
    ("temperature", float("nan")), ("temperature", -0.1), ("temperature", float("inf")),
    ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.2), ("top_p", float("nan")),
    ("top_k", -2), ("top_k", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", float("nan")),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1), ("presence_penalty", float("inf")),
    ("frequency_penalty", 3.0), ("frequency_penalty", float("nan")),
    ("stop", [""]), ("stop", [1]), ("stop", ["ok", None]),
    ("stop_token_ids", [VOCAB]), ("stop_token_ids", [-1]), ("stop_token_ids", ["2"]),
    ("logprobs", 21), ("logprobs", -1), ("logprobs", 1.0),
    ("seed", -1), ("seed", 1.5),
    ("min_tokens", -1), ("min_tokens", 1.5), ("min_tokens", True), ("min_tokens", 17),  # (max_tokens is 16)
    ("min_p", -0.1), ("min_p", 1.5), ("min_p", float("nan")), ("min_p", "0.1"),
])
def test_validate_names_the_bad_field(field, value):
    p = SamplingParams(**{field: value})
    with pytest.raises(InvalidRequestError) as e:
        p.validate(VOCAB)
    assert e.value.field == field
    assert isinstance(e.value, ValueError) and field in str(e.value)


@pytest.mark.parametrize("kw", [
    dict(), dict(temperature=0.0), dict(top_p=1.0), dict(top_p=1e-9), dict(top_k=-1), dict(top_k=0),
    dict(top_k=VOCAB * 10), dict(presence_penalty=-2.0, frequency_penalty=2.0), dict(max_tokens=1),
    dict(stop=["\n", "###"], stop_token_ids=[0, VOCAB - 1]), dict(logprobs=0), dict(logprobs=20),
    dict(seed=0), dict(seed=2 ** 63 - 1), dict(repetition_penalty=0.5),
    dict(min_tokens=16), dict(min_tokens=0), dict(min_p=0.0), dict(min_p=1.0), dict(min_p=0),
])
def test_validate_accepts_valid_params(kw):
    SamplingParams(**kw).validate(VOCAB)


def test_stop_given_as_a_bare_string_is_rejected_or_kept_whole():
    # OpenAI's API allows "stop": "END". Iterated as a list it would become the stop strings "E", "N", "D".
    p = SamplingParams(stop="END")
    try:
        p.validate(VOCAB)
    except InvalidRequestError as e:
        assert e.field == "stop"
        return
    assert list(p.stop) == ["END"], f"stop={p.stop!r} is used as the stop strings {list(p.stop)}"


def test_stop_prefix_hold_back_length():
    from engine.outputs import _stop_prefix_len

    stops = ["END", "xy"]
    assert _stop_prefix_len("abc EN", stops) == 2
    assert _stop_prefix_len("abc E", stops) == 1
    assert _stop_prefix_len("abc x", stops) == 1
    assert _stop_prefix_len("abc ENx", stops) == 1
    assert _stop_prefix_len("abc", stops) == 0
    assert _stop_prefix_len("", stops) == 0
    assert _stop_prefix_len("abc END", stops) == 0  # a whole stop is cut by the processor, not held
