"""Speculative decoding on SmolLM2-135M (float32): greedy tokens identical to plain decoding.

Copy-heavy prompts (a passage, then the instruction to repeat it) so that drafts are often accepted;
each proposer (including the always-right and always-wrong fakes) runs two prompts one at a time and
all eight together; the reference is the plain engine on all eight at once, with its logits (near-ties
tolerated per `assert_greedy_equal`): plain batched greedy is held to transformers in test_smollm2_exact,
and one prompt at a time cost 3x as much for the same tokens. Short outputs keep the file near a CPU-minute.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.prompts import real_text

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def copy_prompts(tok, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        passage = tok.decode(tok.encode(real_text(i))[:80])
        out.append(tok.encode(f"{passage}\n\nRepeat the passage above word for word.\n\n{passage[:40]}"))
    return out


@pytest.fixture(scope="module")
def reference(smollm2_dir):
    llm = LLM(dtype="float32", page_size=16, num_pages=512, keep_logits=True)
    prompts = copy_prompts(llm.tokenizer, 8)
    outs = llm.generate(prompts, PARAMS)
    assert_engine_empty(llm)
    return prompts, [o.token_ids for o in outs], [torch.stack(o.logits) for o in outs]


@pytest.mark.parametrize("proposer", ["ngram", "recycling", "oracle", "always_wrong"])
def test_greedy_identical_alone_and_8_concurrent(proposer, reference):
    prompts, ref_tokens, ref_logits = reference
    fakes = ("oracle", "always_wrong")
    opts = {"futures": {tuple(p): t for p, t in zip(prompts, ref_tokens)}} if proposer in fakes else {}
    llm = LLM(dtype="float32", page_size=16, num_pages=512,
              speculative={"proposer": proposer, "max_draft": 4, "gate": False, "proposer_options": opts})
    alone = [llm.generate(p, PARAMS)[0].token_ids for p in prompts[:2]]
    assert_greedy_equal(ref_tokens[:2], alone, ref_logits[:2])
    together = [o.token_ids for o in llm.generate(prompts, PARAMS)]
    assert_greedy_equal(ref_tokens, together, ref_logits)
    st = llm.spec.stats
    print(proposer, st.as_dict())
    assert st.num_verifies > 0, st
    if proposer == "always_wrong":
        assert st.num_accepted == 0, st
    else:
        assert st.tokens_per_verify > 1.0, st
    if proposer == "oracle":
        assert st.acceptance_rate > 0.95, st
    assert_engine_empty(llm)
