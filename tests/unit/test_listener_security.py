"""Every listener of ours binds loopback by default, and a wider bind without auth refuses to start (issue 8,
security): the HTTP frontend (`cluster/server.py`: `BackgroundServer`, `serve_backend` and `_config`, the
path `cluster/launch.py` takes) raises `InsecureBindError` naming `api_key` before any socket opens; the KV
receiver (`kv_transfer.config.check_bind`, called by `KVReceiver.serve` before its port opens) raises
`TransferConfigError` naming `auth_token`; the spec refuses both at validation, for IPv4, IPv6 and host
names alike. With auth, a wide bind starts, and the key is required. No model, no Ray, no gRPC."""
from __future__ import annotations

import inspect

import httpx
import pytest

from cluster import server as http_server
from cluster.serving_api import BackendStats
from cluster.spec import ClusterSpec, SpecError, parse_spec
from kv_transfer.config import ReceiverConfig, check_bind
from kv_transfer.contract import TransferConfigError

WIDE = ["0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "fe80::1", "pdserve.example.com"]
LOOPBACK = ["127.0.0.1", "::1", "localhost"]
BASE = {"model": "m", "pools": {"prefill": {}, "decode": {}}}


class _Backend:
    """The least a `ServingBackend` needs for /v1/models and /health."""
    model_name = "tiny"

    async def stats(self):
        return BackendStats(queued=0, running=0)


def test_every_listener_defaults_to_loopback():
    for fn in (http_server.BackgroundServer.__init__, http_server.serve_backend):
        assert inspect.signature(fn).parameters["host"].default == "127.0.0.1", fn
    assert ReceiverConfig().host == "127.0.0.1"
    spec = parse_spec(BASE)
    assert spec.server.host == "127.0.0.1" and spec.kv_transfer.host == "127.0.0.1"
    assert ClusterSpec.model_fields["server"].default_factory().host == "127.0.0.1"


@pytest.mark.parametrize("host", WIDE)
def test_http_wide_bind_without_api_key_refuses_before_a_socket_opens(host, monkeypatch):
    def no_socket(*a, **k):
        raise AssertionError("a socket was opened before the bind was checked")
    monkeypatch.setattr(http_server.socket, "socket", no_socket)
    for start in (lambda: http_server.BackgroundServer(_Backend(), host=host),
                  lambda: http_server.serve_backend(_Backend(), host=host, port=1),
                  lambda: http_server._config(_Backend(), host, 1, None, 1024, "warning"),
                  lambda: http_server.BackgroundServer(_Backend(), host=host, api_key="")):  # empty is no key
        with pytest.raises(http_server.InsecureBindError) as err:
            start()
        assert err.value.field == "api_key" and "api_key" in str(err.value) and host in str(err.value)


@pytest.mark.parametrize("host", LOOPBACK[:1])
def test_http_loopback_needs_no_key(host):
    with http_server.BackgroundServer(_Backend(), host=host) as srv:
        assert httpx.get(srv.base_url + "/v1/models", timeout=10).json()["data"][0]["id"] == "tiny"


def test_http_wide_bind_with_an_api_key_starts_and_demands_it():
    with http_server.BackgroundServer(_Backend(), host="0.0.0.0", api_key="k-123") as srv:
        url = f"http://127.0.0.1:{srv.port}/v1/models"
        assert httpx.get(url, timeout=10).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer k-123"}, timeout=10).status_code == 200


@pytest.mark.parametrize("host", WIDE)
def test_kv_wide_bind_without_token_names_auth_token(host):
    with pytest.raises(TransferConfigError) as err:
        check_bind(host, None)
    assert err.value.field == "auth_token" and "auth token" in str(err.value)
    check_bind(host, "a-token")  # with a token it may listen


@pytest.mark.parametrize("host", LOOPBACK)
def test_kv_loopback_needs_no_token(host):
    check_bind(host, None)


@pytest.mark.parametrize("host", WIDE)
@pytest.mark.parametrize("section,key", [("server", "api_key"), ("kv_transfer", "auth_token")])
def test_spec_wide_bind_without_auth_is_refused(host, section, key):
    with pytest.raises(SpecError) as err:
        parse_spec({**BASE, section: {"host": host}})
    assert [p.key for p in err.value.problems] == [f"{section}.{key}"], str(err.value)
    assert "not loopback" in str(err.value)
    ok = parse_spec({**BASE, section: {"host": host, key: {"env": "SOME_SECRET"}}})
    assert getattr(ok, section).host == host
