"""Prompts of exact token counts from real text: Python's own documentation (`pydoc_data.topics`, shipped
with the interpreter), so the bench needs no download and every machine builds the same prompts.

    source = PromptSource(tokenizer)      # encodes the corpus once (about a second)
    source.ids(i, n) -> n token ids       # request i's prompt; a different slice of the corpus per i

Request i starts at a different offset of the corpus (a fixed stride, wrapping around), so prompts do not
share prefixes (a prefix cache would otherwise make later requests look cheap). The same (i, n) gives the
same ids on every run and for every spec of a `--compare`. `text(i, n)` decodes them for servers that
want strings (its token count on another tokenizer is approximate).
"""
from __future__ import annotations

from typing import Protocol

STRIDE = 7919  # tokens between the starts of consecutive requests' prompts (prime: offsets rarely repeat)


class Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def corpus_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


class PromptSource:
    def __init__(self, tokenizer: Encoder, text: str | None = None):
        self.tokenizer = tokenizer
        self.corpus = tokenizer.encode(text if text is not None else corpus_text())
        assert len(self.corpus) > 1, "empty prompt corpus"

    def ids(self, index: int, n: int) -> list[int]:
        assert n >= 1, n
        c = self.corpus
        start = (index * STRIDE) % len(c)
        out = c[start:start + n]
        while len(out) < n:  # wrap around (and repeat, for prompts longer than the corpus)
            out += c[:n - len(out)]
        return out

    def text(self, index: int, n: int) -> str:
        return self.tokenizer.decode(self.ids(index, n))


def load_tokenizer(model: str):
    """engine's tokenizer for a bundled model name or a model directory (imports engine: call lazily)."""
    from engine.loader import resolve_model
    from engine.tokenizer import Tokenizer

    return Tokenizer(resolve_model(model))
