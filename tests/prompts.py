"""Prompts: token ids for the tiny random models (`TINY_PROMPTS`, `CLUSTER_PROMPTS`), and real text (Python's
own documentation, shipped with the interpreter) cut to token counts for SmolLM2."""
from __future__ import annotations

from pydoc_data.topics import topics

# Token-id prompts for the tiny models (vocabulary 256; ids 0-2 are pad, BOS, EOS). Their lengths are set against
# the tests' page sizes 4 and 8 and the 32-token prefill budget: a part page, less than a page, whole pages
# that arrive in chunks. Tests read them, never change them (modules share the lists).
MIXED = [5, 9, 33, 7, 81, 4, 4, 19, 200, 3, 17]  # 11 tokens: ends inside a page
SHORT = [60, 61, 62]  # 3 tokens: less than one page
COUNT = list(range(10, 50))  # 40 tokens: whole pages, two prefill chunks of 32
REPEAT = [7] * 9  # one id nine times: the n-gram proposer and prefix hashes see repeats
TINY_PROMPTS = [MIXED, SHORT, COUNT]  # the engine and KV tests' three ragged prompts
CLUSTER_PROMPTS = [MIXED, SHORT, COUNT, REPEAT]  # the cluster tests' four

TOPICS = ["exceptions", "for", "import", "class", "typesseq", "specialnames", "typesmapping", "formatstrings",
          "numbers", "while", "with", "lambda", "assert", "pass", "try", "if"]


def real_text(index: int) -> str:
    return topics[TOPICS[index % len(TOPICS)]] + "\n" + topics[TOPICS[(index + 5) % len(TOPICS)]]


def token_prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    """One prompt per requested length, each from a different document."""
    out = []
    for i, n in enumerate(lengths):
        ids = tokenizer.encode(real_text(i))
        while len(ids) < n:
            ids += tokenizer.encode(real_text(i + len(ids)))
        out.append(ids[:n])
    return out
