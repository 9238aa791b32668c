"""Self-speculation (`self_sparse`, engine/spec_decode/proposers/self_sparse.py) on tiny random models.

The engine's own sparse_attention stays off (drafts read the sparse view, plain and verify steps the full
one): greedy tokens equal plain decoding alone and 8 at a time (float32), while drafts really came from the
sparse view (a small budget rejects some; a budget covering the context accepts every one); page summaries
stay equal to their recomputation through drafts, verifies and rollbacks; KV shipped from a prefill engine
(fake transport: summaries built on import) decodes to the colocated tokens; sampled output follows the
target law (chi-square over (x0, x1, x2) with the drafted position in it); the load-aware gate, fed a
memory-bound fake clock, turns drafting off at short context (and keeps it where drafts are cheap); bad options are
typed errors. Every test ends with no page or reservation held. (A random tiny model's attention is flat,
so its sparse view drafts poorly at long context: acceptance is pinned on SmolLM2 in tests/integration.)
"""
from __future__ import annotations

import random

import pytest
import torch

from engine import SamplingParams
from engine.errors import InvalidRequestError
from engine.llm import LLM
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal, plain_reference
from tests.kv_helpers import close_all, ship_all
from tests.tiny_models import write_tiny, write_tiny_llama
from tests.unit.test_spec_verify import chi_square_pvalue

PS = 4
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
SMALL = {"budget": 16, "recent": 8}  # 1 sink + 4 + 2 + 1 pages = 32 slots of 150-300 token contexts


def _prompts(n: int, lo: int = 150, hi: int = 300) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


PROMPTS = _prompts(8)


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    """The tiny Llama with a 1,024-token context (the shared `tiny_dir` has 512)."""
    return write_tiny_llama(tmp_path_factory, "long", max_position_embeddings=1024)


def make(long_dir, options=None, **kw):
    spec = None if options is None else dict(dict(proposer="self_sparse", max_draft=4, gate=False),
                                             proposer_options=options, **kw.pop("spec", {}))
    return LLM(model=str(long_dir), dtype="float32", page_size=PS, num_pages=kw.pop("num_pages", 1024),
               speculative=spec, **kw)


@pytest.fixture(scope="module")
def reference(long_dir):
    return plain_reference(make(long_dir, keep_logits=True), PROMPTS, GREEDY)


def finish(llm) -> None:
    assert_engine_empty(llm)
    assert not llm.spec.trackers


def test_greedy_equals_plain_alone_and_8_concurrent_with_engine_sparse_off(long_dir, reference):
    llm = make(long_dir, SMALL)
    assert llm.sparse_attention is None and llm.backend.sparse is None
    alone = [llm.generate(p, GREEDY)[0].token_ids for p in PROMPTS[:2]]
    assert_greedy_equal(reference[0][:2], alone, reference[1][:2])
    together = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert_greedy_equal(reference[0], together, reference[1])
    st = llm.spec.stats
    assert st.num_verifies > 0 and st.num_drafted > st.num_accepted > 0, st  # the sparse view differs
    assert llm.backend.sparse is None  # drafting switched it on for its forwards only
    finish(llm)


def test_budget_covering_the_context_drafts_the_target_itself(long_dir, reference):
    llm = make(long_dir, {"budget": 1024})
    got = [o.token_ids for o in llm.generate(PROMPTS[:4], GREEDY)]
    assert_greedy_equal(reference[0][:4], got, reference[1][:4])
    st = llm.spec.stats
    assert st.num_drafted > 0 and st.acceptance_rate == 1.0, st
    finish(llm)


