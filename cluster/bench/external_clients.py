"""The external load generators beside `pdserve bench` (issue 22): GuideLLM's scenario and AIPerf's command
line for one rate, the environment they run in, and their throwaway venvs. bench/checks/external_clients.py
runs them (`ensure_venv`, then per rate the scenario or argv under `client_env()`); what they write is read
by `external_results`. No network here; `ensure_venv` runs `python -m venv` and pip.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PINS = {"guidellm": "guidellm==0.8.1", "aiperf": "aiperf==0.13.0"}  # the versions whose outputs were read
NEEDS_TORCH = {"guidellm"}  # its data loader imports torch


def guidellm_scenario(url: str, model: str, tokenizer: str, rate: float, n: int, n_in: int, n_out: int,
                      out: Path, timeout_s: float, seed: int = 0) -> dict:
    return {"spec": {
        "backend": {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/completions",
                    "http2": False, "timeout": timeout_s, "extras": {"body": {"temperature": 0.0}}},
        "profile": {"kind": "constant", "rate": [rate]},
        "constraints": [{"kind": "max_requests", "count": n}],
        "tokenizer": {"kind": "huggingface_auto", "model": tokenizer},
        "data": [{"kind": "synthetic_text", "prompt_tokens": n_in, "output_tokens": n_out}],
        "seed": {"kind": "static", "value": seed},
        "outputs": [{"kind": "json", "path": str(out)}]}}


def aiperf_argv(url: str, model: str, tokenizer: str, rate: float, n: int, n_in: int, n_out: int,
                out_dir: Path, timeout_s: float, seed: int = 0) -> list[str]:
    return ["profile", "--model", model, "--url", url, "--endpoint-type", "completions", "--streaming",
            "--tokenizer", tokenizer, "--synthetic-input-tokens-mean", str(n_in),
            "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(n_out),
            "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "temperature:0.0",
            "--use-server-token-count",
            "--request-rate", f"{rate:g}", "--arrival-pattern", "constant", "--request-count", str(n),
            "--request-timeout-seconds", f"{timeout_s:g}", "--random-seed", str(seed),
            "--artifact-dir", str(out_dir), "--ui", "none", "--workers-max", "1", "--record-processors", "1",
            "--no-server-metrics", "--no-auto-plot"]


def client_env(hub_offline: bool = True) -> dict[str, str]:
    """No hub (the tokenizer is a local directory), one thread and one worker process (the clients share the
    cores with the server), none of the project's paths."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", GUIDELLM__MAX_WORKER_PROCESSES="1")  # not 10
    if hub_offline:  # AIPerf's offline mode looks a tokenizer up in the hub cache only, never at a local path
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return env


def requirements(client: str) -> list[str]:
    from importlib.metadata import version

    # GuideLLM needs torch: the project's own version, so a CPU machine gets no CUDA build
    return [PINS[client]] + ([f"torch=={version('torch')}"] if client in NEEDS_TORCH else [])


def ensure_venv(client: str, root: Path) -> Path:
    """The client's venv (created and installed if its stamp is missing or stale); returns its bin dir."""
    venv, reqs = root / client, requirements(client)
    stamp, want = venv / ".external-client", json.dumps(reqs)
    if stamp.exists() and stamp.read_text() == want:
        return venv / "bin"
    print(f"[clients] installing {' '.join(reqs)} into {venv} (a few minutes, once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *reqs], check=True,
                   env=client_env())
    stamp.write_text(want)
    return venv / "bin"
