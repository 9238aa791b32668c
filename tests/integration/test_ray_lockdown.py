"""Acceptance (issue 22): the local Ray that `pdserve serve` starts exposes nothing unauthenticated beyond
loopback, and nothing but read-only metrics without its token even there.

A tiny-model disaggregated cluster is started the way `pdserve serve` starts one (`start_cluster`,
`ray.address: local`), after ray was imported with the default "any interface" setting (a user program
that imported ray first; the hardest case for pdserve's loopback setting). Then every LISTEN socket of
this process and its descendants (Ray's GCS, raylet, agents, monitor, dashboard head, the workers; psutil)
is audited:
- each is bound to a loopback address;
- each gRPC server of Ray refuses a call without the token (UNAUTHENTICATED, none answers OK) and, where a
  harmless method exists, takes the same call with it (so the refusal is about the token);
- each HTTP server of Ray answers 401 without the token and not 401 with it, except the two Prometheus
  endpoints `ray.init` cannot turn off (the autoscaler monitor's and the dashboard head's), which must
  belong to those processes and refuse to change anything (POST is not served);
- pdserve's own listener (the decode worker's KV receiver) is the only other one.
The token file is 0600 in a 0700 directory while the cluster runs and gone after shutdown, with the
environment and Ray's bind setting put back. One request runs through the cluster under token auth.
"""
from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import stat

import grpc
import psutil
import pytest

from cluster import ray_session
from cluster.serving.ray_pools import start_cluster
from cluster.serving_api import GenerateRequest
from engine import SamplingParams
from tests.cluster_helpers import assert_cluster_empty, tiny_ray_spec

pytestmark = pytest.mark.slow
# One harmless method per Ray gRPC service (server: method); empty bytes are a valid empty request.
# ObjectManagerService has only Push/Pull: it is called without the token only.
PROBES = {"gcs": "/ray.rpc.NodeInfoGcsService/CheckAlive",
          "raylet": "/ray.rpc.NodeManagerService/GetSystemConfig",
          "object manager": "/ray.rpc.ObjectManagerService/Pull",
          "core worker": "/ray.rpc.CoreWorkerService/NumPendingTasks",
          "dashboard agent": "/ray.rpc.ReporterService/HealthCheck"}
METRICS_OWNERS = ("autoscaler/_private/monitor.py", "dashboard/dashboard.py")


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    return addr.is_loopback or bool(addr.version == 6 and addr.ipv4_mapped and addr.ipv4_mapped.is_loopback)


def _http(port: int, method: str = "GET", token: str | None = None) -> bytes | None:
    """The status line of a plain HTTP/1.0 request, or None if the server does not speak HTTP/1 (gRPC)."""
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"{method} /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n{auth}\r\n".encode())
        reply = b""
        while b"\r\n" not in reply:
            chunk = s.recv(256)
            if not chunk:
                break
            reply += chunk
    return reply.split(b"\r\n", 1)[0] if reply.startswith(b"HTTP/1.") else None


def _grpc(port: int, token: str | None = None, skip=()) -> dict[str, str]:
    """Status code name of each probe method on this port, called with or without the token."""
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    out = {}
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        for server, method in PROBES.items():
            if server in skip:
                continue
            try:
                channel.unary_unary(method)(b"", timeout=10, metadata=metadata)
                out[server] = "OK"
            except grpc.RpcError as e:
                out[server] = e.code().name
    return out


def _listeners() -> list[tuple[psutil.Process, str, int]]:
    me = psutil.Process()
    procs = {p.pid: p for p in [me, *me.children(recursive=True)]}
    return [(procs[c.pid], c.laddr.ip, c.laddr.port) for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.pid in procs]


