"""Hugging Face Hub ids (`org/name`, optional revision) -> a local snapshot folder the loader reads.

Who calls it: `engine.loader.resolve_model` for a name shaped `org/name` that is not a local path (a local
directory of that name wins, as in transformers and vLLM); `cluster.spec_model` (what `pdserve validate`
checks) for `cached_config` alone, which never touches the network.

Order of `resolve_hub(repo_id, revision)`:
    id shape (`check_id`) -> config.json (from the cache, or downloaded alone: a few KB) -> architecture
    check (`engine.config.check_supported`: an unsupported model fails before any weight moves) ->
    `snapshot_download` of the top-level config, tokenizer and *.safetensors files (never pickled *.bin,
    never subfolders) -> the folder checked for weights and tokenizer.json -> returned.

Environment, read at call time (a test or a launcher may set it after huggingface_hub was imported):
HF_HUB_CACHE or HF_HOME (where the cache lives, the standard `models--org--name/snapshots/<commit>`
layout), HF_HUB_OFFLINE (cache only, no request). HF_TOKEN is read by huggingface_hub itself, from the
environment (or `hf auth login`'s token file): never from a spec or an argument.

Errors: huggingface_hub's typed errors become pdserve's (`engine.errors.HubModelError` subclasses), each
naming the id and the fix. Nothing is hand-walked in the cache: the library's own functions find files.
"""
from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from engine.config import check_supported
from engine.errors import (GatedModelError, HubModelError, HubRepoNotFoundError, ModelNotCachedError,
                           UnknownModelError, UnknownRevisionError)

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# what the engine reads: config, fast tokenizer + its config and chat template, safetensors (sharded or not)
ALLOW = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "*.safetensors",
         "*.safetensors.index.json"]
IGNORE = ["*/*"]  # subfolders (onnx/, original/, ...) hold other formats of the same weights
_TRUE = {"1", "true", "yes", "on"}


def is_hub_id(name: str) -> bool:
    """Shaped like `org/name` (the caller decides first whether a local path of that name exists)."""
    return bool(HUB_ID.match(name))


def hub_cache_dir() -> Path:
    """The cache folder huggingface_hub uses, from the environment as it is now."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def offline() -> bool:
    return any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def check_id(repo_id: str, revision: str | None = None) -> None:
    """UnknownModelError unless `repo_id` is a valid `org/name` (huggingface_hub's rules)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if "@" in repo_id and is_hub_id(repo_id.split("@", 1)[0]):
        raise UnknownModelError(repo_id, "write the revision apart: model 'org/name' with revision 'REV' "
                                         "(spec key `revision:`, `LLM(..., revision=)`, `--revision`)")
    if not is_hub_id(repo_id):
        raise UnknownModelError(repo_id, "not a Hugging Face Hub id: write org/name, e.g. "
                                         "HuggingFaceTB/SmolLM2-135M-Instruct")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise UnknownModelError(repo_id, f"not a valid Hugging Face Hub id ({e})") from None
    if revision is not None and not revision.strip():
        raise UnknownModelError(repo_id, "revision is empty: give a branch, tag or commit, or leave it out (main)")


def cached_config(repo_id: str, revision: str | None = None) -> Path | None:
    """config.json of the id at `revision` if the cache holds it; None otherwise. Never asks the Hub."""
    from huggingface_hub import try_to_load_from_cache

    check_id(repo_id, revision)
    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=hub_cache_dir(), revision=revision)
    return Path(found) if isinstance(found, str) else None


def resolve_hub(repo_id: str, revision: str | None = None) -> Path:
    """The snapshot folder (config.json, tokenizer files, *.safetensors) of `repo_id` at `revision`."""
    from huggingface_hub import hf_hub_download, snapshot_download

    check_id(repo_id, revision)
    kw = dict(revision=revision, cache_dir=hub_cache_dir(), local_files_only=offline())
    with hub_errors(repo_id, revision):
        config = Path(hf_hub_download(repo_id, "config.json", **kw))
    check_supported(json.loads(config.read_text()), repo_id)
    with hub_errors(repo_id, revision):
        folder = Path(snapshot_download(repo_id, allow_patterns=ALLOW, ignore_patterns=IGNORE, **kw))
    if not list(folder.glob("*.safetensors")):
        raise HubModelError(repo_id, "has no *.safetensors weights at the top of the repository",
                            "pdserve loads safetensors only (never pickled .bin files): pick a repository or "
                            "revision that has them, or convert it into a local directory and name that")
    if not (folder / "tokenizer.json").is_file():
        raise HubModelError(repo_id, "has no tokenizer.json", "pdserve reads the fast tokenizer file: save the "
                            "tokenizer with transformers into a local directory beside the weights and name that")
    return folder


