"""KV transfer between two tiny engines over the in-process fake transport: bit-exact round trips (also
across page sizes and with chunked prefill), layer-wise publishing during the prefill, shipping a prefill
that finished before `send()`, the transport registry, and the start-up security checks."""
from __future__ import annotations

import time

import pytest

from engine import SamplingParams
from engine.llm import LLM
from engine.request import RequestStatus
from kv_transfer.config import ReceiverConfig, SenderConfig, TLSConfig, check_token
from kv_transfer.contract import (TRANSPORTS, TransferConfigError, TransferState, Unauthenticated,
                                  make_transport)
from kv_transfer.fake_transport import FakeTransport
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from tests.exactness import assert_greedy_equal
from tests.kv_helpers import Ends, close_all, decode_all, drive, prefill_held
from tests.prompts import TINY_PROMPTS

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = TINY_PROMPTS


@pytest.fixture(scope="module")
def reference(tiny_dir):
    alone = LLM(model=str(tiny_dir), dtype="float32", num_pages=64, page_size=4)
    out = [o.token_ids for o in alone.generate(PROMPTS, GREEDY)]
    close_all(llms=[alone])
    return out


def make(tiny_dir, page_size=4, **kw):
    return LLM(model=str(tiny_dir), dtype="float32", num_pages=kw.pop("num_pages", 64), page_size=page_size, **kw)


def endpoints(tiny_dir, pre_page=4, dec_page=8, chunk_bytes=1024, rx_config=None, tx_config=None, **pre_kw):
    pre, dec = make(tiny_dir, pre_page, **pre_kw), make(tiny_dir, dec_page)
    transport = FakeTransport()
    tx_ends, rx_ends = Ends(), Ends()
    rx = KVReceiver(dec, rx_config or ReceiverConfig(), on_end=rx_ends)
    address = rx.serve(transport)
    tx = KVSender(pre, transport, tx_config or SenderConfig(chunk_bytes=chunk_bytes), on_end=tx_ends)
    return pre, dec, transport, rx, tx, address, tx_ends, rx_ends


@pytest.mark.parametrize("pre_page, dec_page", [(4, 8), (8, 4), (4, 4)])
def test_round_trip_is_greedy_equal_to_one_engine(tiny_dir, reference, pre_page, dec_page):
    pre, dec, transport, rx, tx, address, tx_ends, rx_ends = endpoints(
        tiny_dir, pre_page, dec_page, max_num_batched_tokens=16)  # chunked prefill: several steps per prompt
    descs = []
    for p in PROMPTS:  # all three in flight at once
        desc = rx.reserve(len(p), GREEDY)
        tx.send(pre.add_request(p, GREEDY, prefill_only=True), desc, address)
        descs.append(desc)
    outs = drive(tx, rx)
    got = decode_all(dec, [d.request_id for d in descs], outs)
    assert_greedy_equal(reference, got)
    for d, p in zip(descs, PROMPTS):
        st = rx.status(d.reservation_id)
        assert st.state == TransferState.DONE and st.duplicates == 0
        assert st.bytes == len(p) * pre.kv_spec.bytes_per_token_layer() * pre.config.num_layers
    tx_ends.assert_each_once(tx_ends.count)
    rx_ends.assert_each_once([d.reservation_id for d in descs])
    assert len(tx_ends.count) == 3 and all(s.state == TransferState.DONE for s in tx_ends.last.values())
    close_all(tx, rx, transport, [pre, dec])


def test_each_layer_is_published_as_soon_as_it_exists(tiny_dir):
    pre, dec, transport, rx, tx, address, *_ = endpoints(tiny_dir, max_num_batched_tokens=16)
    p = PROMPTS[2]  # 40 tokens: prefill chunks of 16, 16, 8
    desc = rx.reserve(len(p), GREEDY)
    rid = pre.add_request(p, GREEDY, prefill_only=True)
    tx.send(rid, desc, address)
    ob = tx._out[rid]
    seen = []  # registered after the sender's hook: what had been published when each layer finished
    pre.runner.add_layer_hook(lambda layer, batch: seen.append((layer, list(ob.published))))
    tx.step()
    assert seen == [(0, [16, 0]), (1, [16, 16])]  # layer 0's KV left before layer 1 was computed
    end = time.monotonic() + 30
    while rx.status(desc.reservation_id).chunks < 2:  # the receiver has it while the prefill still runs
        assert time.monotonic() < end
        time.sleep(0.001)
    assert pre.requests[rid].status == RequestStatus.RUNNING
    got = decode_all(dec, [desc.request_id], drive(tx, rx))
    assert rx.status(desc.reservation_id).state == TransferState.DONE and len(got[0]) == GREEDY.max_tokens
    close_all(tx, rx, transport, [pre, dec])


