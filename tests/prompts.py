"""Real-text prompts (Python's own documentation, shipped with the interpreter) cut to token counts."""
from __future__ import annotations

from pydoc_data.topics import topics

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
