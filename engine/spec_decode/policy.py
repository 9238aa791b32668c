"""How much to speculate: per-request adaptive draft length, the load-aware gate, and the statistics.

Called by `SpecDecoder` (step.py) every step, pure Python:
  `AcceptanceTracker` (one per request) keeps an exponential average `alpha` of per-position acceptance;
      `draft_len(cap)` asks the proposer for position j only while alpha^j >= min_accept (SpecDec++'s
      stopping idea with a geometric acceptance model), and always for one token: whether even that one
      pays is the gate's call, which knows the load.
  `CostModel` fits step seconds = a + b x tokens (decayed least squares over measured plain decode steps,
      where tokens = rows; with too little spread in the token counts, b comes from a prior ratio to a).
  `VerifyScale` learns what a verified draft token costs in units of b from measured drafted steps: a
      row's cost holds its whole-context attention, a draft token's only its query, but each distinct
      draft length adds an attention group per layer; the ratio is measured, not assumed.
  `choose_lengths` (SmartSpec's goodput idea): per request, how many of its drafts to verify so that the
      batch's expected tokens/s is highest; none when that does not beat plain decoding. While requests
      wait, a finished one's slot is refilled at once and every row carries 1/n of a step's fixed cost;
      when none wait, the batch drains (`drain_lengths`): finishing a request early saves its later
      rows, and a share of a whole later step only for a request on the critical path, so drafts of
      the others must pay for themselves in rows.
  `critical_shares`: which requests are on the critical path and what share of a step's fixed cost
      one of their accepted tokens saves: those that, decoding plainly from now on, would still run
      when the longest one finishes at its speculative pace -- not only those within one draft of the
      longest (a request that speculated ahead is not done: stopping its drafts makes it the laggard).
"""
from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass


@dataclass
class AcceptanceTracker:
    alpha: float = 0.6  # prior per-position acceptance
    beta: float = 0.2  # weight of each new observation

    def draft_len(self, cap: int, min_accept: float) -> int:
        k, a = 1, self.alpha * self.alpha
        while k < cap and a >= min_accept:
            k += 1
            a *= self.alpha
        return min(k, cap)

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

    @property
    def weight(self) -> float:
        """Decayed count of observed steps (0: the fit is the unitless prior)."""
        return self._s[0]

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


class VerifyScale:
    """Seconds per verified draft token, as a multiple of the plain model's slope b: a decayed mean of
    (measured drafted step - predicted plain step) / (b x draft tokens), starting from the prior 1 (a
    draft token costs a row). While the gate keeps refusing, no drafted step measures it, so each
    refusal pulls it back toward the prior a little: a high reading taken under a past load is retried."""

    def __init__(self, prior: float = 1.0, weight: float = 0.15, relax: float = 0.02, cap: float = 8.0):
        self.prior, self.weight, self.relax, self.cap = prior, weight, relax, cap
        self.value = prior

    def observe(self, step_seconds: float, plain_seconds: float, slope: float, draft_tokens: int) -> None:
        if draft_tokens <= 0 or slope <= 0:
            return
        ratio = min(max((step_seconds - plain_seconds) / (slope * draft_tokens), 0.0), self.cap)
        self.value += self.weight * (ratio - self.value)

    def refused(self) -> None:
        self.value += self.relax * (self.prior - self.value)