def test_send_after_the_prefill_finished_ships_the_cached_kv(tiny_dir, reference):
    pre, dec, transport, rx, tx, address, *_ = endpoints(tiny_dir, pre_page=8, dec_page=4)
    descs = []
    for p in PROMPTS:
        rid, _ = prefill_held(pre, p, GREEDY)
        desc = rx.reserve(len(p), GREEDY)
        tx.send(rid, desc, address)
        descs.append(desc)
    got = decode_all(dec, [d.request_id for d in descs], drive(tx, rx))
    assert_greedy_equal(reference, got)
    close_all(tx, rx, transport, [pre, dec])


def test_transport_registry_has_the_real_one_and_its_fake():
    assert set(TRANSPORTS) == {"grpc", "fake"}
    assert isinstance(make_transport("fake"), FakeTransport)
    with pytest.raises(TransferConfigError, match="transport"):
        make_transport("carrier-pigeon")


# ---- security at start -------------------------------------------------------------------------
def test_binding_beyond_loopback_without_a_token_is_refused(tiny_dir, monkeypatch):
    monkeypatch.delenv("PDSERVE_KV_TOKEN", raising=False)
    dec, transport = make(tiny_dir), FakeTransport()
    with pytest.raises(TransferConfigError, match="needs an auth token"):
        KVReceiver(dec, ReceiverConfig(host="0.0.0.0")).serve(transport)
    assert not transport._sinks  # refused before anything listened
    rx = KVReceiver(dec, ReceiverConfig(host="0.0.0.0", auth_token="t0ken"))
    assert rx.serve(transport).startswith("fake:")
    close_all(rx=rx, transport=transport, llms=[dec])


def test_token_sources_and_constant_time_check(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_KV_TOKEN", "from-env")
    assert ReceiverConfig().token() == "from-env"
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert ReceiverConfig(token_file=str(f)).token() == "from-file"
    assert ReceiverConfig(auth_token="literal", token_file=str(f)).token() == "literal"
    f.write_text("  \n")
    with pytest.raises(TransferConfigError, match="empty"):
        SenderConfig(token_file=str(f)).token()
    with pytest.raises(TransferConfigError, match="cannot read"):
        SenderConfig(token_file=str(tmp_path / "missing")).token()
    check_token(None, None)  # a loopback receiver without a token accepts anyone local
    check_token("abc", "abc")
    for presented, match in ((None, "missing"), ("", "missing"), ("abd", "bad"), ("ab", "bad")):
        with pytest.raises(Unauthenticated, match=match):
            check_token("abc", presented)


def test_config_validation_names_the_field(tmp_path):
    with pytest.raises(TransferConfigError, match="max_chunk_bytes"):
        ReceiverConfig(max_chunk_bytes=10)
    with pytest.raises(TransferConfigError, match="max_message_bytes"):
        ReceiverConfig(max_chunk_bytes=1 << 20, max_message_bytes=1 << 20)
    with pytest.raises(TransferConfigError, match="chunk_bytes"):
        SenderConfig(chunk_bytes=8 << 20)
    with pytest.raises(TransferConfigError, match="tls.cert_file"):
        TLSConfig(cert_file=str(tmp_path / "nope.pem")).read("cert_file")


def test_preempted_prefill_recomputes_without_sending_twice(tiny_dir):
    pre = make(tiny_dir, page_size=4, num_pages=12, max_num_batched_tokens=16)  # 48 token slots
    dec, transport = make(tiny_dir, page_size=8), FakeTransport()
    rx = KVReceiver(dec)
    address = rx.serve(transport)
    tx = KVSender(pre, transport, SenderConfig(chunk_bytes=1024))
    pre.add_request([7] * 8, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    pre.step()  # the grower is running; the prefill arrives after it, so it is the one preempted
    p = PROMPTS[2]  # 40 tokens: 10 pages, which the grower will need too
    desc = rx.reserve(len(p), GREEDY)
    rid = pre.add_request(p, GREEDY, prefill_only=True)
    tx.send(rid, desc, address)
    prefill = pre.requests[rid]
    outs = drive(tx, rx)
    assert prefill.num_preemptions > 0, "the sending prefill was never preempted"
    st = rx.status(desc.reservation_id)
    assert st.state == TransferState.DONE and st.duplicates == 0, st
    got = decode_all(dec, [desc.request_id], outs)
    alone = make(tiny_dir)
    assert_greedy_equal([alone.generate(p, GREEDY)[0].token_ids], got)
    pre.generate_until_idle()
    close_all(tx, rx, transport, [pre, dec, alone])