def test_summaries_stay_exact_through_drafts_verifies_and_rollbacks(long_dir):
    llm = make(long_dir, SMALL, spec={"adaptive": False})
    s = llm.backend.summaries
    for p in PROMPTS[:3]:
        llm.add_request(p, GREEDY)
    checked = 0
    while llm.has_unfinished():
        llm.step()
        for seq in list(llm.tables._tables):
            t = llm.tables.get(seq)
            for i, page in enumerate(t.pages[:-(-t.num_slots // PS)]):
                filled = min(PS, t.num_slots - i * PS)
                assert s.extent[page] == filled, (page, s.extent[page], filled)
                for layer in llm.kv_spec.local_layers:
                    lo, hi = s.expected(layer, page, filled)
                    assert torch.equal(s.lo[layer][page], lo) and torch.equal(s.hi[layer][page], hi)
                    checked += 1
    assert checked > 0 and llm.spec.stats.num_drafted > llm.spec.stats.num_accepted  # rollbacks happened
    finish(llm)


def test_disaggregated_kv_gets_summaries_on_import_and_decodes_like_one_engine(long_dir, reference):
    pre = make(long_dir, max_num_batched_tokens=64)  # prompts arrive in chunks, layer by layer
    dec = make(long_dir, SMALL)
    got, descs, ends = ship_all(pre, dec, PROMPTS[:4], GREEDY)
    assert_greedy_equal(reference[0][:4], got, reference[1][:4])
    st = dec.spec.stats
    assert st.num_verifies > 0 and st.num_accepted < st.num_drafted, st
    close_all(*ends, llms=[pre, dec])
    finish(dec)


class MemoryBoundClock:
    """A fake step clock: a forward costs 1 (weights) + 0.1 per KV slot it reads; a one-token row under
    sparse attention reads at most `draft_reads` slots (default: its selection, sinks + budget + window)."""

    def __init__(self, llm, draft_reads: int | None = None):
        self.t, real = 0.0, llm.runner.execute
        cfg = llm.spec.proposers["self_sparse"].cfg
        reads = (cfg.sink_pages + cfg.budget // PS + -(-cfg.recent // PS) + 1) * PS if draft_reads is None else draft_reads

        def execute(batch):
            sparse = llm.backend.sparse is not None
            for s in batch.seqs:
                ctx = s.num_cached + len(s.token_ids)
                self.t += 0.1 * (min(ctx, reads) if sparse and len(s.token_ids) == 1 else ctx)
            self.t += 1.0
            return real(batch)

        llm.runner.execute = execute
        llm.spec.timer = self

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("draft_reads", [None, 0])
def test_gate_turns_drafting_off_at_short_context(long_dir, draft_reads):
    """A 24-64 token context fits the sparse selection (80 slots): the draft is the target itself, every draft
    is accepted, and still it costs what a plain step costs, so once the first drafts were measured the gate
    decodes plainly. The contrast: a clock on which a draft forward reads no KV (what a long context's
    sparse view approaches) keeps the same drafts on."""
    llm = make(long_dir, {"budget": 64, "recent": 8}, spec={"gate": True})
    MemoryBoundClock(llm, draft_reads)
    llm.generate(_prompts(1, 24, 25)[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    st = llm.spec.stats
    if draft_reads is None:  # the first drafts, measured, are dropped before their verify
        assert st.num_spec_steps <= 1 and st.num_gated >= st.num_steps - 1, st
    else:
        assert st.num_spec_steps > st.num_steps // 2 and st.num_gated < 3, st
        assert st.acceptance_rate == 1.0, st
    finish(llm)


def test_a_pool_spec_selects_it(long_dir):
    from cluster.spec_sections import SpeculativeSpec

    cfg = SpeculativeSpec(proposer="self_sparse", max_draft=3).engine_config()
    llm = LLM(model=str(long_dir), dtype="float32", page_size=PS, num_pages=64, speculative=cfg)
    assert "self_sparse" in llm.spec.proposers and llm.backend.summaries is not None
    assert_engine_empty(llm)


def test_bad_options_and_pools_without_summaries_are_typed_errors(long_dir):
    with pytest.raises(InvalidRequestError, match="speculative.proposer_options.budget"):
        make(long_dir, {"budget": 0})
    with pytest.raises(InvalidRequestError, match="speculative.proposer_options"):
        make(long_dir, {"budgets": 16})
    with pytest.raises(InvalidRequestError, match="speculative.proposer: self_sparse needs page summaries"):
        make(long_dir, SMALL, kv_storage="kivi4")
    with pytest.raises(InvalidRequestError, match="speculative.proposer"):
        LLM(model=str(long_dir), dtype="float32", speculative={"proposer": "ngram"}).add_request(
            [5, 6, 7], SamplingParams(speculative={"proposer": "self_sparse"}))


# ---- sampling: chi-square of the engine's output law with a drafted position ----------------------------
VOCAB, TRIALS = 8, 6000
PROMPT8 = [3, 5, 7, 4, 1, 6, 0, 3, 5, 2, 7, 7, 4, 6, 1, 3]  # 16 tokens: 9 pages of 2, the draft reads 3


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory):
    return write_tiny("llama", tmp_path_factory.mktemp("v8") / "llama", vocab_size=VOCAB, initializer_range=0.5,
                      seed=3)


def _target_law(d) -> torch.Tensor:
    """P(x0, x1, x2) after PROMPT8 at temperature 1: [V, V, V]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    with torch.inference_mode():
        ids = torch.tensor([PROMPT8 + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
        p = model(ids).logits.float().softmax(-1)  # [V * V, len + 2, V]
    n = len(PROMPT8)
    p0, p1 = p[0, n - 1], p[::VOCAB, n].view(VOCAB, VOCAB)  # p1[a] = P(x1 | a)
    p2 = p[:, n + 1].view(VOCAB, VOCAB, VOCAB)  # p2[a, b] = P(x2 | a, b)
    return p0.view(-1, 1, 1) * p1.view(VOCAB, VOCAB, 1) * p2


def _sample(d, trials: int) -> tuple[torch.Tensor, object]:
    """Counts of (x0, x1, x2) over `trials` seeds (x1 drafted by self_sparse, x2 its verify's bonus or the
    next plain token) and the speculation stats."""
    llm = LLM(model=str(d), dtype="float32", page_size=2, num_pages=4096, max_num_seqs=256,
              max_num_batched_tokens=4096,
              speculative={"proposer": "self_sparse", "max_draft": 1, "gate": False,
                           "proposer_options": {"budget": 2, "sink_pages": 0, "recent": 1}})
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=s, ignore_eos=True) for s in range(trials)]
    counts = torch.zeros(VOCAB, VOCAB, VOCAB, dtype=torch.long)
    for o in llm.generate([PROMPT8] * trials, params):
        counts[tuple(o.token_ids)] += 1
    finish(llm)
    return counts, llm.spec.stats


def test_sampled_output_follows_the_target_law(tiny8):
    counts, st = _sample(tiny8, TRIALS)
    assert st.num_verifies == TRIALS and 0 < st.num_accepted < TRIALS, st  # output 1 was drafted every time
    p = chi_square_pvalue(counts, _target_law(tiny8).double())
    assert p > 1e-3, f"chi-square p-value {p:.2e} ({st.acceptance_rate:.2f} accepted)"


def test_the_same_test_fails_when_every_sparse_draft_is_accepted(tiny8, monkeypatch):
    from engine.spec_decode import step

    monkeypatch.setattr(step, "accepted_length", lambda draft, targets: len(draft))  # a broken verifier
    counts, st = _sample(tiny8, TRIALS // 4)
    p = chi_square_pvalue(counts, _target_law(tiny8).double())
    assert st.acceptance_rate == 1.0 and p < 1e-6, f"the broken verifier passed (p = {p:.2e})"