@contextmanager
def hub_errors(repo_id: str, revision: str | None) -> Iterator[None]:
    """huggingface_hub's typed errors -> pdserve's, naming the id and the fix (token values never shown)."""
    from huggingface_hub import errors as hf

    rev = revision or "main"
    try:
        yield
    except hf.GatedRepoError:  # before RepositoryNotFoundError: it derives from it
        have = "HF_TOKEN's account has not been granted access" if os.environ.get("HF_TOKEN") else "HF_TOKEN is unset"
        raise GatedModelError(repo_id, f"is gated and {have}",
                              f"accept its terms at https://huggingface.co/{repo_id} and export HF_TOKEN with a "
                              f"token of that account (read from the environment only, never from a spec)") from None
    except hf.RevisionNotFoundError:
        raise UnknownRevisionError(repo_id, f"revision {rev!r} does not exist",
                                   "give a branch, tag or commit of the repository, or leave revision out "
                                   "(main)") from None
    except hf.RepositoryNotFoundError:
        raise HubRepoNotFoundError(repo_id, "no such repository on the Hugging Face Hub",
                                   "check the spelling (org/name, case matters); a private repository needs "
                                   "HF_TOKEN in the environment") from None
    except (hf.LocalEntryNotFoundError, _incomplete_error(hf), hf.OfflineModeIsEnabled) as e:
        raise _not_cached(repo_id, rev, incomplete=isinstance(e, _incomplete_error(hf))) from None
    except hf.EntryNotFoundError:
        raise HubModelError(repo_id, f"has no config.json at revision {rev!r}",
                            "name a transformers model repository (config.json + safetensors)") from None
    except hf.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", "?")
        raise HubModelError(repo_id, f"the Hub answered HTTP {status}",
                            "retry later, or serve a cached copy with HF_HUB_OFFLINE=1") from None


def _incomplete_error(hf) -> type[Exception]:
    """huggingface_hub >= 2 says when a cached snapshot misses files; older versions have no such error."""
    return getattr(hf, "IncompleteSnapshotError", hf.LocalEntryNotFoundError)


def _not_cached(repo_id: str, rev: str, incomplete: bool) -> ModelNotCachedError:
    cache = hub_cache_dir()
    cached = cached_revisions(repo_id)
    have = f"; the cache holds {', '.join(cached)}" if cached else ""
    if incomplete:
        what = f"the cached snapshot of revision {rev!r} is incomplete"
    else:
        what = f"revision {rev!r} is not in the Hugging Face cache ({cache}){have}"
    get = f"hf download {repo_id}" + (f" --revision {rev}" if rev != "main" else "")
    if offline():
        fix = f"download it once where the Hub is reachable (`{get}`, same HF_HOME) or unset HF_HUB_OFFLINE"
    else:
        fix = (f"the Hub could not be reached: check the network (or HF_ENDPOINT), or download it once "
               f"elsewhere (`{get}`) into this HF_HOME")
    return ModelNotCachedError(repo_id, what, fix)


def cached_revisions(repo_id: str) -> list[str]:
    """'main -> 1a2b3c4', ... for what the cache holds of `repo_id` (for error messages)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.utils import CacheNotFound, CorruptedCacheException

    try:
        info = scan_cache_dir(hub_cache_dir())
    except (CacheNotFound, CorruptedCacheException, OSError):  # only a message's detail is lost
        return []
    out = []
    for repo in info.repos:
        if repo.repo_id == repo_id and repo.repo_type == "model":
            for r in sorted(repo.revisions, key=lambda r: r.commit_hash):
                names = sorted(r.refs) or ["(no branch)"]
                out += [f"{name} -> {r.commit_hash[:7]}" for name in names]
    return out
