"""Endpoint settings of the KV plane (frozen dataclasses) and the security checks made at start.

`ReceiverConfig` (decode side) and `SenderConfig` (prefill side) carry caps, deadlines, keepalive, the
auth token source and optional TLS. `KVReceiver.serve()` calls `check_bind()` before any port opens:
the receiver binds 127.0.0.1 unless configured, and binding elsewhere without a token is refused. The
token comes from `auth_token` (tests), `token_file` or the environment variable `token_env`, travels
as call metadata and is compared with `hmac.compare_digest` (`check_token`).
"""
from __future__ import annotations

import hmac
import os
from dataclasses import dataclass, field
from pathlib import Path

from kv_transfer.contract import TransferConfigError, Unauthenticated

TOKEN_ENV = "PDSERVE_KV_TOKEN"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})
KiB, MiB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class TLSConfig:
    """PEM paths. Server: cert/key required; `ca_file` makes it demand client certificates (mutual TLS).
    Client: `ca_file` is the CA that signed the server; cert/key are its own (mutual TLS)."""
    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    server_name: str | None = None  # client: the name to check in the server's certificate

    def read(self, name: str) -> bytes | None:
        path = getattr(self, name)
        if path is None:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as e:
            raise TransferConfigError(f"tls.{name}", f"cannot read {path}: {e}") from None


@dataclass(frozen=True)
class Keepalive:
    time_ms: int = 30_000  # ping an idle connection this often
    timeout_ms: int = 10_000  # and drop it when a ping is not answered in this long
    permit_without_calls: bool = True
    min_ping_interval_ms: int = 10_000  # server: the most frequent pings it tolerates


@dataclass(frozen=True)
class _Auth:
    auth_token: str | None = None  # literal token (tests); otherwise token_file, then token_env
    token_env: str = TOKEN_ENV
    token_file: str | None = None

    def token(self) -> str | None:
        if self.auth_token:
            return self.auth_token
        if self.token_file:
            try:
                tok = Path(self.token_file).read_text().strip()
            except OSError as e:
                raise TransferConfigError("token_file", f"cannot read {self.token_file}: {e}") from None
            if not tok:
                raise TransferConfigError("token_file", f"{self.token_file} is empty")
            return tok
        return os.environ.get(self.token_env) or None


@dataclass(frozen=True)
class ReceiverConfig(_Auth):
    host: str = "127.0.0.1"
    port: int = 0  # 0: an ephemeral port (the server reports its address)
    tls: TLSConfig | None = None
    max_chunk_bytes: int = 1 * MiB  # larger chunks get RESOURCE_EXHAUSTED
    max_message_bytes: int = 1 * MiB + 64 * KiB  # transport cap on one frame (chunk + header)
    stream_bytes_factor: float = 2.0  # payload bytes a transfer may receive, as a multiple of its size
    max_streams: int = 8  # concurrent pushes (server threads)
    keepalive: Keepalive = field(default_factory=Keepalive)
    # Decode priority: cap on the receive rate while the decode loop is inside `KVReceiver.step()`, so a
    # burst of KV (a cache shipped after its prefill) cannot take the CPU from decode steps. None: no cap.
    # KV streamed during a prefill arrives at prefill speed (~20 MB/s for SmolLM2 bf16) and is not held up.
    paced_bytes_per_s: int | None = None

    def __post_init__(self) -> None:
        if self.paced_bytes_per_s is not None and self.paced_bytes_per_s < 1 * MiB:
            raise TransferConfigError("paced_bytes_per_s", "must be >= 1 MiB/s (or None)")
        if not 1 * KiB <= self.max_chunk_bytes <= 64 * MiB:
            raise TransferConfigError("max_chunk_bytes", f"{self.max_chunk_bytes} outside [1 KiB, 64 MiB]")
        if self.max_message_bytes < self.max_chunk_bytes + 1 * KiB:
            raise TransferConfigError("max_message_bytes", "must exceed max_chunk_bytes by at least 1 KiB")
        if self.stream_bytes_factor < 1.0:
            raise TransferConfigError("stream_bytes_factor", "must be >= 1")
        if self.max_streams < 1 or not 0 <= self.port < 65536:
            raise TransferConfigError("max_streams/port", "max_streams >= 1 and 0 <= port < 65536")


@dataclass(frozen=True)
class SenderConfig(_Auth):
    chunk_bytes: int = 512 * KiB  # target chunk payload (256 KiB - 1 MiB on real models)
    call_timeout_s: float = 120.0  # gRPC deadline of one push (wall clock)
    deadline_s: float | None = None  # transfer deadline on the sender's (injectable) clock
    tls: TLSConfig | None = None
    max_message_bytes: int = 1 * MiB + 64 * KiB
    keepalive: Keepalive = field(default_factory=Keepalive)

    def __post_init__(self) -> None:
        if not 1 * KiB <= self.chunk_bytes <= self.max_message_bytes - 1 * KiB:
            raise TransferConfigError("chunk_bytes", f"{self.chunk_bytes} outside [1 KiB, max_message_bytes - 1 KiB]")
        if self.call_timeout_s <= 0:
            raise TransferConfigError("call_timeout_s", "must be > 0")


def check_bind(host: str, token: str | None) -> None:
    """Refuse to listen beyond loopback without an auth token (the error names the missing key)."""
    if host not in LOOPBACK_HOSTS and not token:
        raise TransferConfigError("auth_token", f"binding {host!r} (beyond loopback) needs an auth token: set "
                                                f"${TOKEN_ENV}, token_file or auth_token")


def check_token(expected: str | None, presented: str | None) -> None:
    """Constant-time comparison; no expected token means a loopback-only receiver that needs none."""
    if expected is None:
        return
    if not presented:
        raise Unauthenticated("missing auth token")
    if not hmac.compare_digest(presented.encode(), expected.encode()):
        raise Unauthenticated("bad auth token")
