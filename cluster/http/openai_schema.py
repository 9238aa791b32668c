"""OpenAI request bodies as pydantic models: what `/v1/completions` and `/v1/chat/completions` accept.

Called by `cluster/http/app.py` with the decoded JSON body, before anything reaches the backend:

    screen_fields(body, kind)  -> 400 naming the first field that is internal, unsupported or unknown
    parse_request(body, kind)  -> CompletionRequest | ChatRequest (strict types; 400 names the field)
    sampling_params(req, i)    -> engine SamplingParams for choice i (seed + i when a seed is given)
    in_body(error, req)        -> an engine error's field renamed to where the body has it (`pdserve.top_k`)

Every accepted field is listed on the models below (`extra="forbid"`). The sampling extensions of vLLM's
OpenAI server, which benchmark clients (GuideLLM, AIPerf, `vllm bench serve`) send, are top-level fields
with vLLM's names and meaning (`VLLMSampling`): ignore_eos, min_tokens, top_k, min_p, repetition_penalty,
stop_token_ids, include_stop_str_in_output, skip_special_tokens, plus max_completion_tokens and
`stream_options.continuous_usage_stats`. OpenAI and vLLM features pdserve does not implement (`tools`,
`response_format`, `logit_bias`, `use_beam_search`, ...) are accepted only at their neutral value (absent,
null, false, empty, `{"type": "text"}`) and otherwise answered with a 400 naming them: nothing that would
change the output is ignored. pdserve's own per-request options live under one `pdserve` object (the
openai SDK's `extra_body={"pdserve": {...}}`), never as loose fields (`kv_eviction` and `sparse_attention`
take "off" or an object of fields over the pool's settings); its older spellings of five vLLM fields
(`pdserve.ignore_eos`, `.top_k`, `.repetition_penalty`, `.stop_token_ids`, `.skip_special_tokens`)
are still accepted, and a request giving one both ways with different values gets a 400. Fields that name
internal state (reservations, transfer parameters, pages, ...) are rejected wherever they appear: the
server owns that state, clients never set it.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams, SpecRequestOptions

MAX_N = 16  # choices per prompt
MAX_STOP = 16

# feature -> the values that mean "not used" (accepted and ignored)
UNSUPPORTED: dict[str, tuple] = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None, False), "response_format": (None, {"type": "text"}), "logit_bias": (None, {}),
    "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1), "audio": (None,), "modalities": (None, ["text"]),
    "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,), "store": (None, False),
    "metadata": (None, {}), "service_tier": (None, "auto", "default"), "verbosity": (None,),
    # vLLM extensions
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "structured_outputs": (None,), "use_beam_search": (None, False), "length_penalty": (None, 1.0),
    "allowed_token_ids": (None,), "bad_words": (None, []), "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,), "priority": (None, 0),
}
# client-supplied names of server-internal state: rejected at any level of the body
INTERNAL = {"request_id", "reservation", "reservation_id", "reservations", "nonce", "lease", "lease_s",
            "transfer", "transfer_params", "kv_transfer", "kv_transfer_params", "prefill_only",
            "prefill_worker", "decode_worker", "worker", "worker_id", "pages", "page_ids", "page_table",
            "block_table", "slots", "model_fingerprint", "fingerprint", "layout_signature", "auth_token",
            "first_token_id"}
_INTERNAL_PARTS = ("reservation", "transfer", "nonce", "lease", "page_table", "block_table", "fingerprint")


class _Strict(BaseModel):
    # allow_inf_nan: Python's json reads NaN / Infinity, which no bound (`gt=0`) catches on its own
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class SpeculativeOptions(_Strict):
    """Per-request draft-verify override (outputs never change; an engine without speculation ignores it)."""
    enabled: bool = True
    max_draft: int | None = Field(None, ge=0, le=16)
    proposer: Literal["ngram", "recycling", "draft_model"] | None = None  # draft_model only where configured


class KVEvictionOptions(_Strict):
    """Per-request KV-eviction override: fields replace the pool's policy (engine/kv_cache/eviction_policy)."""
    method: Literal["snapkv", "streaming", "h2o"] | None = None
    budget: float | None = Field(None, gt=0)  # <= 1: share of the prompt kept; > 1: tokens kept
    min_prompt: int | None = Field(None, ge=1)
    window: int | None = Field(None, ge=1)
    pool: int | None = Field(None, ge=1)
    sinks: int | None = Field(None, ge=0)
    slack: int | None = Field(None, ge=1)


