"""The Ray pdserve runs on: start a private local Ray, or join a cluster; stop what this process started.

    started = init_ray("local", num_cpus)   # True: this call started (or connected) Ray; the caller stops it
    ...
    shutdown_ray()                          # ray.shutdown(); a generated token file removed, env restored

Called by `cluster/actors.py` (`start_cluster`, its teardown) and the integration tests' `ray_session`.

Local (`ray.address: local`) -- reachable over loopback only, and only with a token:
- Loopback. Ray binds its servers (GCS, raylet, object manager, dashboard and runtime-env agents, core
  workers, metrics) to 127.0.0.1 when the node address is loopback, most to every interface otherwise; on
  Linux it makes the address loopback only with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which it reads once,
  when `ray` is first imported (`ray._private.ray_constants.ENABLE_RAY_CLUSTER`). So the variable is set
  before pdserve imports ray; if something imported ray earlier, the constant is set here too (and put
  back at shutdown). After `ray.init` the node address is checked: a Ray not on 127.0.0.1 is shut down
  again and `RayExposedError` raised.
- Token. RAY_AUTH_MODE=token and a fresh 256-bit token per cluster, written to a 0600 file in a 0700
  directory of its own (RAY_AUTH_TOKEN_PATH); Ray's processes inherit both from this process's
  environment, and every Ray gRPC and HTTP server then refuses a caller without the token. A token the
  user set (RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH) is used instead of a generated one. RAY_AUTH_MODE=
  disabled, set by the user, is honoured with a warning. Ray caches the auth mode and token per process
  on first use, so both are re-read before every `ray.init` (a process may start several clusters).
- Off: the dashboard, usage stats, and Ray's own metrics collection (the dashboard agent's Prometheus
  exporter; pdserve's /metrics is its own). Still up, loopback only, because `ray.init` cannot turn them
  off: the dashboard head process (UsageStatsHead only) and the autoscaler monitor, each with a read-only
  Prometheus endpoint (ports 44227 and 44217).

Joining (any other address): Ray's own rules -- RAY_AUTH_MODE and the token come from this process's
environment, as on every node of that cluster; a refused token becomes a `BackendUnavailableError`
that says which variables to set.
"""
from __future__ import annotations

import atexit
import ipaddress
import logging
import os
import secrets
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from cluster.serving_api import BackendUnavailableError
from engine.errors import PdserveError

log = logging.getLogger("pdserve.ray")
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": the node address is 127.0.0.1 (read at import)
TOKEN_ENV, TOKEN_PATH_ENV, MODE_ENV = "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"
# What a private local Ray does not run: usage reports, Ray's metrics exporter (the user may opt back in).
UNUSED_OFF = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_enable_metrics_collection": "0"}


class RayExposedError(PdserveError, RuntimeError):
    """A local Ray came up on an address other than loopback; pdserve shut it down again."""


@dataclass
class _LocalRay:
    """What starting a local Ray changed in this process, to put back at shutdown."""
    saved_env: dict[str, str | None] = field(default_factory=dict)
    token_dir: Path | None = None  # the generated token's private directory (None: no token generated)
    saved_cluster_constant: bool | None = None  # ENABLE_RAY_CLUSTER before it was forced off

    def setenv(self, key: str, value: str) -> None:
        self.saved_env.setdefault(key, os.environ.get(key))
        os.environ[key] = value

    def restore(self) -> None:
        if self.token_dir is not None:
            shutil.rmtree(self.token_dir, ignore_errors=True)
            self.token_dir = None
        for key, value in self.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if self.saved_cluster_constant is not None:
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = self.saved_cluster_constant


_LOCAL: _LocalRay | None = None  # the local Ray this process started (one driver per process)


