"""KV resharding over the real transfer path (issue 9 item 3): a prefill replica of one layout ships its
KV over loopback gRPC (`KVSender` -> `KVReceiver`, in-process) into a decode replica of another layout.

The parallel side reads/writes its ranks through `engine.parallel.kv_io` (a TP/PP prefill ships once
HELD, each rank's KV heads / each stage's layers as chunks addressed by global heads; a TP/PP decode
writes each chunk into every rank holding one of its heads). Layouts: prefill TP=2 -> decode TP=1,
TP=1 -> TP=2, PP=2 -> TP=1 on a random-weight Llama with 8 query / 2 KV heads; SmolLM2 TP=3 -> TP=1,
TP=1 -> TP=3, PP=2 -> TP=1 (`slow`: issue 9's end-to-end acceptance); a tiny Mixtral served by Hub id from
a sharded snapshot, one process -> EP=2 and EP=2 -> one process, greedy-equal to transformers' generate (issue
35: every expert rank holds all the KV, so the decode side writes each chunk into both ranks and the prefill
side ships rank 0's), and one process -> TP=2 (each rank its KV head, every expert split by its width) and ->
EP=2 x TP=2 (each chunk into the rank of its heads in both expert groups). Each other layout is greedy-equal to one
process alone (one reference run per model, shared by its layouts), ends with nothing leaked on either engine
(pages, reservations, requests, transfers, push threads) and every rank process reaped. SmolLM2's three
layouts here are also the resharding tests' real-model cases (test_parallel_kv_reshard moves the tiny
model's KV by hand through the same `kv_io` functions). The handshake compares
the model-level layout: replicas of any layout share one signature, a shard's layout does not. A decode
rank lost mid-transfer fails the transfer typed (UNAVAILABLE) and frees its reservation.
"""
from __future__ import annotations

import dataclasses
import time

import pytest

from engine import SamplingParams
from engine.parallel.shard import shard_kv_spec
from engine.parallel.stages import stage_kv_spec
from kv_transfer.config import ReceiverConfig, SenderConfig
from kv_transfer.contract import ErrorCode, FailedPrecondition, TransferState, make_transport
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVSender
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.kv_helpers import close_all, decode_all, drive
from tests.parallel_helpers import PROMPTS, assert_ranks_gone, reshard_engine, tiny_8q_2kv
from tests.hub_cache import hub_env, lay_out
from tests.tiny_moe_models import hf_greedy, write_tiny_moe

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny82(tmp_path_factory):
    return tiny_8q_2kv(tmp_path_factory, "rsx")


engine = reshard_engine


def alone(model_dir, prompts, params) -> list[list[int]]:
    with engine(model_dir) as llm:
        out = [o.token_ids for o in llm.generate(prompts, params)]
        assert_engine_empty(llm)
    return out


# Each layout pair's reference is the same one-process run: computed once per module, not once per pair.
@pytest.fixture(scope="module")
def tiny_alone(tiny82) -> list[list[int]]:
    return alone(tiny82, PROMPTS[:3], GREEDY)


SMOLLM2_PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2_alone(smollm2_dir) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, their tokens in one process) of the SmolLM2 cases."""
    from engine.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_dir)
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):")]
    return prompts, alone(smollm2_dir, prompts, SMOLLM2_PARAMS)


def _spy_on_rank_reads(tx) -> dict[str, list[int]]:
    """Tokens queued after each read of a parallel prefill's ranks, by request."""
    queued: dict[str, list[int]] = {}
    inner = tx._publish_ranks

    def spy(ob, stop):
        inner(ob, stop)
        if not queued.get(ob.request_id) or queued[ob.request_id][-1] != min(ob.published):
            queued.setdefault(ob.request_id, []).append(min(ob.published))
    tx._publish_ranks = spy
    return queued


def over_grpc(model_dir, src: dict, dst: dict, prompts, params) -> list[list[int]]:
    """Prefill on a replica of layout `src`, ship over gRPC, decode on one of layout `dst` (other page size);
    checks both engines empty, every transfer DONE and every rank process reaped."""
    pre, dec = engine(model_dir, page_size=4, **src), engine(model_dir, page_size=8, **dst)
    tx_t, rx_t = make_transport("grpc"), make_transport("grpc")
    rx = tx = None
    try:
        rx = KVReceiver(dec, ReceiverConfig())
        address = rx.serve(rx_t)
        tx = KVSender(pre, tx_t, SenderConfig(chunk_bytes=1024))
        queued = _spy_on_rank_reads(tx)
        descs = [rx.reserve(len(p), params) for p in prompts]
        sent = [pre.add_request(p, params, prefill_only=True) for p in prompts]
        for rid, d in zip(sent, descs):
            tx.send(rid, d, address)
        got = decode_all(dec, [d.request_id for d in descs], drive(tx, rx))
        if pre.model is None:  # a prompt longer than the step budget (16) left chunk by chunk, before HELD
            for rid, p in zip(sent, prompts):
                assert queued[rid][-1] == len(p) and (len(p) <= 16 or queued[rid][0] < len(p)), (rid, queued)
        assert all(rx.status(d.reservation_id).state == TransferState.DONE for d in descs)
        assert all(tx.status(rid).state == TransferState.DONE and tx.status(rid).bytes for rid in sent)
        close_all(tx, rx, tx_t, [pre, dec])
        rx_t.close()
    finally:
        for closer in (tx, rx):
            if closer is not None:
                closer.close()
        pre.close()
        dec.close()
    for llm in (pre, dec):
        if llm.model is None:
            assert_ranks_gone(llm)
    return got