class SparseAttentionOptions(_Strict):
    """Per-request sparse decode attention: fields replace the pool's (engine/kv_cache/sparse_config.py).
    The pool must run with sparse attention on (its pages keep the page summaries); "off" always works.
    The budget must also be a multiple of the pool's KV page size (checked where the pool is known)."""
    method: Literal["quest"] | None = None
    budget: int | None = Field(None, ge=1)  # tokens of top-scored pages read besides sinks and the window
    sink_pages: int | None = Field(None, ge=0)
    recent: int | None = Field(None, ge=0)
    min_context: int | None = Field(None, ge=0)
    select_per: Literal["kv_head", "row"] | None = None
    gqa: Literal["max", "sum"] | None = None
    selection_layers: list[Annotated[int, Field(ge=0)]] | None = None


# vLLM field -> its value when absent (or null); pdserve.<field> is an older spelling of the first five
DEFAULTS: dict[str, Any] = {"ignore_eos": False, "top_k": 0, "repetition_penalty": 1.0, "stop_token_ids": [],
                            "skip_special_tokens": True, "min_tokens": 0, "min_p": 0.0,
                            "include_stop_str_in_output": False}
ALIASES = ("ignore_eos", "top_k", "repetition_penalty", "stop_token_ids", "skip_special_tokens")


class PdserveOptions(_Strict):
    """pdserve's own per-request options (the `pdserve` object of the body)."""
    timeline: bool = False  # return the request's timeline (queued, first_token, finish, ...) in the response
    return_token_ids: bool = False  # each choice (and stream chunk) carries `token_ids`
    deadline_s: float | None = Field(None, gt=0)  # abort after this many seconds; finish_reason "timeout"
    speculative: SpeculativeOptions | None = None
    kv_eviction: Literal["off"] | KVEvictionOptions | None = None  # "off" keeps every prompt token
    sparse_attention: Literal["off"] | SparseAttentionOptions | None = None  # "off": this request reads every page
    # older spellings of the top-level vLLM fields (ALIASES); None: not given here
    ignore_eos: bool | None = None
    top_k: int | None = Field(None, ge=-1)
    repetition_penalty: float | None = Field(None, gt=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk (no choices) carries the request's usage
    continuous_usage_stats: bool = False  # every chunk carries its choice's usage so far (vLLM)


class VLLMSampling(_Strict):
    """vLLM's sampling extensions, top-level as vLLM takes them; None (absent or null) means DEFAULTS."""
    ignore_eos: bool | None = None  # generate past EOS (only max_tokens, stop strings, stop ids end it)
    min_tokens: int | None = Field(None, ge=0)  # no EOS / stop id / stop string before this many tokens
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0, le=1)  # drop tokens below min_p x the top token's probability
    repetition_penalty: float | None = Field(None, gt=0)  # > 1 discourages tokens of the prompt and output
    stop_token_ids: list[int] | None = None  # these token ids end the output like EOS (and stay in it)
    include_stop_str_in_output: bool | None = None  # keep the stop string that ended the text
    skip_special_tokens: bool | None = None  # False: special tokens' text stays in the output


