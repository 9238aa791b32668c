"""`EngineConfig`: everything an `engine.LLM` is built from, frozen, in one value.

Who makes it: `LLM(model, **options)` builds one from its keywords (the long-standing call), or a caller hands
one in (`LLM(EngineConfig(...))`, `LLM(cfg, device="cuda")` to change a field); cluster specs and workers can
pass one across processes (a plain dataclass: Ray pickles it). Values are checked where they are used (the
loader, the KV spec, the sparse/speculative/eviction configs), with typed errors naming the field.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace


@dataclass(frozen=True)
class EngineConfig:
    model: str = "smollm2-135m"  # a bundled name, a local HF/GGUF directory, or a Hugging Face Hub id
    revision: str | None = None  # Hub revision (branch, tag or commit)
    dtype: str = "bfloat16"  # float32 | bfloat16 | float16
    device: str = "cpu"  # cpu | cuda | cuda:N
    num_threads: int | None = 1  # torch threads of this process (None: leave torch's choice)
    # KV cache
    page_size: int = 16
    num_pages: int | None = None  # None: room for max(16k tokens, one request of max_model_len)
    kv_storage: str = "raw"  # raw | int8 | fp8 | kivi4 (engine/kv_cache/spec.py)
    kv_eviction: object = None  # EvictionPolicy or its dict (engine/kv_cache/eviction_policy.py)
    enable_prefix_caching: bool = False
    sparse_attention: object = None  # SparseAttentionConfig or a dict of its fields, "off" or None (kv_cache/sparse_config.py)
    # scheduling
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # None: the model's own
    enable_chunked_prefill: bool = True
    # decoding
    speculative: object = None  # SpeculativeConfig or its dict (engine/spec_decode/config.py)
    decode_graphs: str = "auto"  # auto | static | off (engine/kernels/cuda/graph_decode.py)
    sampler: str = "auto"  # auto (device on CUDA) | cpu | device: where sampled rows are drawn (engine/device_sampler.py)
    keep_logits: bool = False  # tests: keep each sampled position's float32 logits on the request
    # parallelism (engine/parallel)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    expert_parallel_size: int = 1  # MoE models: experts split over this many ranks (or groups of TP ranks)
    # how expert ranks attend: "data" (each rank, or group of TP ranks, its own sequences and its share of
    # num_pages; tokens go to their experts' ranks and back), "replicated" (each every sequence, the whole KV);
    # "auto": data
    expert_attention: str = "auto"

    @staticmethod
    def of(value: "EngineConfig | dict") -> "EngineConfig":
        """A config as given, or one built from a dict of its fields (an unknown name: a TypeError naming it)."""
        return value if isinstance(value, EngineConfig) else EngineConfig().with_options(**value)

    def with_options(self, **options) -> "EngineConfig":
        """A copy with some fields changed; an unknown name is a TypeError naming it."""
        unknown = set(options) - {f.name for f in fields(self)}
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return replace(self, **options) if options else self

    def as_dict(self) -> dict:
        return asdict(self)