@pytest.mark.parametrize("src, dst", [(dict(tp=2), dict()), (dict(), dict(tp=2)), (dict(pp=2), dict())],
                         ids=["tp2-tp1", "tp1-tp2", "pp2-tp1"])
def test_tiny_kv_reshards_over_grpc(tiny82, tiny_alone, src, dst):
    assert_greedy_equal(tiny_alone, over_grpc(tiny82, src, dst, PROMPTS[:3], GREEDY))


@pytest.fixture(scope="module")
def mixtral_hub(tmp_path_factory):
    """(an offline HF_HOME holding the sharded tiny Mixtral as a Hub snapshot, transformers' float32 greedy
    tokens and logits for PROMPTS[:3]): laid out and generated once for the four layouts (read only)."""
    root = tmp_path_factory.mktemp("moe_hub")
    d = write_tiny_moe("mixtral", root / "mixtral", shard="100KB")
    assert (d / "model.safetensors.index.json").exists() and len(list(d.glob("*.safetensors"))) > 1
    ref, ref_logits = hf_greedy(d, PROMPTS[:3], GREEDY.max_tokens)  # transformers, float32
    lay_out(root / "hf", "pdserve-test/tiny-mixtral", d, files=("config.json", "tokenizer.json",
            "tokenizer_config.json", "model.safetensors.index.json", *(p.name for p in d.glob("*.safetensors"))))
    return root / "hf", ref, ref_logits


@pytest.mark.parametrize("src, dst", [(dict(), dict(ep=2)), (dict(ep=2), dict()), (dict(), dict(tp=2)),
                                      (dict(), dict(tp=2, ep=2))], ids=["ep1-ep2", "ep2-ep1", "tp1-tp2", "tp1-tp2ep2"])
def test_moe_by_hub_id_moves_kv_between_one_process_and_parallel_ranks_over_grpc(mixtral_hub, monkeypatch, src,
                                                                                   dst):
    hf_home, ref, ref_logits = mixtral_hub
    hub_env(monkeypatch, hf_home)  # offline: the ranks read the snapshot the driver resolved
    assert_greedy_equal(ref, over_grpc("pdserve-test/tiny-mixtral", src, dst, PROMPTS[:3], GREEDY), ref_logits)


def test_signature_is_model_level_and_a_shard_layout_is_refused(tiny82):
    """TP/PP replicas describe transfers in their whole layout (one signature for every layout of a model);
    a descriptor carrying a shard's layout (a rank's heads, a stage's layers) is refused before a byte moves."""
    with engine(tiny82) as one, engine(tiny82, tp=2) as two:
        spec = one.kv_spec
        assert two.kv_spec.signature() == spec.signature()
        shards = [shard_kv_spec(spec, 0, 2), stage_kv_spec(spec, range(0, 2))]
        assert all(s.signature() != spec.signature() for s in shards)
        rx, tx = KVReceiver(one, ReceiverConfig()), KVSender(two, make_transport("fake"))
        try:
            for shard in shards:
                desc = rx.reserve(len(PROMPTS[1]), GREEDY)
                rid = two.add_request(PROMPTS[1], GREEDY, prefill_only=True)
                with pytest.raises(FailedPrecondition, match="layout"):
                    tx.send(rid, dataclasses.replace(desc, layout_signature=shard.signature()), "nowhere")
                two.abort(rid)
                rx.cancel(desc.reservation_id)
            close_all(tx, rx, None, [one, two])
        finally:
            tx.close()
            rx.close()


def test_a_decode_rank_lost_mid_transfer_fails_it_typed_and_frees_the_reservation(tiny82):
    """A TP=2 decode replica whose rank 1 died: the first chunk written to it fails the transfer with a typed
    UNAVAILABLE on both ends (the replica's other rank is stopped with it), and the reservation's pages go
    back to the pool; both engines end empty and no rank process is left."""
    pre, dec = engine(tiny82), engine(tiny82, tp=2, page_size=8)
    tx_t, rx_t = make_transport("grpc"), make_transport("grpc")
    rx, tx = KVReceiver(dec, ReceiverConfig()), KVSender(pre, tx_t, SenderConfig(chunk_bytes=1024))
    try:
        address = rx.serve(rx_t)
        desc = rx.reserve(len(PROMPTS[0]), GREEDY)
        victim = dec.runner.ranks.procs[1]
        victim.kill()
        victim.wait()
        rid = pre.add_request(PROMPTS[0], GREEDY, prefill_only=True)
        tx.send(rid, desc, address)
        end = time.monotonic() + 60
        while tx.num_live or rx.num_live:
            tx.step() if pre.has_unfinished() else tx.poll()
            rx.pump()
            rx.wait_for_work(0.01)
            assert time.monotonic() < end, "the transfer did not end"
        got, sent = rx.status(desc.reservation_id), tx.status(rid)
        assert got.state == sent.state == TransferState.FAILED
        assert got.code == ErrorCode.UNAVAILABLE and "lost a rank" in got.reason, got
        assert dec.runner.ranks.closed  # the replica is down: a step would raise RankFailedError now
        close_all(tx, rx, tx_t, [pre, dec])
    finally:
        tx.close()
        rx.close()
        rx_t.close()
        pre.close()
        dec.close()
    assert_ranks_gone(dec)


@pytest.mark.slow
@pytest.mark.parametrize("src, dst", [(dict(tp=3), dict()), (dict(), dict(tp=3)), (dict(pp=2), dict())],
                         ids=["tp3-tp1", "tp1-tp3", "pp2-tp1"])
def test_smollm2_kv_reshards_over_grpc(smollm2_dir, smollm2_alone, src, dst):
    prompts, want = smollm2_alone
    assert_greedy_equal(want, over_grpc(smollm2_dir, src, dst, prompts, SMOLLM2_PARAMS))