class _Common(VLLMSampling):
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # the newer OpenAI name of max_tokens
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(None, ge=0)
    user: str | None = None  # accepted, unused
    pdserve: PdserveOptions = Field(default_factory=PdserveOptions)


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = Field(None, ge=0, le=20)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise InvalidRequestError("prompt", "is empty")
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict[str, str]:
        c = self.content
        text = c if isinstance(c, str) else "".join(p.text for p in c or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


def _is_internal(name: str) -> bool:
    return name in INTERNAL or any(part in name for part in _INTERNAL_PARTS)


def screen_fields(body: Any, kind: Literal["completion", "chat"]) -> dict[str, Any]:
    """Reject internal, unsupported and unknown fields with a 400 naming them; strip neutral ones."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    model = CompletionRequest if kind == "completion" else ChatRequest
    out = {}
    for key, value in body.items():
        if _is_internal(key):
            raise InvalidRequestError(key, "names server-internal state; clients cannot set it")
        if key in UNSUPPORTED:
            if not any(value == neutral for neutral in UNSUPPORTED[key]):
                raise InvalidRequestError(key, f"`{key}` is not supported by pdserve")
            continue
        if key not in model.model_fields:
            hint = " (pdserve options go under the `pdserve` object)" if key in PdserveOptions.model_fields else ""
            raise InvalidRequestError(key, f"unknown field `{key}`{hint}")
        out[key] = value
    opts = out.get("pdserve")
    if isinstance(opts, dict):
        for key in opts:
            if _is_internal(key):
                raise InvalidRequestError(f"pdserve.{key}", "names server-internal state; clients cannot set it")
    return out


def _param(loc: tuple) -> str:
    """Dotted field path from a pydantic error location, without union member tags (types, literals and
    the option models' class names)."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or p in _MEMBER_TAGS))]
    return ".".join(parts) or "body"


def _first_error(errors: list[dict]) -> dict:
    """The error to report: the first, unless it only says an object is not the literal of its union
    (`"off" | {...}`) and the object's own error, deeper in the same field, is listed: that one names the
    bad key (`pdserve.sparse_attention.budget`, not `pdserve.sparse_attention`)."""
    first = errors[0]
    if first["type"] == "literal_error":
        stem = first["loc"][:-1]
        for other in errors[1:]:
            if other["loc"][:len(stem)] == stem and len(other["loc"]) > len(first["loc"]):
                return other
    return first


def parse_request(body: dict[str, Any], kind: Literal["completion", "chat"]) -> CompletionRequest | ChatRequest:
    model = CompletionRequest if kind == "completion" else ChatRequest
    try:
        req = model.model_validate(screen_fields(body, kind))
    except ValidationError as e:
        err = _first_error(e.errors())
        raise InvalidRequestError(_param(err["loc"]), err["msg"]) from None
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOP:
        raise InvalidRequestError("stop", f"at most {MAX_STOP} stop strings")
    if isinstance(req, ChatRequest) and req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs", "requires `logprobs: true`")
    if None not in (req.max_tokens, req.max_completion_tokens) and req.max_tokens != req.max_completion_tokens:
        raise InvalidRequestError("max_completion_tokens", f"({req.max_completion_tokens}) differs from max_tokens "
                                                           f"({req.max_tokens}); give one of them")
    for name in ALIASES:
        top, old = getattr(req, name), getattr(req.pdserve, name)
        if None not in (top, old) and top != old:
            raise InvalidRequestError(name, f"given as `{name}` ({top!r}) and as `pdserve.{name}` ({old!r}); "
                                            f"send `{name}` only")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError("stream_options", "only allowed with `stream: true`")
    return req


_MEMBER_TAGS = {"str", "int", "float", "bool", "list", "dict", SpeculativeOptions.__name__,
                KVEvictionOptions.__name__, SparseAttentionOptions.__name__}


def vllm_field(req: CompletionRequest | ChatRequest, name: str) -> Any:
    """The value of a vLLM sampling field: top level, else its `pdserve.` spelling, else its default."""
    value = getattr(req, name)
    if value is None and name in ALIASES:
        value = getattr(req.pdserve, name)
    return DEFAULTS[name] if value is None else value


def sampling_params(req: CompletionRequest | ChatRequest, choice: int, default_max_tokens: int) -> SamplingParams:
    """Engine parameters for choice `choice` of `req` (seeds seed, seed+1, ... so n choices differ)."""
    o = req.pdserve
    max_tokens = req.max_tokens if req.max_tokens is not None else req.max_completion_tokens
    logprobs = ((req.top_logprobs or 0) if req.logprobs else None) if isinstance(req, ChatRequest) else req.logprobs
    vllm = {name: vllm_field(req, name) for name in DEFAULTS}
    vllm["stop_token_ids"] = list(vllm["stop_token_ids"])
    params = SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
        stop=list([req.stop] if isinstance(req.stop, str) else req.stop or []), logprobs=logprobs,
        seed=None if req.seed is None else req.seed + choice,
        speculative=SpecRequestOptions(**o.speculative.model_dump()) if o.speculative is not None else None,
        kv_eviction=o.kv_eviction if not isinstance(o.kv_eviction, KVEvictionOptions)
        else o.kv_eviction.model_dump(exclude_none=True),
        sparse_attention=o.sparse_attention if not isinstance(o.sparse_attention, SparseAttentionOptions)
        else o.sparse_attention.model_dump(exclude_none=True),
        **vllm,
    )
    try:
        params.validate(vocab_size=2**31)  # early 400s; the engine re-checks token ids against its vocabulary
    except InvalidRequestError as e:
        raise in_body(e, req) from None
    return params


def in_body(e: InvalidRequestError, req: CompletionRequest | ChatRequest | None = None) -> InvalidRequestError:
    """The engine names its own field (`top_k`); where the client sent it as `pdserve.top_k`, name that one
    (and `max_completion_tokens` where the body gave the token cap by that name)."""
    root, why = e.field.split(".")[0], str(e).removeprefix(f"{e.field}: ")
    in_pdserve = root in ALIASES and req is not None and getattr(req, root) is None
    if in_pdserve or (root in PdserveOptions.model_fields and root not in _Common.model_fields):
        return InvalidRequestError(f"pdserve.{e.field}", why)
    if root == "max_tokens" and req is not None and req.max_tokens is None and req.max_completion_tokens is not None:
        return InvalidRequestError("max_completion_tokens", why)
    return e
