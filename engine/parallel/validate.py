"""Which parallel layouts a model and a set of options can run with (pure: no torch, no processes).

The one place the degrees are judged, so the engine and the cluster spec cannot disagree:
- `LLM(tensor_parallel_size=, pipeline_parallel_size=, expert_parallel_size=)` calls `check_supported`
  (through `tp_runner`) before any weight is read or process started;
- `cluster.spec.ClusterSpec.check_against_model` (what `pdserve validate` and `serve` run) calls
  `parallel_problems` and reports every problem under the pool's YAML keys.
`validate_tp` / `validate_pp` / `validate_ep` are also re-exported by `shard.py` / `stages.py` / `experts.py`,
whose workers re-check. Tensor parallelism splits MoE models too (every expert by its intermediate width:
`validate_tp` checks the experts' width beside the dense one). Expert parallelism runs alone or over
groups of tensor-parallel ranks (tensor_parallel_size x expert_parallel_size ranks), never with pipeline stages:
every expert group holds every layer's attention and dense parts.
"""
from __future__ import annotations

from engine.config import ModelConfig
from engine.parallel.errors import ParallelConfigError, UnsupportedWithParallelError

PP_FIELD = "pipeline_parallel_size"
EP_FIELD = "expert_parallel_size"


def validate_tp(cfg: ModelConfig, size: int, field: str = "tensor_parallel_size") -> None:
    """ParallelConfigError naming `field` unless `cfg` can be split over `size` ranks."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ParallelConfigError(field, f"must be a positive integer, got {size!r}")
    if cfg.num_heads % size:
        raise ParallelConfigError(field, f"{size} does not divide the model's {cfg.num_heads} query heads "
                                         f"(num_attention_heads)")
    kv = cfg.num_kv_heads
    if kv % size and size % kv:
        raise ParallelConfigError(field, f"{size} neither divides the model's {kv} KV heads "
                                         f"(num_key_value_heads) nor is a multiple of them (replication)")
    if cfg.intermediate_size % size:
        raise ParallelConfigError(field, f"{size} does not divide the model's intermediate_size "
                                         f"{cfg.intermediate_size}")
    if cfg.moe is not None and cfg.moe.intermediate_size % size:  # each expert splits as a dense MLP
        raise ParallelConfigError(field, f"{size} does not divide the model's expert intermediate size "
                                         f"{cfg.moe.intermediate_size} (moe_intermediate_size / intermediate_size)")
    if cfg.moe is not None and cfg.moe.shared_intermediate_size % size:  # Qwen2-MoE's, split the same way
        raise ParallelConfigError(field, f"{size} does not divide the model's shared expert intermediate size "
                                         f"{cfg.moe.shared_intermediate_size} (shared_expert_intermediate_size)")


def validate_pp(cfg: ModelConfig, size: int) -> None:
    """ParallelConfigError unless `cfg`'s layers can be split into `size` non-empty stages."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ParallelConfigError(PP_FIELD, f"must be a positive integer, got {size!r}")
    if size > cfg.num_layers:
        raise ParallelConfigError(PP_FIELD, f"{size} stages for the model's {cfg.num_layers} layers "
                                            f"(num_hidden_layers): a stage needs at least one layer")


def validate_ep(cfg: ModelConfig, size: int) -> None:
    """ParallelConfigError unless `cfg`'s experts split evenly over `size` expert ranks (any model at 1)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ParallelConfigError(EP_FIELD, f"must be a positive integer, got {size!r}")
    if size == 1:
        return
    if cfg.moe is None:
        raise ParallelConfigError(EP_FIELD, f"{size}: the model has no experts (a dense MLP): expert parallelism "
                                            f"shards mixture-of-experts layers")
    if cfg.moe.num_experts % size:
        raise ParallelConfigError(EP_FIELD, f"{size} does not divide the model's {cfg.moe.num_experts} experts "
                                            f"(num_experts / num_local_experts)")


EXPERT_ATTENTION = ("auto", "data", "replicated")


def expert_attention_of(choice: str, tp: int, ep: int) -> str | None:
    """The expert ranks' attention layout for `EngineConfig.expert_attention`: None without expert parallelism;
    "auto" is "data" (each rank, or group of TP ranks, its own sequences: the layout the planner prices)."""
    if choice not in EXPERT_ATTENTION:
        raise ParallelConfigError("expert_attention", f"{choice!r}: name one of {', '.join(EXPERT_ATTENTION)}")
    if ep == 1:
        return None
    return "data" if choice == "auto" else choice


def valid_ep_degrees(cfg: ModelConfig) -> list[int]:
    """Every expert-parallel degree `cfg` splits over (1 for a dense model)."""
    n = cfg.moe.num_experts if cfg.moe is not None else 1
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_tp_degrees(cfg: ModelConfig) -> list[int]:
    """Every tensor-parallel degree `cfg` splits over (for error messages and the planner)."""
    out = []
    for size in range(1, cfg.num_heads + 1):
        try:
            validate_tp(cfg, size)
        except ParallelConfigError:
            continue
        out.append(size)
    return out


def unsupported(tp: int, pp: int, speculative: bool = False, kv_eviction: bool = False, ep: int = 1,
                ) -> list[UnsupportedWithParallelError]:
    """Options whose state lives beside one model and one page pool, combined with TP/PP/EP > 1."""
    if (tp, pp, ep) == (1, 1, 1):
        return []
    out = []
    if tp > 1 and pp > 1:
        out.append(UnsupportedWithParallelError(PP_FIELD, "stages of several tensor-parallel ranks"))
    if ep > 1 and pp > 1:
        out.append(UnsupportedWithParallelError(EP_FIELD, "expert ranks together with pipeline stages (each expert "
                                                          "rank holds every layer); use pipeline_parallel_size=1"))
    if speculative:
        out.append(UnsupportedWithParallelError("speculative", "draft-verify decoding runs proposers and drafts "
                                                               "against a single-process model"))
    if kv_eviction:
        out.append(UnsupportedWithParallelError("kv_eviction", "eviction observes attention and compacts pages "
                                                               "in one local page pool"))
    return out


def parallel_problems(cfg: ModelConfig, tp: int, pp: int, speculative: bool = False, kv_eviction: bool = False,
                      ep: int = 1) -> list[ParallelConfigError | UnsupportedWithParallelError]:
    """Every reason `cfg` cannot run at these degrees with these options, in `check_supported`'s order."""
    out: list[ParallelConfigError | UnsupportedWithParallelError] = []
    for check, size in ((validate_tp, tp), (validate_pp, pp), (validate_ep, ep)):
        try:
            check(cfg, size)
        except ParallelConfigError as e:
            out.append(e)
    return out + unsupported(tp, pp, speculative, kv_eviction, ep)


def check_supported(cfg: ModelConfig, tp: int, speculative=None, kv_eviction=None, pp: int = 1, ep: int = 1) -> None:
    """Raise the first of `parallel_problems` (ParallelConfigError for a degree that does not split
    `cfg`, UnsupportedWithParallelError for an option the ranks cannot run). Runs before any weight is read."""
    problems = parallel_problems(cfg, tp, pp, speculative is not None, kv_eviction is not None, ep)
    if problems:
        raise problems[0]
