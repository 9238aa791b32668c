"""The chosen plan as a cluster spec (the YAML `pdserve validate` / `pdserve serve` read).

`plan_spec(plan, ...)` builds the spec as plain data; `write_spec` checks it with `cluster.spec.parse_spec`
(the same pydantic models `validate` uses; imported lazily, it pulls in `engine`) before writing it with a
header saying where it came from. One replica = one engine of tp x pp devices: on GPUs it asks Ray for
tp*pp GPUs; on `cpu-local` for one CPU (one single-threaded engine per core). More than one node: Ray
joins the running cluster (`address: auto`) and KV receivers bind beyond loopback, which the spec
schema requires to carry an auth token from the environment.

The spec's `model:` (`spec_model`) is what `pdserve serve` loads and `pdserve validate` accepts as written:
`--spec-model` if given, else the model's Hugging Face Hub id (`hf_id` of `deploy/models/*.yaml`, or the id
of a Hub-cache snapshot the config was read from), else the local folder the config came from when it
holds the weights; a config.json with none of these asks for `--spec-model`. The planner also plans
architectures the engine cannot run (OPT, for DistServe's comparisons): `model_notes` says so in the
spec's header and on the terminal; `validate` refuses such a spec only once the model's config is in
the Hugging Face cache (it never downloads), `serve` before any weight is fetched. A decode pool of a
mixture-of-experts model may carry `expert_parallel` (written only when above 1); `layout_notes` says where a
planned MoE layout is one the engine's validators refuse.
A pool of a GPU type with an `accelerator_type` in deploy/hardware.yaml asks for it in `resources`
(`accelerator_type: H100`): heterogeneous plans put each pool on its own machine type that way.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from cluster.planner.errors import PlannerError
from cluster.planner.inputs.models import ModelSpec
from cluster.planner.search.plans import PhaseChoice, Plan

PAGE_SIZE = 16
TOKEN_ENV = "PDSERVE_KV_TOKEN"


def _pool(c: PhaseChoice, replicas: int, cpu: bool, max_len: int, kv_tokens: int,
          accelerator: str | None = None) -> dict[str, Any]:
    need = math.ceil(max_len / PAGE_SIZE)
    pages = max(need, kv_tokens // PAGE_SIZE)
    # per rank (a replica reserves tensor_parallel x pipeline_parallel of these): one GPU each
    resources: dict[str, Any] = {"num_cpus": 1} if cpu else {"num_cpus": 1, "num_gpus": 1}
    if accelerator and not cpu:  # Ray's node resource `accelerator_type:<NAME>` places the pool on its type
        resources["accelerator_type"] = accelerator
    degrees = {"tensor_parallel": c.parallel.tp, "pipeline_parallel": c.parallel.pp}
    if c.parallel.ep > 1:  # written only where chosen: a dense plan's spec stays as it was
        degrees["expert_parallel"] = c.parallel.ep
    return {"replicas": replicas, **degrees, "resources": resources, "max_num_seqs": c.max_seqs,
            "max_num_batched_tokens": max(c.token_budget, 1) if c.phase != "decode" else 512,
            "kv": {"page_size": PAGE_SIZE, "num_pages": pages}, "max_model_len": max_len}


def plan_spec(plan: Plan, model_name: str, dtype: str, nodes: int, cpu: bool, max_len: int,
              ttft_ms: float, tpot_ms: float, accelerators: dict[str, str | None] | None = None) -> dict[str, Any]:
    """`accelerators`: phase -> Ray accelerator type of its hardware (the hardware entry's
    `accelerator_type`); a pool asks for one only where it is given (CPU entries have none)."""
    pools = {}
    for c, n in plan.pools:
        # a prefill replica only holds prompts in flight: one budget's worth plus one longest prompt
        kv = min(c.kv_tokens, 2 * (c.token_budget + max_len)) if c.phase == "prefill" else c.kv_tokens
        pools[c.phase] = _pool(c, n, cpu, max_len, kv, (accelerators or {}).get(c.phase))
    spec: dict[str, Any] = {"model": model_name, "dtype": dtype, "mode": plan.mode, "pools": pools}
    if plan.mode == "disaggregated":
        spec["kv_transfer"] = ({"host": "127.0.0.1", "failure_policy": "fail"} if nodes == 1 else
                               {"host": "0.0.0.0", "auth_token": {"env": TOKEN_ENV}, "failure_policy": "fail"})
    spec["slo"] = {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms}
    spec["ray"] = {"address": "local" if nodes == 1 else "auto"}
    return spec


def spec_model(override: str | None, model: ModelSpec) -> str:
    """What the planned spec's `model:` says (see the module map); PlannerError when nothing servable is known."""
    name = override or model.hf_id or model.local_dir
    if not name:
        raise PlannerError(f"{model.name}: a config.json without weights beside it and no Hub id: give "
                           f"--spec-model (a Hugging Face Hub id org/name or a model directory) for the spec")
    return name


def model_notes(model: ModelSpec) -> list[str]:
    """A line for the spec header and the terminal when the engine cannot run the model's architecture."""
    from engine.config import ARCHITECTURES  # lazy: engine's package init is cheap, but keep the core pure

    runs = sorted(ARCHITECTURES.values())
    if not model.architecture or model.architecture in runs:
        return []
    return [f"note: pdserve's engine runs {', '.join(runs)}; {model.architecture} is planned for comparison "
            f"only (`pdserve serve` refuses it; `pdserve validate` once its config is in the Hugging Face cache)"]


def layout_notes(spec: dict[str, Any], model: ModelSpec) -> list[str]:
    """What `pdserve validate` says of a planned mixture-of-experts spec once the model's config is in the
    Hugging Face cache (`check_against_model`, the engine's own judges): the engine serves TP, EP and EP x TP of
    an MoE model (in its own layout: docs/planner.md), so a note names only what its validators still refuse
    (a degree that does not divide the experts, EP with PP). Dense plans keep only layouts the engine runs
    (`search/configs.py`), so they get none."""
    if not model.is_moe:
        return []
    from cluster.spec import SpecError, parse_spec  # lazy, as write_spec
    from engine.config import ModelConfig, MoEConfig

    moe = MoEConfig(model.experts, model.experts_per_token, model.expert_ffn, True, tuple(range(model.moe_layers)),
                    True, "qwen")
    cfg = ModelConfig("qwen3_moe", model.vocab, model.hidden, model.ffn, model.layers, model.heads, model.kv_heads,
                      model.head_dim, 1e-6, model.max_positions, model.tied_embeddings, False, moe=moe)
    try:
        parse_spec(spec).check_against_model(cfg)
    except SpecError as e:
        return [f"note: {p} (planned ahead of the engine: `pdserve validate` accepts the spec while the model's "
                f"config is not in the Hugging Face cache; `pdserve serve` refuses it until the engine runs it)"
                for p in e.problems]
    return []


def write_spec(spec: dict[str, Any], path: str | Path, header: list[str]) -> None:
    """Validate with the cluster's own schema, then write YAML with a comment header."""
    from cluster.spec import parse_spec  # lazy: pulls in engine (and its imports)

    parse_spec(spec, str(path))
    text = "".join(f"# {line}\n" for line in header) + "\n" + yaml.safe_dump(spec, sort_keys=False)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
