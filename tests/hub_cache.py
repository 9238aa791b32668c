"""A Hugging Face Hub cache laid out by hand, so Hub-id tests run offline (HF_HUB_OFFLINE=1).

    hf_home/hub/models--ORG--NAME/
        blobs/<id>                   -> the source file (a link: SmolLM2's float32 weights are ~540 MB)
        snapshots/<commit>/<file>    -> ../../blobs/<id> (relative links, as huggingface_hub writes them)
        refs/<ref>                   the commit hash of each branch or tag

`hub_env(monkeypatch, hf_home)` points the process at it (HF_HOME, HF_HUB_OFFLINE=1, no HF_HUB_CACHE,
no HF_TOKEN); engine/hub.py reads them at call time. `hub_http_error` builds huggingface_hub's typed
HTTP errors (gated, not found, bad revision) for tests that fake the Hub's answers.
"""
from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "chat_template.jinja")


def lay_out(hf_home: Path, repo_id: str, source: Path, commit: str | None = None, refs: tuple[str, ...] = ("main",),
            files: tuple[str, ...] | None = None) -> Path:
    """Link `source`'s model files (config, tokenizer, *.safetensors; or exactly `files`) into a snapshot of
    `repo_id` at `commit` (default: a hash of the id) named by `refs`; returns the snapshot folder."""
    source = Path(source)
    commit = commit or hashlib.sha1(repo_id.encode()).hexdigest()
    repo = Path(hf_home) / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    names = files if files is not None else [f for f in FILES if (source / f).exists()] + sorted(
        p.name for p in source.glob("*.safetensors"))
    for name in names:
        blob = repo / "blobs" / hashlib.sha256(f"{commit}/{name}".encode()).hexdigest()
        if not blob.exists():
            blob.symlink_to((source / name).resolve())
        link = snapshot / name
        if not link.exists():
            link.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def hub_env(monkeypatch, hf_home: Path, offline: bool = True) -> None:
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def hub_http_error(cls_name: str, status: int, repo_id: str):
    """huggingface_hub.errors.<cls_name> as the library raises it for an HTTP answer of `status`."""
    from huggingface_hub import errors

    http = sys.modules[errors.Response.__module__]  # the HTTP client huggingface_hub itself uses
    request = http.Request("GET", f"https://huggingface.co/api/models/{repo_id}")
    return getattr(errors, cls_name)(f"{status} Client Error", response=http.Response(status, request=request))
