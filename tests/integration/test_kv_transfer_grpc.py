"""The KV plane over real gRPC on loopback, with tiny models: round trip, every failure as its status code,
bearer-token auth, TLS and mutual TLS, size caps and per-call deadlines. Each test ends leak-free."""
from __future__ import annotations

import shutil
import subprocess
import threading

import pytest

from engine import SamplingParams
from engine.llm import LLM
from kv_transfer.config import ReceiverConfig, SenderConfig, TLSConfig
from kv_transfer.contract import (DataLoss, DeadlineExceeded, ErrorCode, FailedPrecondition, PermissionDenied,
                                  ResourceExhausted, TransferConfigError, TransferState, Unauthenticated,
                                  Unavailable, UnknownReservation, make_transport)
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from tests.exactness import assert_greedy_equal
from tests.kv_helpers import close_all, decode_all, drive, hand_frames, prefill_held, wire
from tests.prompts import COUNT, MIXED, SHORT

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [COUNT, SHORT, MIXED]


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return [o.token_ids for o in LLM(model=str(tiny_dir), dtype="float32", num_pages=64).generate(PROMPTS, GREEDY)]


class Pair:
    def __init__(self, tiny_dir, rx_config=None, tx_config=None):
        self.pre = LLM(model=str(tiny_dir), dtype="float32", num_pages=64, page_size=4, max_num_batched_tokens=16)
        self.dec = LLM(model=str(tiny_dir), dtype="float32", num_pages=64, page_size=8)
        self.rx_transport, self.tx_transport = make_transport("grpc"), make_transport("grpc")
        self.rx = KVReceiver(self.dec, rx_config or ReceiverConfig())
        self.address = self.rx.serve(self.rx_transport)
        self.tx_config = tx_config or SenderConfig(chunk_bytes=1024)
        self.tx = KVSender(self.pre, self.tx_transport, self.tx_config)

    def push(self, frames, config=None):
        return self.tx_transport.push(self.address, iter(wire(frames)), config or self.tx_config)

    def close(self):
        for rid in list(self.pre.scheduler.held):
            self.pre.release_held(rid)
        close_all(self.tx, self.rx, self.tx_transport, [self.pre, self.dec])


def test_round_trip_over_grpc_is_greedy_equal(tiny_dir, reference):
    p = Pair(tiny_dir, ReceiverConfig(auth_token="tok"), SenderConfig(chunk_bytes=1024, auth_token="tok"))
    assert p.address.startswith("127.0.0.1:")
    descs = [p.rx.reserve(len(x), GREEDY) for x in PROMPTS]
    for d, x in zip(descs, PROMPTS):
        p.tx.send(p.pre.add_request(x, GREEDY, prefill_only=True), d, p.address)
    got = decode_all(p.dec, [d.request_id for d in descs], drive(p.tx, p.rx))
    assert_greedy_equal(reference, got)
    assert all(p.rx.status(d.reservation_id).state == TransferState.DONE for d in descs)
    p.close()


def test_failures_map_to_grpc_status_codes(tiny_dir):
    p = Pair(tiny_dir, ReceiverConfig(auth_token="tok", max_chunk_bytes=2048),
             SenderConfig(chunk_bytes=1024, auth_token="tok"))
    desc = p.rx.reserve(len(PROMPTS[0]), GREEDY)
    rid, frames = _held(p, desc)
    with pytest.raises(Unauthenticated):
        p.push(frames, SenderConfig(auth_token="tok!"))
    with pytest.raises(Unauthenticated):
        p.push(frames, SenderConfig(token_env="PDSERVE_NO_SUCH_VAR"))
    bogus = [_reopen(frames[0], reservation_id="0" * 16)] + frames[1:]
    with pytest.raises(UnknownReservation):
        p.push(bogus)
    with pytest.raises(PermissionDenied):
        p.push([_reopen(frames[0], nonce="x")] + frames[1:])
    assert p.rx.status(desc.reservation_id).state == TransferState.PENDING  # none of that touched it
    corrupt = [f for f in frames]
    corrupt[2] = _copy(frames[2])
    corrupt[2].chunk.checksum ^= 1
    with pytest.raises(DataLoss):
        p.push(corrupt)
    assert p.rx.status(desc.reservation_id).code == ErrorCode.DATA_LOSS
    with pytest.raises(FailedPrecondition, match="already ended"):
        p.push(frames)  # late: the transfer already failed
    p.rx.pump()
    desc2 = p.rx.reserve(len(PROMPTS[0]), GREEDY)
    big = hand_frames(p.pre, rid, frames[-1].finish.first_token_id, desc2, chunk_bytes=4096)
    with pytest.raises(ResourceExhausted):  # 4 KiB chunks over a 2 KiB chunk cap
        p.push(big)
    p.rx.pump()
    assert p.rx.status(desc2.reservation_id).code == ErrorCode.RESOURCE_EXHAUSTED
    p.close()