def init_ray(address: str = "local", num_cpus: float | None = None) -> bool:
    """Start a private local Ray (loopback, token auth) or join `address`; True if this call started or
    connected Ray (the caller then calls `shutdown_ray`), False if this process was already connected."""
    global _LOCAL
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        return False
    if address != "local":
        return _join(address)
    state = _prepare_local()
    try:
        import ray

        reload_ray_auth()
        # address="local": always a new private Ray. Without it ray.init joins whatever `ray start` (or a
        # ray.cluster_utils.Cluster) last recorded on this machine, someone else's cluster and token.
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                 configure_logging=False, log_to_driver=True)
        node_ip = ray.util.get_node_ip_address()
        if not _is_loopback(node_ip):
            raise RayExposedError(f"the local Ray came up on {node_ip}, not 127.0.0.1: it would listen on every "
                                  f"interface; pdserve stopped it (set {LOOPBACK_ENV}=0 before importing ray)")
    except BaseException:
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            sys.modules["ray"].shutdown()
        state.restore()
        raise
    _LOCAL = state
    return True


def shutdown_ray() -> None:
    """Disconnect from Ray (stopping the local Ray this process started) and undo what starting it changed:
    the generated token file and its directory are removed, the environment is put back."""
    global _LOCAL
    import ray

    ray.shutdown()  # first: Ray's processes must be gone before their token file is
    state, _LOCAL = _LOCAL, None
    if state is not None:
        state.restore()


def token_path() -> Path | None:
    """The token file of the local Ray this process started, if pdserve generated it."""
    return _LOCAL.token_dir / "auth_token" if _LOCAL is not None and _LOCAL.token_dir is not None else None


def _prepare_local() -> _LocalRay:
    """Set the environment a private local Ray needs (before ray is imported, where it is not yet)."""
    state = _LocalRay()
    state.setenv(LOOPBACK_ENV, "0")
    for key, value in UNUSED_OFF.items():
        if key not in os.environ:
            state.setenv(key, value)
    mode = os.environ.get(MODE_ENV)
    if mode is not None and mode.lower() != "token":
        if mode.lower() == "disabled":
            log.warning("%s=disabled: the local Ray accepts any caller that can reach its loopback ports, "
                        "including other users of this machine; unset it to get a per-cluster token", MODE_ENV)
        return _force_loopback_constant(state)
    state.setenv(MODE_ENV, "token")
    if not (os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_PATH_ENV)):
        state.token_dir = Path(tempfile.mkdtemp(prefix="pdserve-ray-"))  # 0700, this user's
        atexit.register(shutil.rmtree, state.token_dir, True)  # also if the process ends without shutdown
        path = state.token_dir / "auth_token"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        state.setenv(TOKEN_PATH_ENV, str(path))
    return _force_loopback_constant(state)


def _force_loopback_constant(state: _LocalRay) -> _LocalRay:
    """If ray was imported before LOOPBACK_ENV was set, Ray's constant still says "any interface"."""
    if "ray._private.ray_constants" in sys.modules:
        from ray._private import ray_constants

        if ray_constants.ENABLE_RAY_CLUSTER:
            state.saved_cluster_constant = True
            ray_constants.ENABLE_RAY_CLUSTER = False
    return state


def reload_ray_auth() -> None:
    """Ray caches the auth mode (RayConfig) and the token (its token loader) in a process on first use; a
    cluster started or joined after another one in the same process must read both again (Ray's CLI and
    tests do the same)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _join(address: str) -> bool:
    import ray

    reload_ray_auth()
    try:
        ray.init(address=address, include_dashboard=False)
    except (ray.exceptions.AuthenticationError, ConnectionError) as e:
        # (Ray 2.60 reports a refused token as a ConnectionError caused by one naming InvalidAuthToken)
        chain = [e, e.__cause__, e.__context__]
        if not any("InvalidAuthToken" in str(x) or isinstance(x, ray.exceptions.AuthenticationError)
                   for x in chain if x is not None):
            raise
        raise BackendUnavailableError(
            f"Ray at {address} refused this process's token (missing or not the cluster's); set {MODE_ENV}=token "
            f"and the cluster's token ({TOKEN_PATH_ENV}=<file> or {TOKEN_ENV}) in pdserve's environment, as on "
            "every node") from e
    return True


def _is_loopback(host: str) -> bool:
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)
