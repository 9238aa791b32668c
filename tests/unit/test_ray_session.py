"""What starting a private local Ray sets up before Ray runs (cluster/ray_session.py), without Ray: the
environment Ray's processes inherit, the per-cluster token file, and undoing both at shutdown. (The
cluster itself, its sockets and their refusals: tests/integration/test_ray_lockdown.py.)"""
from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from cluster import ray_session as rs

KEYS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", rs.LOOPBACK_ENV, *rs.UNUSED_OFF)


@pytest.fixture
def clean_env(monkeypatch):
    for key in KEYS:
        monkeypatch.delenv(key, raising=False)


def test_default_is_token_auth_with_a_private_0600_token_file_removed_at_shutdown(clean_env):
    state = rs._prepare_local()
    path = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
    try:
        assert os.environ["RAY_AUTH_MODE"] == "token" and os.environ[rs.LOOPBACK_ENV] == "0"
        assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0" and os.environ["RAY_enable_metrics_collection"] == "0"
        assert path.parent == state.token_dir and path.name == "auth_token"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        token = path.read_text()
        assert len(token) == 64 and int(token, 16) >= 0
    finally:
        state.restore()
    assert not path.exists() and not path.parent.exists()
    assert not any(key in os.environ for key in KEYS)


def test_every_cluster_gets_its_own_token(clean_env):
    first = rs._prepare_local()
    a = Path(os.environ["RAY_AUTH_TOKEN_PATH"]).read_text()
    first.restore()
    second = rs._prepare_local()
    b = Path(os.environ["RAY_AUTH_TOKEN_PATH"]).read_text()
    second.restore()
    assert a != b


@pytest.mark.parametrize("source", ["RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"])
def test_a_token_the_user_set_is_used_instead_of_a_generated_one(clean_env, monkeypatch, tmp_path, source):
    monkeypatch.setenv(source, str(tmp_path / "their-token") if source.endswith("PATH") else "their-token")
    state = rs._prepare_local()
    try:
        assert state.token_dir is None and os.environ["RAY_AUTH_MODE"] == "token"
        assert os.environ.get("RAY_AUTH_TOKEN_PATH") == (str(tmp_path / "their-token") if source.endswith("PATH")
                                                          else None)
    finally:
        state.restore()
    assert os.environ[source] and "RAY_AUTH_MODE" not in os.environ


def test_auth_disabled_by_the_user_is_honoured_with_a_warning(clean_env, monkeypatch, caplog):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with caplog.at_level(logging.WARNING, logger="pdserve.ray"):
        state = rs._prepare_local()
    try:
        assert os.environ["RAY_AUTH_MODE"] == "disabled" and state.token_dir is None
        assert "RAY_AUTH_TOKEN_PATH" not in os.environ and os.environ[rs.LOOPBACK_ENV] == "0"
        assert any("RAY_AUTH_MODE=disabled" in r.getMessage() for r in caplog.records)
    finally:
        state.restore()
    assert os.environ["RAY_AUTH_MODE"] == "disabled"


def test_settings_the_user_chose_are_kept(clean_env, monkeypatch):
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "1")
    monkeypatch.setenv(rs.LOOPBACK_ENV, "1")  # a private Ray is loopback regardless: forced, then put back
    state = rs._prepare_local()
    try:
        assert os.environ["RAY_USAGE_STATS_ENABLED"] == "1" and os.environ[rs.LOOPBACK_ENV] == "0"
    finally:
        state.restore()
    assert os.environ[rs.LOOPBACK_ENV] == "1"


@pytest.mark.parametrize("host,expected", [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True),
                                           ("::ffff:127.0.0.1", True), ("localhost", True),
                                           ("192.0.2.2", False), ("0.0.0.0", False), ("::", False)])
def test_loopback_check(host, expected):
    assert rs._is_loopback(host) is expected
