"""`assert_greedy_equal`: the one exactness check every test in the project uses (`assert_greedy_forced`: the
same rule against teacher-forced reference logits).

Greedy tokens must be identical. A divergence is tolerated only where the reference's top-2 logit gap at
that position is below `gap` (a near-tie, where float summation order may flip the argmax), at most one
per 1,000 compared tokens (rounded up), and every tolerated divergence is reported. After a tolerated
divergence the two continuations legitimately differ, so comparison of that case stops there.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class GreedyReport:
    compared: int = 0
    divergences: list[tuple[int, int, float]] = field(default_factory=list)  # (case, position, top-2 gap)

    def __str__(self) -> str:
        s = f"{self.compared} greedy tokens compared, {len(self.divergences)} near-tie divergence(s)"
        return s + "".join(f"\n  case {c} position {p}: top-2 gap {g:.2e}" for c, p, g in self.divergences)


def top2_gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def assert_greedy_equal(reference: list[list[int]], actual: list[list[int]],
                        reference_logits: list[torch.Tensor] | None = None, *,
                        gap: float = 1e-4, per_tokens: int = 1000) -> GreedyReport:
    """reference/actual: token lists per case; reference_logits: per case [len, vocab] logits that chose
    each reference token (needed to tolerate near-ties; without them any divergence fails)."""
    assert len(reference) == len(actual), f"{len(reference)} reference cases vs {len(actual)} actual"
    rep = GreedyReport()
    for case, (ref, got) in enumerate(zip(reference, actual)):
        i = next((j for j, (a, b) in enumerate(zip(ref, got)) if a != b), None)
        if i is None:
            assert len(ref) == len(got), f"case {case}: lengths differ, {len(ref)} vs {len(got)} tokens"
            rep.compared += len(ref)
            continue
        g = top2_gap(reference_logits[case][i]) if reference_logits is not None else math.inf
        assert g < gap, (f"case {case}: greedy tokens differ at position {i} ({ref[i]} vs {got[i]}); "
                         f"reference top-2 gap {g:.3e} is not a near-tie (< {gap})")
        rep.compared += i + 1
        rep.divergences.append((case, i, g))
    allowed = math.ceil(rep.compared / per_tokens)
    assert len(rep.divergences) <= allowed, f"too many near-tie divergences ({allowed} allowed): {rep}"
    print(rep)
    return rep


def assert_greedy_forced(actual: list[list[int]], reference_logits: list[torch.Tensor], *,
                         gap: float = 1e-4, per_tokens: int = 1000) -> GreedyReport:
    """`assert_greedy_equal` against teacher-forced logits: reference_logits[case][j] scored actual[case][j]
    given the prompt and actual[case][:j] (the engine's own prefix), so every position is compared -- a
    tolerated near-tie does not end its case -- and each token must be that row's argmax unless it is a
    near-tie; at most one tolerated divergence per `per_tokens` compared tokens."""
    assert len(reference_logits) == len(actual), f"{len(reference_logits)} reference cases vs {len(actual)} actual"
    rep = GreedyReport()
    for case, (got, logits) in enumerate(zip(actual, reference_logits)):
        assert len(got) == len(logits), f"case {case}: {len(got)} tokens vs {len(logits)} reference rows"
        for j, (tok, best) in enumerate(zip(got, logits.argmax(-1).tolist())):
            if tok == best:
                continue
            g = float(logits[j, best] - logits[j, tok])  # the chosen token's shortfall from the argmax
            assert g < gap, (f"case {case}: token {tok} at position {j} is not the reference's argmax {best} and "
                             f"trails it by {g:.3e} (not a near-tie, < {gap})")
            rep.divergences.append((case, j, g))
        rep.compared += len(got)
    allowed = math.ceil(rep.compared / per_tokens)
    assert len(rep.divergences) <= allowed, f"too many near-tie divergences ({allowed} allowed): {rep}"
    return rep


def assert_logits_close(reference: torch.Tensor, actual: torch.Tensor, upto: int, atol: float = 1e-4) -> float:
    """Max abs difference over the first `upto` positions; asserts it is within `atol`."""
    diff = float((reference[:upto].float() - actual[:upto].float()).abs().max()) if upto else 0.0
    assert diff <= atol, f"logits differ by {diff:.3e} (> {atol}) within the first {upto} positions"
    return diff


def plain_reference(llm, prompts, params) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each prompt generated alone on `llm` (built with keep_logits=True): its tokens and the logits that
    chose them, the oracle `assert_greedy_equal` tolerates near-ties against; the engine ends empty."""
    from tests.conftest import assert_engine_empty

    outs = [llm.generate(p, params)[0] for p in prompts]
    assert_engine_empty(llm)
    return [o.token_ids for o in outs], [torch.stack(o.logits) for o in outs]


def hf_generate_greedy(model, prompts: list[list[int]], max_new_tokens: int
                       ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """A transformers model's own greedy generate(), one prompt at a time with EOS ignored (as ignore_eos=True):
    each prompt's new tokens and the logits that chose them ([new_tokens, vocab], float32)."""
    model.generation_config.eos_token_id = None
    tokens, logits = [], []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
            tokens.append(out.sequences[0, len(ids):].tolist())
            logits.append(torch.cat(out.logits).float())
    return tokens, logits
