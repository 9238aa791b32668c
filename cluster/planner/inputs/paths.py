"""Where the planner's data lives: `deploy/models/`, `deploy/hardware.yaml`, `deploy/profiles/`.

Resolved from this file (the repository is installed editable); `PDSERVE_DEPLOY_DIR` points elsewhere.
Also the one YAML/JSON reader of the package, so every data file error names its file.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from cluster.planner.errors import BadConfigError


def deploy_dir() -> Path:
    env = os.environ.get("PDSERVE_DEPLOY_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[3] / "deploy"


def read_data(path: Path) -> Any:
    """Parse a YAML or JSON file; syntax errors become `BadConfigError` naming the file."""
    try:
        text = path.read_text()
    except OSError as e:
        raise BadConfigError(f"{path}: cannot read ({e.strerror})") from None
    try:
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise BadConfigError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {e}") from None


def pydantic_problems(path: Path | str, err: Exception) -> str:
    """One line per pydantic error: `file: dotted.key: message`."""
    errors = getattr(err, "errors", lambda: [])()
    lines = [f"{path}: {'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in errors]
    return "\n".join(lines) or f"{path}: {err}"
