"""Self-speculation (`self_sparse`) end to end: SmolLM2-135M float32 at a 1.2k-token context, and a tiny
model disaggregated over real gRPC on loopback.

SmolLM2: the draft reads a 256-token sparse view (sink page, best pages, recent window) of a 1,200-token
real-text context; greedy tokens equal plain decoding alone and 4 at a time (near-ties per
`assert_greedy_equal`), and on real attention the sparse view drafts well (acceptance reported, pinned
loosely). gRPC: the prefill engine ships each prompt's KV layer by layer to a decode engine whose page
summaries are built from the received cells; its self-speculative tokens equal one engine's. Both end with
nothing held.
"""
from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from kv_transfer.contract import make_transport
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.kv_helpers import close_all, ship_all
from tests.prompts import token_prompts
from tests.tiny_models import write_tiny

NEW_TOKENS = 16
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
SPEC = {"proposer": "self_sparse", "max_draft": 4, "gate": False, "proposer_options": {"budget": 256}}


@pytest.mark.slow
def test_smollm2_greedy_identical_at_1k_context_alone_and_4_concurrent(smollm2_dir):
    plain = LLM(dtype="float32", page_size=16, num_pages=1024, keep_logits=True, max_num_batched_tokens=1024)
    prompts = token_prompts(plain.tokenizer, [1200 + 16 * i for i in range(4)])  # 4 rows: a batch
    outs = [plain.generate(p, PARAMS)[0] for p in prompts]
    ref, logits = [o.token_ids for o in outs], [torch.stack(o.logits) for o in outs]
    assert_engine_empty(plain)
    del plain
    llm = LLM(dtype="float32", page_size=16, num_pages=1024, max_num_batched_tokens=1024, speculative=SPEC)
    alone = llm.generate(prompts[0], PARAMS)[0].token_ids
    assert_greedy_equal(ref[:1], [alone], logits[:1])
    together = [o.token_ids for o in llm.generate(prompts, PARAMS)]
    print(assert_greedy_equal(ref, together, logits))
    st = llm.spec.stats
    print("self_sparse", st.as_dict())
    assert st.num_verifies > 0 and st.acceptance_rate > 0.5, st
    assert llm.backend.sparse is None  # the engine itself decodes with full attention
    assert_engine_empty(llm)
    assert not llm.spec.trackers


def test_disaggregated_over_grpc_equals_one_engine(tmp_path):
    d = write_tiny("llama", tmp_path / "llama", initializer_range=0.1, max_position_embeddings=1024)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(150, 300))] for _ in range(4)]
    spec = dict(SPEC, proposer_options={"budget": 16, "recent": 8})
    local = [o.token_ids for o in LLM(model=str(d), dtype="float32", page_size=4, num_pages=512).generate(prompts, PARAMS)]
    pre = LLM(model=str(d), dtype="float32", page_size=4, num_pages=512, max_num_batched_tokens=64)
    dec = LLM(model=str(d), dtype="float32", page_size=4, num_pages=512, speculative=spec)
    got, descs, ends = ship_all(pre, dec, prompts, PARAMS, transport=make_transport("grpc"))
    assert_greedy_equal(local, got)
    st = dec.spec.stats
    assert st.num_verifies > 0 and st.num_drafted > 0, st
    close_all(*ends, llms=[pre, dec])
    assert not dec.spec.trackers
