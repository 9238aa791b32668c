"""Prompts of exact token counts from real text: Python's own documentation (`pydoc_data.topics`, shipped
with the interpreter), so the bench needs no download and every machine builds the same prompts.

    source = PromptSource(tokenizer)      # encodes the corpus once (about a second)
    source.ids(i, n) -> n token ids       # request i's prompt; a different slice of the corpus per i
    source.prompt(spec) -> token ids      # a RequestSpec's prompt (its blocks when it has block ids)

Request i starts at a different offset of the corpus (a fixed stride, wrapping around), so prompts do not
share prefixes (a prefix cache would otherwise make later requests look cheap). The same (i, n) gives the
same ids on every run and for every spec of a `--compare`. `text(i, n)` decodes them for servers that
want strings (its token count on another tokenizer is approximate).

Shared prefixes (Mooncake `hash_ids`): a request with block ids gets the concatenation of its blocks, each
`block_tokens` long and keyed by its id alone, cut to the request's length, so equal ids give equal
tokens and requests share exactly the prefixes the trace says they share.

Rounds: the bench sends the same workload several times (warm-up, unloaded reference, one probe per
rate). Each send has a `round`, and round r draws from a different part of the corpus, so a server's
prefix cache never serves a probe from an earlier probe's prompts; within a round, sharing is as above.
Round 0 gives the same prompts as before rounds existed.
"""
from __future__ import annotations

from typing import Protocol

STRIDE = 7919  # tokens between the starts of consecutive requests' prompts (prime: offsets rarely repeat)
BLOCK_STRIDE = 4099  # tokens between the starts of consecutive block ids' content (prime)
ROUND_STRIDE = 104729  # tokens between rounds (prime; a round shifts every prompt and block)


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

    def _slice(self, start: int, n: int) -> list[int]:
        c = self.corpus
        start %= len(c)
        out = c[start:start + n]
        while len(out) < n:  # wrap around (and repeat, for prompts longer than the corpus)
            out += c[:n - len(out)]
        return out

    def ids(self, index: int, n: int, round_no: int = 0) -> list[int]:
        assert n >= 1, n
        return self._slice(index * STRIDE + round_no * ROUND_STRIDE, n)

    def blocks(self, block_ids: tuple[int, ...], block_tokens: int, n: int, round_no: int = 0,
               index: int = 0) -> list[int]:
        """n tokens: block ids' contents in order, each `block_tokens` long. A prompt longer than its
        blocks (length rounding) is padded from the request's own slice, which nothing else shares."""
        assert n >= 1 and block_tokens >= 1, (n, block_tokens)
        out: list[int] = []
        for h in block_ids:
            if len(out) >= n:
                break
            out += self._slice((h + 1) * BLOCK_STRIDE + round_no * ROUND_STRIDE, block_tokens)
        if len(out) < n:
            out += self.ids(index, n - len(out), round_no)
        return out[:n]

    def prompt(self, spec, block_tokens: int | None = None) -> list[int]:
        """Token ids for a `workload.RequestSpec`."""
        if spec.block_ids and block_tokens:
            return self.blocks(spec.block_ids, block_tokens, spec.input_len, spec.round, spec.index)
        return self.ids(spec.index, spec.input_len, spec.round)

    def text(self, index: int, n: int) -> str:
        return self.tokenizer.decode(self.ids(index, n))


def load_tokenizer(model: str):
    """engine's tokenizer for a bundled model name or a model directory (imports engine: call lazily)."""
    from engine.loader import resolve_model
    from engine.tokenizer import Tokenizer

    return Tokenizer(resolve_model(model))
