"""How much to speculate: per-request adaptive draft length, the load-aware gate, and the statistics.

Called by `SpecDecoder` (step.py) every step, pure Python:
  `AcceptanceTracker` (one per request) keeps an exponential average `alpha` of per-position acceptance;
      `draft_len(cap)` drafts position j only while alpha^j >= min_accept (SpecDec++'s stopping idea with
      a geometric acceptance model); a request that stopped drafting probes with one token now and then.
  `CostModel` fits step seconds = a + b x tokens (decayed least squares over measured forward times; with
      too little spread in the token counts, b comes from a prior ratio to a).
  `choose_cap` (SmartSpec's goodput idea): expected tokens/s of the batch with every draft cut to K, for
      K = 0 .. max, against plain decoding; the best K, 0 when speculating does not pay.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class AcceptanceTracker:
    alpha: float = 0.6  # prior per-position acceptance
    beta: float = 0.2  # weight of each new observation
    idle_steps: int = 0  # steps without a draft (probe after `probe_every`)

    def draft_len(self, cap: int, min_accept: float, probe_every: int = 8) -> int:
        k, a = 0, self.alpha
        while k < cap and a >= min_accept:
            k += 1
            a *= self.alpha
        if k == 0 and cap > 0:
            self.idle_steps += 1
            if self.idle_steps >= probe_every:
                self.idle_steps = 0
                return 1
        return k

    def update(self, drafted: int, accepted: int) -> None:
        for _ in range(accepted):
            self.alpha += self.beta * (1.0 - self.alpha)
        if accepted < drafted:
            self.alpha -= self.beta * self.alpha


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify of k drafts emits on average: 1 + alpha + ... + alpha^k."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


class CostModel:
    def __init__(self, decay: float = 0.97, prior_tokens_per_intercept: float = 32.0):
        self.decay = decay
        self.prior = prior_tokens_per_intercept  # without spread: b = a / prior (memory-bound decode)
        self._s = [0.0] * 5  # decayed sums of w, n, n^2, t, n t

    def observe(self, num_tokens: int, seconds: float) -> None:
        n, t = float(num_tokens), float(seconds)
        self._s = [x * self.decay for x in self._s]
        for i, v in enumerate((1.0, n, n * n, t, n * t)):
            self._s[i] += v

    def fit(self) -> tuple[float, float]:
        w, sn, snn, st, snt = self._s
        if w <= 0:
            return 1.0, 1.0 / self.prior  # unitless: only ratios matter before the first measurement
        mn, mt = sn / w, st / w
        var = snn / w - mn * mn
        if var >= 1.0:
            b = max(0.0, (snt / w - mn * mt) / var)
            a = mt - b * mn
            if a > 0:
                return a, b
        a = mt / (1.0 + mn / self.prior)
        return a, a / self.prior

    def predict(self, num_tokens: int) -> float:
        a, b = self.fit()
        return a + b * num_tokens


def choose_cap(cost: CostModel, base_tokens: int, drafts: list[int], alphas: list[float],
               margin: float, draft_cost_per_token: float = 0.0) -> tuple[int, float]:
    """Best cap K on draft lengths for this batch (0: do not speculate) and its estimated cost ratio
    t(with drafts) / t(plain). base_tokens: tokens of the step without drafts; drafts/alphas: per drafted
    request (each emits 1 token without drafts)."""
    if not drafts:
        return 0, 1.0
    t_plain = cost.predict(base_tokens)
    plain_rate = len(drafts) / t_plain
    best, best_rate, best_ratio = 0, plain_rate * (1.0 + margin), 1.0
    for cap in range(1, max(drafts) + 1):
        ks = [min(k, cap) for k in drafts]
        extra = sum(ks)
        t = cost.predict(base_tokens + extra) + draft_cost_per_token * extra
        rate = sum(expected_tokens(a, k) for a, k in zip(alphas, ks)) / t
        if rate > best_rate:
            best, best_rate, best_ratio = cap, rate, t / t_plain
    return best, best_ratio


@dataclass
class SpecStats:
    num_steps: int = 0  # steps with at least one request that could draft
    num_spec_steps: int = 0  # of those, steps that verified drafts
    num_gated: int = 0  # steps the gate turned to plain decoding although drafts existed
    num_verifies: int = 0  # one request's draft verified once
    num_drafted: int = 0
    num_accepted: int = 0
    num_emitted: int = 0  # tokens the verifies produced (accepted + 1 each, before stops)
    verify_cost_ratio: float = 1.0  # last estimate t(step with drafts) / t(step without), from the cost model

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def tokens_per_verify(self) -> float:
        return self.num_emitted / self.num_verifies if self.num_verifies else 0.0

    @property
    def spec_share(self) -> float:
        return self.num_spec_steps / self.num_steps if self.num_steps else 0.0

    def as_dict(self) -> dict[str, float]:
        return dict(asdict(self), acceptance_rate=self.acceptance_rate, tokens_per_verify=self.tokens_per_verify,
                    spec_share=self.spec_share)
