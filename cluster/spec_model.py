"""The spec's `model:` (and `revision:`): the name checks at parse time, and the model's config for
`pdserve validate` (never downloads) and `pdserve serve` (resolves, downloading a Hub id if needed).

Who calls it: `cluster.spec.ClusterSpec._check` -> `name_problems` (pure: no filesystem, no network);
`cluster/cli.py validate` -> `config_for_validate`; `cluster/serving/ray_pools.py start_cluster` ->
`resolve_model_config` (re-exported by `cluster.spec`).

What `validate` checks of a Hub id (`org/name`, not a local path): its shape (huggingface_hub's rules),
and, where the Hugging Face cache already holds its config.json (HF_HOME), the architecture and every
heads/layers/positions check. An id whose config is not cached passes with a note: validate reads no
network, so a spec is checked the same way on a laptop and in CI, and a planned spec for a model this
machine never downloaded (the planner plans OPT, Llama-70B, ...) validates as written. `pdserve serve`
fetches config.json first and refuses an unsupported architecture before any weight is downloaded.
Nothing here imports torch at module load (engine modules are imported inside the functions).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.spec_errors import Problem, SpecError

if TYPE_CHECKING:
    from engine.config import ModelConfig


def _hub_shaped(model: str) -> bool:
    from engine.hub import is_hub_id

    return is_hub_id(model) and not Path(model).expanduser().exists()


def name_problems(model: str, revision: str | None) -> list[Problem]:
    """Spec-time checks of the model's name: `org/name@rev` and a revision on a non-Hub name."""
    from engine.hub import is_hub_id

    if "@" in model and is_hub_id(model.split("@", 1)[0]):
        return [Problem("model", "write the revision as its own key: `model: org/name` and `revision: REV` "
                                 "(a branch, tag or commit)")]
    if revision is not None and not is_hub_id(model):
        return [Problem("revision", "applies to Hugging Face Hub ids (org/name) only; remove it for a bundled "
                                    "name, a directory or a .gguf file")]
    return []


def resolve_model_config(spec) -> "ModelConfig":
    """Resolve `spec.model` (a GGUF converted once into the cache; a Hub id downloaded into the Hugging
    Face cache unless HF_HUB_OFFLINE) and read its config; any resolution error is a SpecError on `model`."""
    from engine.errors import PdserveError
    from engine.loader import load_config, resolve_model  # torch: imported only when a model is resolved

    try:
        return load_config(resolve_model(spec.model, spec.revision))
    except PdserveError as e:
        raise SpecError([Problem("model", str(e))]) from None


def config_for_validate(spec) -> tuple["ModelConfig | None", str]:
    """(config, note) for `pdserve validate`: a Hub id reads only the cache (None + a note when its config
    is not there); other names resolve as `serve` resolves them (a bundled GGUF converts once)."""
    if not _hub_shaped(spec.model):
        return resolve_model_config(spec), ""
    from engine import hub
    from engine.config import ModelConfig, check_supported
    from engine.errors import PdserveError

    try:
        path = hub.cached_config(spec.model, spec.revision)
        if path is None:
            rev = f" at revision {spec.revision}" if spec.revision else ""
            return None, (f"{spec.model}{rev} is not in the Hugging Face cache ({hub.hub_cache_dir()}): its id is "
                          f"valid; its architecture and sizes are checked when `pdserve serve` fetches its "
                          f"config (before any weights)")
        data = json.loads(path.read_text())
        check_supported(data, spec.model)
        return ModelConfig.from_hf_dict(data), f"{spec.model}: config.json from the Hugging Face cache"
    except PdserveError as e:
        raise SpecError([Problem("model", str(e))]) from None
