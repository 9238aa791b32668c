"""`EvictionPolicy`: which KV-eviction policy a pool or a request uses (pure Python, no torch).

The YAML pool section `kv.eviction`, `LLM(kv_eviction=...)` and a request's `pdserve.kv_eviction` option
all become one of these; `engine/kv_cache/eviction.py` applies it. `resolve(pool_policy, option)` is the
per-request override: "off" disables it, a dict replaces fields of the pool's policy (or, for a pool
without one, builds a policy from defaults), None keeps the pool's.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from engine.errors import InvalidRequestError

POLICY_NAMES = ("snapkv", "streaming", "h2o")


@dataclass(frozen=True)
class EvictionPolicy:
    method: str = "snapkv"  # a name in POLICY_NAMES
    budget: float = 0.3  # <= 1: share of the prompt to keep; > 1: tokens to keep
    min_prompt: int = 256  # shorter prompts are kept whole
    window: int = 32  # snapkv: observation window (the last prompt queries); h2o: recent tokens; always kept
    pool: int = 7  # snapkv: max-pool kernel over token scores
    sinks: int = 4  # streaming: first tokens always kept
    slack: int = 16  # h2o: evict when a sequence holds keep + slack slots (amortizes the compaction)

    def __post_init__(self) -> None:
        if self.method not in POLICY_NAMES:
            raise InvalidRequestError("kv_eviction.method", f"{self.method!r}; known: {', '.join(POLICY_NAMES)}")
        if not self.budget > 0:
            raise InvalidRequestError("kv_eviction.budget", "must be > 0 (a share <= 1 or a token count)")
        if (self.min_prompt < 1 or self.window < 1 or self.pool < 1 or self.pool % 2 == 0 or self.sinks < 0
                or self.slack < 1):
            raise InvalidRequestError("kv_eviction", "min_prompt, window, slack >= 1; pool odd >= 1; sinks >= 0")

    @classmethod
    def of(cls, value: "EvictionPolicy | dict | None") -> "EvictionPolicy | None":
        return value if value is None or isinstance(value, cls) else resolve(None, value)

    def keep_count(self, prompt_len: int) -> int:
        """Slots a prompt of `prompt_len` tokens keeps (>= the window / sinks, <= the prompt)."""
        n = int(round(self.budget * prompt_len)) if self.budget <= 1 else int(self.budget)
        floor = self.sinks + 1 if self.method == "streaming" else self.window
        return max(min(n, prompt_len), min(floor, prompt_len))

    def applies(self, prompt_len: int) -> bool:
        return prompt_len >= self.min_prompt and self.keep_count(prompt_len) < prompt_len

    def observe(self):
        """The attention statistics the last prompt chunk must record (an `ObserveSpec`), or None."""
        from engine.attention_context import ObserveSpec  # (torch): only engines ask

        if self.method == "snapkv":
            return ObserveSpec(window=self.window)  # attention of the last prompt queries
        return ObserveSpec(slot_mass=True) if self.method == "h2o" else None  # mass each slot receives

def resolve(policy: EvictionPolicy | None, options: "dict | str | None") -> EvictionPolicy | None:
    if options is None:
        return policy
    if options == "off":
        return None
    if not isinstance(options, dict):
        raise InvalidRequestError("kv_eviction", 'must be "off" or an object of policy fields')
    known = {f.name for f in fields(EvictionPolicy)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise InvalidRequestError(f"kv_eviction.{unknown[0]}", f"unknown key; known: {', '.join(sorted(known))}")
    try:
        return replace(policy, **options) if policy is not None else EvictionPolicy(**options)
    except TypeError as e:  # a value of the wrong type reached a comparison
        raise InvalidRequestError("kv_eviction", str(e)) from None
