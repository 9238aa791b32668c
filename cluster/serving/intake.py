"""Request intake checks for `ClusterRouter.generate`: typed 400s before a request is admitted. Pure Python.

Who calls it: `router.py` (`_open`), once per request, before it joins the queue. It fixes a seed
when the request has none, since both workers (and any recompute or resume) must sample the same tokens.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any

from engine.errors import InvalidRequestError


def validate_request(req, cfg, tokenizer) -> tuple[list[int], Any]:
    """(prompt token ids, a validated copy of the sampling params) or `InvalidRequestError`."""
    params = dataclasses.replace(req.params)  # never mutate the caller's
    params.validate(cfg.vocab_size)
    if params.seed is None:
        params.seed = random.getrandbits(63)
    if isinstance(req.prompt, str):
        ids = tokenizer.encode(req.prompt)
    elif isinstance(req.prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in req.prompt):
        ids = list(req.prompt)
    else:
        raise InvalidRequestError("prompt", "must be a string or a list of integer token ids")
    if not ids:
        raise InvalidRequestError("prompt", "is empty")
    if any(not 0 <= t < cfg.vocab_size for t in ids):
        raise InvalidRequestError("prompt", f"token ids must be in [0, {cfg.vocab_size})")
    limit = min(cfg.max_model_len, cfg.kv_capacity_tokens)
    if len(ids) >= limit or len(ids) + params.max_tokens > limit:
        raise InvalidRequestError("max_tokens", f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) "
                                                f"exceeds the {limit}-token limit of this cluster")
    if cfg.prefill_capacity_tokens is not None and len(ids) > cfg.prefill_capacity_tokens:
        raise InvalidRequestError("prompt", f"{len(ids)} tokens exceed the prefill pool's KV capacity "
                                            f"({cfg.prefill_capacity_tokens} tokens)")
    return ids, params