def _audit(listeners, token: str, kv_ports: set[int]) -> list[str]:
    """One line per listener (the table docs/security.md states); fails on the first exposed one."""
    rows, metrics = [], []
    for proc, ip, port in sorted(listeners, key=lambda x: (x[0].pid, x[2])):
        name, cmd = proc.name(), " ".join(proc.cmdline())
        assert _loopback(ip), f"{name} (pid {proc.pid}) listens on {ip}:{port}: beyond loopback"
        if port in kv_ports:
            rows.append(f"{name} {ip}:{port} pdserve KV receiver (pdserve's own rules)")
            continue
        status = _http(port)
        if status is None:  # gRPC
            without = _grpc(port)
            refused = [s for s, code in without.items() if code == "UNAUTHENTICATED"]
            assert refused and "OK" not in without.values(), f"{name} :{port} without token: {without}"
            with_token = _grpc(port, token, skip=("object manager",))
            assert all(with_token.get(s, "OK") == "OK" for s in refused if s != "object manager"), \
                f"{name} :{port} refuses the cluster's own token: {with_token}"
            rows.append(f"{name} {ip}:{port} gRPC {'/'.join(refused)}: UNAUTHENTICATED without the token")
        elif b" 401 " in status + b" ":
            with_token = _http(port, token=token)
            assert b" 401" not in with_token, f"{name} :{port} refuses the cluster's own token: {with_token}"
            rows.append(f"{name} {ip}:{port} HTTP: 401 without the token")
        else:
            assert any(owner in cmd for owner in METRICS_OWNERS), f"{name} :{port} answers {status} without token"
            post = _http(port, method="POST")
            assert post is None or b" 200" not in post, f"{name} :{port} serves POST: {post}"
            metrics.append(port)
            rows.append(f"{name} {ip}:{port} HTTP metrics, read-only: GET {status.decode()}, POST {post!r}")
    assert len(metrics) <= len(METRICS_OWNERS), rows
    return rows


def test_local_ray_listens_on_loopback_only_and_refuses_callers_without_the_token(tiny_dir, monkeypatch):
    import ray
    from ray._private import ray_constants

    assert not ray.is_initialized(), "another test left Ray connected"
    saved_env = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH", ray_session.LOOPBACK_ENV)}
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", True)  # as if ray was imported with no setting
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    spec = tiny_ray_spec(tiny_dir)
    router = start_cluster(spec, num_cpus=2)
    path = ray_session.token_path()

    async def main():
        try:
            assert os.environ["RAY_AUTH_MODE"] == "token" and os.environ["RAY_AUTH_TOKEN_PATH"] == str(path)
            assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == os.getuid()
            assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
            token = path.read_text()
            assert len(token) == 64 and int(token, 16) >= 0  # 256 random bits, hex
            kv_ports = {int(w.handle.info["address"].rsplit(":", 1)[1]) for w in router.workers["decode"]}
            rows = _audit(_listeners(), token, kv_ports)
            print("\n".join(["listeners of the local Ray:", *rows]))
            assert any("gcs_server" in r for r in rows) and any("raylet" in r for r in rows), rows
            params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
            req = GenerateRequest("r0", [5, 9, 33, 7], params, model=router.model_name)
            deltas = [d async for d in router.generate(req)]
            assert deltas[-1].finished and sum(len(d.new_token_ids) for d in deltas) == 4
            await assert_cluster_empty(router)
        finally:
            await router.shutdown()
    asyncio.run(main())
    assert not ray.is_initialized()
    assert not path.exists() and not path.parent.exists(), "the token file outlived its cluster"
    assert {k: os.environ.get(k) for k in saved_env} == saved_env
    assert ray_constants.ENABLE_RAY_CLUSTER is True  # put back as it was found


def test_a_local_ray_is_always_new_even_while_another_cluster_is_recorded_as_current():
    """`ray.address: local` never joins a cluster that `ray start` (here `ray.cluster_utils.Cluster`) recorded
    as this machine's current one: that is someone else's Ray, its token and its workers."""
    import ray

    from tests.cluster_helpers import ADDRESS_FILE, ray_test_cluster

    with ray_test_cluster({}) as (other, _):
        assert ADDRESS_FILE.is_file()  # what a plain ray.init() would join
        assert ray_session.init_ray("local", num_cpus=1)
        try:
            mine = ray.get_runtime_context().gcs_address
            assert mine != other.address, f"joined the other cluster at {other.address}"
            assert ray.cluster_resources().get("CPU") == 1
        finally:
            ray_session.shutdown_ray()