def choose_lengths(cost: CostModel, base_tokens: int, drafts: list[int], alphas: list[float],
                   margin: float, draft_cost_per_token: float = 0.0,
                   rows: int | None = None, verify_scale: float = 1.0,
                   fixed_share: list[float] | None = None) -> tuple[list[int], float]:
    """Draft tokens to verify per request (all 0: do not speculate) and the estimated cost ratio
    t(step with them) / t(plain step) (when refused: with every available draft). base_tokens: tokens of the step without drafts; drafts: the
    available draft length per drafting request (each emits 1 token without drafts); alphas: their
    acceptance estimates. The j-th draft of request i adds alpha_i^j expected tokens and costs one more
    token of forward (the cost model's slope) plus proposer time; with a linear cost, taking drafts in
    order of decreasing gain while the batch's tokens/s still rises maximizes it (SmartSpec's goodput).
    verify_scale: a draft token's forward cost in units of the plain slope (`VerifyScale`).
    rows: tokens the whole step emits without drafts (every sampled row, drafting or not; default: one
    per drafting request). The baseline is the batch's rate, not the drafting requests' share of it: with
    k drafters among n rows, counting only those would credit a draft a/k of the step's fixed cost a, not a/n.
    fixed_share: None while a finished request's slot is refilled at once (requests wait): then a step's
    fixed cost a is spread over its rows, as above. Otherwise, per drafting request, the share of a that
    one of its accepted tokens saves (`drain_lengths`)."""
    t_plain = cost.predict(base_tokens)
    lens = [0] * len(drafts)
    if not drafts:
        return lens, 1.0
    slope = cost.predict(base_tokens + 1) - t_plain
    step = slope * verify_scale + draft_cost_per_token  # one more draft token
    if fixed_share is not None:
        a = max(t_plain - slope * base_tokens, 0.0)
        return drain_lengths(t_plain, step, drafts, alphas, [slope + a * f for f in fixed_share], margin)
    n_rows = len(drafts) if rows is None else max(rows, 1)
    tokens, t = float(n_rows), t_plain
    heap = [(-al, i) for i, al in enumerate(alphas) if drafts[i] > 0]
    heapq.heapify(heap)
    while heap:
        neg_gain, i = heapq.heappop(heap)
        gain = -neg_gain
        if (tokens + gain) / (t + step) <= tokens / t:
            break  # gains only fall from here
        tokens, t = tokens + gain, t + step
        lens[i] += 1
        if lens[i] < drafts[i]:
            heapq.heappush(heap, (-gain * alphas[i], i))
    if tokens / t <= (n_rows / t_plain) * (1.0 + margin):  # refused: report what all drafts would cost
        full = sum(drafts)
        return [0] * len(drafts), (t_plain + step * full) / t_plain
    return lens, t / t_plain


def drain_lengths(t_plain: float, step: float, drafts: list[int], alphas: list[float], worth: list[float],
                  margin: float) -> tuple[list[int], float]:
    """Draft lengths when no request waits for a slot: an accepted token of request i saves worth[i]
    seconds (its row in a later step, plus whatever share of a later step's fixed cost it removes: only
    a request on the batch's critical path shortens the run) and each draft token costs `step`. Drafts
    are taken while alpha^j x worth > step; speculate only if the saving beats margin x the step."""
    lens, saved, heap = [0] * len(drafts), 0.0, [(-al * worth[i], i) for i, al in enumerate(alphas) if drafts[i] > 0]
    heapq.heapify(heap)
    while heap and -heap[0][0] > step:
        neg, i = heapq.heappop(heap)
        saved += -neg - step
        lens[i] += 1
        if lens[i] < drafts[i]:
            heapq.heappush(heap, (neg * alphas[i], i))
    spent = step * sum(lens)
    if saved <= margin * (t_plain + spent):
        return [0] * len(drafts), (t_plain + step * sum(drafts)) / t_plain
    return lens, (t_plain + spent) / t_plain


def critical_shares(left: dict[str, int], drafting: list[str], top_rate: float, slack: int) -> list[float]:
    """Per drafting request, the share of a step's fixed cost that one of its accepted tokens saves while
    the batch drains. left: every running request's token budget left; top_rate: the expected tokens per
    step of the request with the most left (1.0 when it does not speculate); slack: a draft's length.

    The run lasts as long as its longest request, about top / top_rate more steps. A request with fewer
    tokens left than that finishes first even decoding plainly: its tokens save only its rows (share 0).
    The others (the critical set) each end the run with about equal chance, so an accepted token of
    one of them is worth 1/len(critical) of a step -- whether or not the others draft this step (they
    catch up in the next ones). Why not "only when every critical request drafts": a step where one of
    them has no draft (no n-gram match) would make everyone's drafts look worthless, and a request that
    had speculated a few tokens ahead of the longest would stop drafting until it fell behind again --
    copy-heavy batches of 4 then speculated in 41% of steps at 0.77 acceptance."""
    top = max(left.values())
    bar = min(top / max(top_rate, 1.0), top - slack)
    critical = {r for r, n in left.items() if n >= bar}
    return [1.0 / len(critical) if r in critical else 0.0 for r in drafting]


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
    verify_token_cost: float = 1.0  # measured: a verified draft token's forward cost / a decode row's (VerifyScale)

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
