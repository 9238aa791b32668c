"""Servers under test: `pdserve serve SPEC` as a child process (`--spec`/`--compare`), and spec variants
for `--set` sweeps.

    with SpecServer(spec_path, log_path) as srv:   # free port, start, wait for /health
        srv.base_url, srv.model                    # http://127.0.0.1:PORT, the served model
    # exit: SIGINT (pdserve serve then shuts down its workers and the Ray it started), wait; SIGTERM and
    # at last SIGKILL only if it does not exit in time -- always the child's own pid, nothing else

    spec_variants(paths, ["pools.colocated.max_num_batched_tokens=256,512"], tmp_dir) -> [SpecVariant]

A variant is a copy of a spec YAML with dotted keys set, written under `tmp_dir`; a spec lacking the
first key of a `--set` (e.g. `pools.colocated` in a disaggregated spec) is left as it is, so one sweep
flag tunes the colocated baseline of a `--compare` without touching the other spec.
"""
from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml


class BenchServerError(RuntimeError):
    """The server under test did not start, or answered /health with an error; the log tail says why."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    """The server's environment: this one, usage stats off. Its private local Ray sets up loopback and a
    per-cluster token itself (cluster/ray_session.py)."""
    env = dict(os.environ)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


def wait_ready(base_url: str, timeout_s: float, alive=lambda: True, api_key: str | None = None) -> str:
    """Poll /health until it answers 200, then return the first model /v1/models lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    end = time.monotonic() + timeout_s
    with httpx.Client(base_url=base_url, timeout=5.0, headers=headers) as c:
        while True:
            if not alive():
                raise BenchServerError(f"{base_url}: the server exited before it was ready")
            try:
                if c.get("/health").status_code == 200:
                    return c.get("/v1/models").json()["data"][0]["id"]
            except httpx.HTTPError:
                pass
            if time.monotonic() > end:
                raise BenchServerError(f"{base_url}: no healthy answer within {timeout_s:g} s")
            time.sleep(0.5)


class SpecServer:
    def __init__(self, spec_path: str | Path, log_path: str | Path, start_timeout_s: float = 600.0,
                 stop_timeout_s: float = 60.0):
        self.spec_path, self.log_path = str(spec_path), Path(log_path)
        self.start_timeout_s, self.stop_timeout_s = start_timeout_s, stop_timeout_s
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.model: str | None = None
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> "SpecServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("w")
        cmd = [sys.executable, "-m", "cluster.cli", "serve", self.spec_path, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=child_env(),
                                     stdin=subprocess.DEVNULL)
        try:
            self.model = wait_ready(self.base_url, self.start_timeout_s, lambda: self.proc.poll() is None)
        except BaseException as e:
            self.stop()
            if isinstance(e, BenchServerError):
                raise BenchServerError(f"{e}\n--- {self.log_path} (tail) ---\n{self.log_tail()}") from None
            raise
        return self

    def stop(self) -> int | None:
        """SIGINT and wait (pdserve serve shuts down what it started); escalate only on a timeout."""
        if self.proc is None:
            return None
        for sig, wait_s in ((signal.SIGINT, self.stop_timeout_s), (signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            self.proc.send_signal(sig)
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        rc = self.proc.poll()
        if self._log is not None:
            self._log.close()
            self._log = None
        return rc

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def __enter__(self) -> "SpecServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- --set sweeps -----------------------------------------------------------------------------
@dataclass
class SpecVariant:
    path: str  # the file to serve (the original when nothing is set)
    source: str  # the spec it came from
    label: str  # e.g. "colocated[max_num_batched_tokens=256]"
    settings: dict[str, object] = field(default_factory=dict)


def parse_sets(items: list[str]) -> list[tuple[str, list[object]]]:
    out = []
    for item in items:
        key, eq, values = item.partition("=")
        if not eq or not key or not values:
            raise ValueError(f"--set expects dotted.key=v1,v2,..., got {item!r}")
        out.append((key.strip(), [yaml.safe_load(v) for v in values.split(",")]))
    return out


def _has_path(doc: dict, keys: list[str]) -> bool:
    node = doc
    for k in keys[:-1]:
        if not isinstance(node, dict) or k not in node:
            return False
        node = node[k]
    return isinstance(node, dict)


def spec_variants(paths: list[str], sets: list[str], tmp_dir: Path) -> list[list[SpecVariant]]:
    """Per spec, its variants: the cross product of every `--set` it has the key of (else itself)."""
    parsed = parse_sets(sets)
    out = []
    for path in paths:
        doc = yaml.safe_load(Path(path).read_text())
        base = Path(path).stem
        mine = [(k, vs) for k, vs in parsed if _has_path(doc, k.split("."))]
        if not mine:
            out.append([SpecVariant(str(path), str(path), base)])
            continue
        variants = []
        for combo in itertools.product(*(vs for _, vs in mine)):
            settings = {k: v for (k, _), v in zip(mine, combo)}
            copy = yaml.safe_load(Path(path).read_text())
            for k, v in settings.items():
                node = copy
                *parents, last = k.split(".")
                for p in parents:
                    node = node[p]
                node[last] = v
            tag = ",".join(f"{k.split('.')[-1]}={v}" for k, v in settings.items())
            file = tmp_dir / f"{base}[{tag}].yaml"
            file.write_text(yaml.safe_dump(copy, sort_keys=False))
            variants.append(SpecVariant(str(file), str(path), f"{base}[{tag}]", settings))
        out.append(variants)
    return out
