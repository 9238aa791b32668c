"""An engine on a tiny checkpoint for the model tests (float32, pages of 4 tokens, 96 of them unless told),
and greedy runs that must leave it empty."""
from __future__ import annotations

from engine import LLM, SamplingParams
from tests.conftest import assert_engine_empty


def tiny_llm(model_dir, **kw) -> LLM:
    return LLM(model=str(model_dir), dtype=kw.pop("dtype", "float32"), num_pages=kw.pop("num_pages", 96),
               page_size=kw.pop("page_size", 4), **kw)


def generate_to_empty(llm: LLM, prompts, params: SamplingParams) -> list[list[int]]:
    """Each prompt's tokens; the engine ends with no pages, reservations or requests left."""
    out = [o.token_ids for o in llm.generate(prompts, params)]
    assert_engine_empty(llm)
    return out
