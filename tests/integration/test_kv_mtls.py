"""Mutual TLS on the KV data plane with certificates this test generates (`cryptography`, no openssl CLI):
a CA signs the receiver's certificate (SAN 127.0.0.1 / localhost) and a sender's; a second, rogue CA signs
an impostor's. Each row is a sender configuration against one receiver that demands client certificates
and a token (issue 8, security): only the sender with a certificate from the right CA, trusting that CA
for the server's name and presenting the token, gets through; every other row fails with its typed error
and leaves the reservation untouched, so the real transfer then lands and decodes greedy-equal. The spec's
`kv_transfer.tls` reaches both ends' configs (`actors.kv_configs`). Loopback, tiny random Llama."""
from __future__ import annotations

import datetime
import ipaddress

import pytest

from cluster.serving.actors import kv_configs
from cluster.spec import parse_spec
from engine import SamplingParams
from engine.llm import LLM
from kv_transfer.config import ReceiverConfig, SenderConfig, TLSConfig
from kv_transfer.contract import TransferState, Unauthenticated, Unavailable, make_transport
from kv_transfer.receiver import KVReceiver
from tests.exactness import assert_greedy_equal
from tests.kv_helpers import close_all, decode_all, hand_frames, prefill_held, wire

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = list(range(10, 26))
TOKEN = "mtls-token"


def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _cert(subject: str, key, issuer_name: str, issuer_key, ca: bool = False, sans=()):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(d, name: str, cert, key=None) -> None:
    (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        (d / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                          serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """{name: path}: ca, rogue-ca, server (+key), client (+key) from ca, impostor (+key) from rogue-ca."""
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "rogue-ca"):
        k = _key()
        _write(d, ca, _cert(f"pdserve test {ca}", k, f"pdserve test {ca}", k, ca=True), k)
    loaded = {ca: serialization.load_pem_private_key((d / f"{ca}.key").read_bytes(), None)
              for ca in ("ca", "rogue-ca")}
    sans = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
    for name, issuer, san in (("server", "ca", sans), ("client", "ca", [x509.DNSName("prefill-0")]),
                              ("impostor", "rogue-ca", [x509.DNSName("prefill-0")])):
        k = _key()
        _write(d, name, _cert(name, k, f"pdserve test {issuer}", loaded[issuer], sans=san), k)
    return {p.stem + p.suffix.replace(".pem", ""): str(p) for p in d.iterdir()}


@pytest.fixture(scope="module")
def rig(tiny_dir, certs):
    d = tiny_dir
    ref = LLM(model=str(d), dtype="float32", num_pages=32).generate([PROMPT], GREEDY)[0].token_ids
    pre = LLM(model=str(d), dtype="float32", num_pages=32, page_size=4, max_num_batched_tokens=32)
    dec = LLM(model=str(d), dtype="float32", num_pages=32, page_size=8)
    tls = TLSConfig(certs["server"], certs["server.key"], ca_file=certs["ca"])
    rx = KVReceiver(dec, ReceiverConfig(auth_token=TOKEN, tls=tls))
    address = rx.serve(make_transport("grpc"))
    client = make_transport("grpc")
    yield pre, dec, rx, address, client, ref
    client.close()
    close_all(rx=rx, llms=[pre, dec])


def _tls(certs, who: str | None = "client", trust: str = "ca", name: str | None = None) -> TLSConfig:
    cert = (certs[who], certs[f"{who}.key"]) if who else (None, None)
    return TLSConfig(*cert, ca_file=certs[trust], server_name=name)


SENDERS = {  # row: (sender TLS from certs (None: plaintext), token, typed error)
    "plaintext to a TLS port": (lambda c: None, TOKEN, Unavailable),
    "TLS without a client certificate": (lambda c: _tls(c, who=None), TOKEN, Unavailable),
    "client certificate from a rogue CA": (lambda c: _tls(c, who="impostor"), TOKEN, Unavailable),
    "sender trusting a rogue CA": (lambda c: _tls(c, trust="rogue-ca"), TOKEN, Unavailable),
    "server name not in its certificate": (lambda c: _tls(c, name="decode-9.example"), TOKEN, Unavailable),
    "right certificate, wrong token": (lambda c: _tls(c), "not-the-token", Unauthenticated),
    "right certificate, no token": (lambda c: _tls(c), None, Unauthenticated),
}


def _push(rig, frames, tls, token):
    _, _, _, address, client, _ = rig
    config = SenderConfig(chunk_bytes=1024, call_timeout_s=10, tls=tls, auth_token=token,
                          token_env="PDSERVE_TEST_NO_SUCH_VAR")
    return client.push(address, iter(wire(frames)), config)


@pytest.mark.parametrize("name", list(SENDERS))
def test_sender_row_is_refused_and_the_owner_unharmed(rig, certs, name):
    pre, dec, rx, _, _, ref = rig
    make_tls, token, error = SENDERS[name]
    desc = rx.reserve(len(PROMPT), GREEDY)
    rid, first = prefill_held(pre, PROMPT, GREEDY)
    frames = hand_frames(pre, rid, first, desc)
    pre.release_held(rid)
    with pytest.raises(error):
        _push(rig, frames, make_tls(certs), token)
    assert rx.status(desc.reservation_id).state == TransferState.PENDING
    assert _push(rig, frames, _tls(certs), TOKEN).state == "done"  # the real sender, mutual TLS + token
    assert rx.pump() == [desc.request_id]
    assert_greedy_equal([ref], decode_all(dec, [desc.request_id], []))
    assert rx.num_live == 0


def test_spec_tls_reaches_both_ends(certs):
    spec = parse_spec({"model": "m", "pools": {"prefill": {}, "decode": {}},
                       "kv_transfer": {"host": "0.0.0.0", "auth_token": {"env": "PDSERVE_KV_TOKEN"},
                                       "tls": {"cert_file": certs["server"], "key_file": certs["server.key"],
                                               "ca_file": certs["ca"], "server_name": "localhost"}}})
    kv = kv_configs(spec)
    for end in (kv["sender"], kv["receiver"]):
        assert end.tls.ca_file == certs["ca"] and end.tls.cert_file == certs["server"]
        assert end.token_env == "PDSERVE_KV_TOKEN"
    assert kv["receiver"].host == "0.0.0.0" and kv["sender"].tls.server_name == "localhost"
