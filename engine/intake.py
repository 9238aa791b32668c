"""Request intake: what `LLM.add_request` (and the disaggregation entry points) check before a request
exists -- the prompt's form and vocabulary, the sampling parameters, and whether it can ever run on this
engine (context length, KV pool, chunking, per-request KV/sparse/speculative options).

`RequestIntake` holds what those checks read, set once by `LLM.__init__`; it never changes engine state.
Every refusal is an `InvalidRequestError` naming the field.
"""
from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.kv_cache.sparse_config import check_for_engine as check_sparse
from engine.request import Request
from engine.sampling_params import SamplingParams

_ids = itertools.count()


@dataclass
class RequestIntake:
    tokenizer: object
    vocab_size: int
    max_model_len: int
    page_size: int
    kv_capacity: int  # tokens the KV pool holds
    storage_format: str
    local_attention: bool  # attention runs in this process (False under tensor/pipeline parallelism)
    scheduler: object  # its `cfg` (read at each check: benches change the token budget at run time)
    sparse_attention: object = None  # the engine's SparseAttentionConfig, or None
    spec: object = None  # the engine's SpecDecoder, or None (checks per-request proposers)

    def tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise InvalidRequestError("prompt", "must be a string or a list of integer token ids")
        if not ids:
            raise InvalidRequestError("prompt", "is empty")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError("prompt", f"token id {bad} outside the vocabulary [0, {self.vocab_size})")
        return ids

    def check(self, n_prompt: int, params: SamplingParams, prefill_only: bool = False) -> None:
        """InvalidRequestError if a prompt of `n_prompt` tokens with `params` can never run here. A
        prefill-only request makes one token, so only that one must fit."""
        if not self.local_attention and params.kv_eviction not in (None, "off"):  # TP/PP: attention in ranks
            raise InvalidRequestError("kv_eviction", "per-request KV eviction is not supported with tensor or "
                                                     "pipeline parallelism")
        if self.storage_format == "kivi4" and params.kv_eviction not in (None, "off"):
            raise InvalidRequestError("kv_eviction", "not supported on kivi4 pages (compaction would move cells "
                                                     "across the per-page key groups)")
        if prefill_only:
            params = SamplingParams(max_tokens=1)  # (and no sparse attention: prefill reads every page)
        check_sparse(self.sparse_attention, params.sparse_attention, self.page_size)
        if self.spec is not None:
            self.spec.check(params)  # a per-request proposer this engine cannot run
        if n_prompt >= self.max_model_len:
            raise InvalidRequestError("prompt", f"{n_prompt} tokens; the model's context is {self.max_model_len}")
        if n_prompt + params.max_tokens > self.max_model_len:
            raise InvalidRequestError("max_tokens", f"prompt ({n_prompt}) + max_tokens ({params.max_tokens}) "
                                                    f"exceeds the model's context of {self.max_model_len}")
        sc = self.scheduler.cfg
        if not sc.enable_chunked_prefill and n_prompt > sc.max_num_batched_tokens:
            raise InvalidRequestError("prompt", f"{n_prompt} tokens exceed max_num_batched_tokens "
                                                f"({sc.max_num_batched_tokens}) and chunked prefill is off")
        if n_prompt + params.max_tokens > self.kv_capacity:
            raise InvalidRequestError("max_tokens", f"prompt + max_tokens ({n_prompt + params.max_tokens}) "
                                                    f"exceeds the KV pool of {self.kv_capacity} tokens")

    def new_request(self, prompt, params: SamplingParams | None, request_id: str | None, in_use,
                    arrival: float, prefill_only: bool = False) -> Request:
        """A checked `Request` (not yet queued); `in_use`: request ids already taken."""
        params = params or SamplingParams()
        params.validate(self.vocab_size)
        ids = self.tokens(prompt)
        self.check(len(ids), params, prefill_only)
        rid = request_id if request_id is not None else f"req-{next(_ids)}"
        if rid in in_use:
            raise InvalidRequestError("request_id", f"{rid!r} is already in use")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        return Request(rid, ids, params, seed, arrival, prefill_only=prefill_only)
