"""Acceptance: pdserve as a Ray job. This test starts its own Ray head (`ray start --head --block` in a new
session, GCS and dashboard on 127.0.0.1, Ray token auth on with a token file of its own, its own temp dir and
ports), submits `python -m cluster.launch deploy/local.yaml --self-test ...` with the real `ray job submit`
CLI (the token from its environment) and the repo as working dir, and expects the job to succeed and print a
non-empty completion. The job's pdserve joins the cluster with the token the job inherits; the Jobs API
refuses a caller without it.

Order: token file -> free ports -> `ray start --head --block` -> wait until the dashboard's job API answers
(with the token; 401 without) -> `ray job submit` (blocks, tails the job's output, exits non-zero if the job
fails) -> check the output and the unpacked working dir (.gitignore'd .venv and bench/out stay behind; .git
is excluded explicitly) -> SIGTERM the blocking `ray start`, which takes down every process it spawned;
anything left in its session (only ours: `start_new_session`) is killed by pid. `ray stop` is never run: it
kills every Ray on the machine.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
RAY = Path(sys.executable).with_name("ray")  # the venv's CLI, next to its python
PROMPT = "The capital of France is"
ENV = {"RAY_AUTH_MODE": "token", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str, token: str | None = None) -> int | None:
    """The HTTP status of a GET (None: nothing answers)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _session_pids(sid: int) -> list[int]:
    """Live processes of session `sid` (field 6 of /proc/PID/stat), i.e. what our `ray start` spawned."""
    pids = []
    for p in Path("/proc").iterdir():
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if p.name.isdigit() and int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(p.name))
    return pids


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # it ended on its own meanwhile
            os.kill(pid, sig)


def _wait_gone(sid: int, timeout_s: float) -> list[int]:
    end = time.monotonic() + timeout_s
    while (left := _session_pids(sid)) and time.monotonic() < end:
        time.sleep(0.1)  # (a short poll: the processes usually go within a second of the signal)
    return left


def _stop(head: subprocess.Popen) -> list[int]:
    """SIGTERM the blocking `ray start` (it stops the Ray processes it spawned), then SIGTERM and at last
    SIGKILL whatever is left of its session, by pid. Returns what is still alive after that (nothing)."""
    if head.poll() is None:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(10)
    _signal(_session_pids(head.pid), signal.SIGTERM)
    _signal(_wait_gone(head.pid, 20), signal.SIGKILL)
    return _wait_gone(head.pid, 10)


@pytest.fixture
def ray_head():
    """(dashboard URL, env for the CLI, temp dir) of a Ray head this test owns."""
    temp = Path(tempfile.mkdtemp(prefix="pdray-"))  # short: Ray's unix sockets live under it (108-byte cap)
    token = secrets.token_hex(32)
    (temp / "ray_token").write_text(token)  # in a 0700 dir (mkdtemp), itself 0600
    (temp / "ray_token").chmod(0o600)
    dash = free_port()
    env = {**os.environ, **ENV, "RAY_AUTH_TOKEN_PATH": str(temp / "ray_token")}
    for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN"):
        env.pop(key, None)
    cmd = [str(RAY), "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
           "--port", str(free_port()), "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
           "--dashboard-port", str(dash), "--dashboard-agent-listen-port", str(free_port()),
           "--ray-client-server-port", str(free_port()), "--temp-dir", str(temp), "--num-cpus", "4",
           "--disable-usage-stats"]
    log = open(temp / "head.log", "w")
    head = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dash}"
    try:
        end = time.monotonic() + 120
        while not (_status(f"{url}/api/version", token) == 200 and _status(f"{url}/api/jobs/", token) == 200):
            assert head.poll() is None, f"ray start exited {head.returncode}:\n{(temp / 'head.log').read_text()}"
            assert time.monotonic() < end, f"no dashboard at {url}:\n{(temp / 'head.log').read_text()}"
            time.sleep(0.2)  # a short poll: the job API answers a few seconds after `ray start`, not on a tick
        assert _status(f"{url}/api/jobs/") == 401, "the Jobs API answers a caller without the token"
        yield url, env, temp
    finally:
        left = _stop(head)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)
    assert not left, f"processes of our Ray head survived SIGKILL: {left}"


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_ray_job_submit_serves_the_self_test(ray_head):
    url, env, temp = ray_head
    cmd = [str(RAY), "job", "submit", "--address", url, "--working-dir", str(REPO),
           "--runtime-env-json", json.dumps({"excludes": [".git"]}), "--",
           sys.executable, "-m", "cluster.launch", "deploy/local.yaml", "--port", str(free_port()),
           "--self-test", PROMPT]
    t0 = time.monotonic()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    took = time.monotonic() - t0
    assert out.returncode == 0, f"ray job submit exited {out.returncode} after {took:.0f} s:\n{text[-6000:]}"
    assert "succeeded" in text, text[-3000:]
    m = re.search(r"pdserve self-test: (['\"])(.+?)\1 \(", text)
    assert m and m.group(2).strip(), f"no non-empty self-test completion in the job output:\n{text[-3000:]}"

    # the working dir the job ran in: the repo's sources, without the venv, build outputs or .git
    files = temp / "session_latest" / "runtime_resources" / "working_dir_files"
    unpacked = [p for p in files.glob("_ray_pkg_*") if p.is_dir()]
    assert len(unpacked) == 1, unpacked
    pkg = unpacked[0]
    assert (pkg / "cluster" / "launch.py").is_file() and (pkg / "deploy" / "local.yaml").is_file()
    for ignored in (".venv", ".git", "bench/out", "pdserve.egg-info"):
        assert not (pkg / ignored).exists(), f"{ignored} was uploaded with the working dir"
    size = _dir_bytes(pkg)
    # The cap catches a venv or model cache riding along (hundreds of MiB); the repository itself is ~19 MiB
    # since data/ holds the traces and GPU tables (14 MiB, issue 33): 16 MiB was set before data/ existed.
    assert size < 32 << 20, f"working dir upload is {size >> 20} MiB"
    print(f"self-test {m.group(2)!r}; working dir {size / 2**20:.1f} MiB; submit took {took:.0f} s")