def test_message_over_the_grpc_cap_is_resource_exhausted(tiny_dir):
    p = Pair(tiny_dir, ReceiverConfig(max_chunk_bytes=1024, max_message_bytes=2048),
             SenderConfig(chunk_bytes=8192))
    desc = p.rx.reserve(len(PROMPTS[0]), GREEDY)
    _, frames = _held(p, desc, chunk_bytes=8192)
    with pytest.raises(ResourceExhausted):
        p.push(frames)
    _settle(p, desc)
    assert p.rx.status(desc.reservation_id).state == TransferState.FAILED
    p.close()


def test_per_call_deadline_ends_a_stalled_push(tiny_dir):
    p = Pair(tiny_dir)
    desc = p.rx.reserve(len(PROMPTS[0]), GREEDY)
    _, frames = _held(p, desc)
    release = threading.Event()

    def stalled():
        yield from wire(frames[:3])
        release.wait(10)  # the sender stalls mid-stream

    with pytest.raises(DeadlineExceeded):
        p.tx_transport.push(p.address, stalled(), SenderConfig(call_timeout_s=0.3))
    release.set()
    _settle(p, desc)
    assert p.rx.status(desc.reservation_id).state == TransferState.FAILED  # the broken stream ended it
    p.close()


def test_bind_beyond_loopback_needs_a_token(tiny_dir, monkeypatch):
    monkeypatch.delenv("PDSERVE_KV_TOKEN", raising=False)
    dec = LLM(model=str(tiny_dir), dtype="float32", num_pages=16)
    with pytest.raises(TransferConfigError, match="auth token"):
        KVReceiver(dec, ReceiverConfig(host="0.0.0.0")).serve(make_transport("grpc"))
    monkeypatch.setenv("PDSERVE_KV_TOKEN", "env-token")
    rx = KVReceiver(dec, ReceiverConfig(host="0.0.0.0"))
    port = rx.serve(make_transport("grpc")).rsplit(":", 1)[1]
    client = make_transport("grpc")
    with pytest.raises(UnknownReservation):  # reachable, and the env token authenticates the client
        client.push(f"127.0.0.1:{port}", iter(_bogus_open()), SenderConfig())
    monkeypatch.delenv("PDSERVE_KV_TOKEN")
    with pytest.raises(Unauthenticated):
        client.push(f"127.0.0.1:{port}", iter(_bogus_open()), SenderConfig())
    client.close()
    close_all(rx=rx, llms=[dec])


# ---- TLS -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available")
    d = tmp_path_factory.mktemp("certs")

    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=pdserve-test-ca")
    for name, san in (("server", "DNS:localhost,IP:127.0.0.1"), ("client", "DNS:client")):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext")
    return {k: str(d / k) for k in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


@pytest.mark.parametrize("mutual", [False, True])
def test_tls_and_mutual_tls(tiny_dir, reference, certs, mutual):
    server_tls = TLSConfig(certs["server.pem"], certs["server.key"], certs["ca.pem"] if mutual else None)
    client_tls = TLSConfig(certs["client.pem"] if mutual else None, certs["client.key"] if mutual else None,
                           certs["ca.pem"])
    p = Pair(tiny_dir, ReceiverConfig(tls=server_tls), SenderConfig(chunk_bytes=1024, tls=client_tls))
    desc = p.rx.reserve(len(PROMPTS[0]), GREEDY)
    rid, frames = _held(p, desc)
    with pytest.raises(Unavailable):  # plaintext to a TLS port
        p.push(frames, SenderConfig(call_timeout_s=5))
    if mutual:  # TLS without a client certificate
        with pytest.raises(Unavailable):
            p.push(frames, SenderConfig(call_timeout_s=5, tls=TLSConfig(ca_file=certs["ca.pem"])))
    assert p.push(frames).state == "done"
    p.pre.release_held(rid)
    assert p.rx.pump() == [desc.request_id]
    assert_greedy_equal(reference[:1], decode_all(p.dec, [desc.request_id], []))
    p.close()


# ---- helpers ---------------------------------------------------------------------------------------
def _held(p: Pair, desc, chunk_bytes: int = 1024):
    rid, first = prefill_held(p.pre, PROMPTS[0], GREEDY)
    return rid, hand_frames(p.pre, rid, first, desc, chunk_bytes)


def _copy(frame):
    return type(frame).FromString(frame.SerializeToString())


def _reopen(frame, **fields):
    f = _copy(frame)
    for k, v in fields.items():
        setattr(f.open, k, v)
    return f


def _bogus_open():
    from kv_transfer import kv_transfer_pb2 as pb

    return [pb.Frame(open=pb.Open(reservation_id="0" * 16)).SerializeToString()]


def _settle(p: Pair, desc, timeout_s: float = 10.0) -> None:
    """Wait for the server thread to record the broken stream, then free the pages."""
    import time

    end = time.monotonic() + timeout_s
    while p.rx.status(desc.reservation_id).state != TransferState.FAILED:
        assert time.monotonic() < end, p.rx.status(desc.reservation_id)
        time.sleep(0.01)
    p.rx.pump()
