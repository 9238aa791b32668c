"""Sparse attention per request and per pool: `pdserve.sparse_attention` in the HTTP body ("off" or fields)
-> `SamplingParams.sparse_attention` with 400s naming the field; honoured row by row in a decode step (a
batch mixes sparse and full rows: budget >= context gives the full-attention tokens, a small budget changes
only the sparse row's pages); an engine with sparse attention off refuses per-request fields (no page
summaries to choose from) and "off" always works; a prefill engine ignores it; shipped with disaggregated
requests (fake transport); the YAML `sparse_attention:` key of a decode/colocated pool round-trips into
the engine and is refused on prefill and for bad values. Engine tests end with nothing leaked."""
from __future__ import annotations

import pytest

from cluster.http.openai_schema import in_body, parse_request, sampling_params
from cluster.spec import parse_spec
from cluster.spec_errors import SpecError
from engine import SamplingParams
from engine.errors import InvalidRequestError
from engine.kv_cache import sparse as sp
from engine.kv_cache.sparse_config import SparseAttentionConfig, for_request, step_rows
from engine.llm import LLM
from tests.conftest import assert_engine_empty
from tests.exactness import assert_greedy_equal
from tests.kv_helpers import close_all, ship_all

PS = 4
PROMPTS = [list(range(10, 130)), list(range(100, 160))]
SMALL = {"budget": 8, "recent": 8, "sink_pages": 1, "min_context": 32}


def greedy(sparse=None, n=12):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, sparse_attention=sparse)


def engine(tiny_dir, sparse=None, **kw):
    return LLM(model=str(tiny_dir), dtype="float32", page_size=PS, num_pages=160, sparse_attention=sparse, **kw)


# ---- HTTP schema ------------------------------------------------------------------------------
def _params(option):
    body = {"model": "m", "prompt": "hi", "pdserve": {"sparse_attention": option}}
    return sampling_params(parse_request(body, "completion"), 0, 16)


def test_http_option_reaches_sampling_params():
    assert _params("off").sparse_attention == "off"
    assert _params({"budget": 64, "select_per": "row"}).sparse_attention == {"budget": 64, "select_per": "row"}
    assert _params({"selection_layers": [0, 2]}).sparse_attention == {"selection_layers": [0, 2]}
    assert _params({}).sparse_attention == {}  # the pool's settings
    assert sampling_params(parse_request({"model": "m", "prompt": "hi"}, "completion"), 0, 16).sparse_attention is None


@pytest.mark.parametrize("option, field", [
    ({"budget": 0}, "pdserve.sparse_attention.budget"), ({"budget": -64}, "pdserve.sparse_attention.budget"),
    ({"budget": "64"}, "pdserve.sparse_attention.budget"), ({"method": "oracle"}, "pdserve.sparse_attention.method"),
    ({"bugdet": 64}, "pdserve.sparse_attention.bugdet"), ({"select_per": "page"}, "pdserve.sparse_attention.select_per"),
    ({"gqa": "mean"}, "pdserve.sparse_attention.gqa"), ({"recent": -1}, "pdserve.sparse_attention.recent"),
    ({"selection_layers": [0, -1]}, "pdserve.sparse_attention.selection_layers"),
    ("on", "pdserve.sparse_attention"), (3, "pdserve.sparse_attention"),
    ({"dense_layers": 2}, "pdserve.sparse_attention.dense_layers"),  # the pool's, not a request's
])
def test_http_bad_values_are_400s_naming_the_field(option, field):
    with pytest.raises(InvalidRequestError) as e:
        _params(option)
    assert e.value.field == field or e.value.field.startswith(field + "."), e.value.field


def test_engine_errors_are_renamed_to_where_the_body_has_them(tiny_dir):
    req = parse_request({"model": "m", "prompt": "hi", "pdserve": {"sparse_attention": {"budget": 6}}}, "completion")
    llm = engine(tiny_dir, {"budget": 64})
    with pytest.raises(InvalidRequestError) as e:
        llm.add_request([1, 2, 3], sampling_params(req, 0, 4))
    assert e.value.field == "sparse_attention.budget" and "multiple of the KV page size" in str(e.value)
    assert in_body(e.value, req).field == "pdserve.sparse_attention.budget"
    assert_engine_empty(llm)


# ---- engine: intake -----------------------------------------------------------------------------
def test_engine_with_sparse_off_refuses_fields_and_takes_off(tiny_dir):
    llm = engine(tiny_dir)
    with pytest.raises(InvalidRequestError) as e:
        llm.add_request(PROMPTS[0], greedy({"budget": 8}))
    assert e.value.field == "sparse_attention" and "enable `sparse_attention` on the pool" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        llm.add_request(PROMPTS[0], greedy({"budgte": 8}))  # unknown key named before anything else
    assert e.value.field == "sparse_attention.budgte"
    full = [o.token_ids for o in llm.generate(PROMPTS, greedy("off"))]
    assert full == [o.token_ids for o in llm.generate(PROMPTS, greedy())]
    rid = llm.add_request(PROMPTS[0], greedy({"budget": 8}), prefill_only=True)  # prefill reads every page
    llm.generate_until_idle()
    llm.release_held(rid)
    assert_engine_empty(llm)


def test_engine_budget_must_be_a_multiple_of_the_page_size(tiny_dir):
    with pytest.raises(InvalidRequestError) as e:
        engine(tiny_dir, {"budget": 10})
    assert e.value.field == "sparse_attention.budget"


def test_request_fields_replace_the_engines():
    base = SparseAttentionConfig(budget=64, recent=16, select_per="row", dense_layers=1)
    assert for_request(base, None) is base and for_request(base, "off") is None
    assert for_request(base, {"budget": 8}) == SparseAttentionConfig(budget=8, recent=16, select_per="row",
                                                                     dense_layers=1)
    with pytest.raises(InvalidRequestError) as e:  # engine-wide: every row of a step shares the dense layers
        for_request(base, {"dense_layers": 0})
    assert e.value.field == "sparse_attention.dense_layers"

    class R:
        def __init__(self, rid, value):
            self.request_id, self.params = rid, SamplingParams(sparse_attention=value)

    assert step_rows(base, [R("a", None), R("b", None)]) is None  # every row the engine's: no map
    assert step_rows(base, [R("a", None), R("b", "off")]) == {"a": base, "b": None}
    assert step_rows(None, [R("a", "off")]) is None


# ---- engine: a mixed batch --------------------------------------------------------------------
def _spy(monkeypatch):
    seen = []
    real = sp.select

    def spy(cfg, lo, hi, q, page_index, ctx_lens, ps, plan=None, rows=None):
        sel = real(cfg, lo, hi, q, page_index, ctx_lens, ps, plan, rows)
        seen.append((list(ctx_lens), rows, sel))
        return sel

    monkeypatch.setattr(sp, "select", spy)
    return seen


def test_mixed_batch_budget_covering_the_context_gives_full_attention(tiny_dir):
    want = [o.token_ids for o in engine(tiny_dir).generate(PROMPTS, greedy())]
    llm = engine(tiny_dir, {"budget": 8, "recent": 8})  # the engine's own is small; the requests' cover all
    got = [o.token_ids for o in llm.generate(PROMPTS, [greedy({"budget": 512}), greedy("off")])]
    assert got == want
    assert_engine_empty(llm)


def test_mixed_batch_small_budget_selects_for_the_sparse_row_only(tiny_dir, monkeypatch):
    full = [o.token_ids for o in engine(tiny_dir).generate(PROMPTS, greedy())]
    seen = _spy(monkeypatch)
    llm = engine(tiny_dir, {"budget": 512})
    outs = llm.generate(PROMPTS, [greedy(SMALL), greedy("off")])
    mixed = [(c, r, s) for c, r, s in seen if r is not None and len(c) == 2 and s is not None]
    assert mixed, "no decode step selected pages for a two-row batch"
    for ctx, rows, sel in mixed:
        assert rows[0].budget == 8 and rows[1] is None
        read = sel.slots.sum(-1)  # [B, kv_heads] slots each row reads per KV head
        assert (read[1] == ctx[1]).all()  # the full row reads its whole context
        if ctx[0] > SMALL["min_context"]:
            budget_slots = (SMALL["sink_pages"] + SMALL["budget"] // PS + SMALL["recent"] // PS + 1) * PS
            assert (read[0] <= budget_slots).all() and (read[0] < ctx[0]).all()
    assert outs[1].token_ids == full[1]  # the full row's tokens are full attention's
    assert len(outs[0].token_ids) == 12
    assert_engine_empty(llm)


def test_rows_of_different_kinds_in_one_group(tiny_dir, monkeypatch):
    """select_per / gqa / selection_layers differing between rows of one batch: each row's choice equals
    the one it makes alone (same pages), nothing leaks."""
    cfgs = [dict(SMALL, select_per="row"), dict(SMALL, gqa="sum", selection_layers=[0])]
    alone = []
    for c, p in zip(cfgs, PROMPTS):
        llm = engine(tiny_dir, {"budget": 512})
        alone.append(llm.generate([p], greedy(c))[0].token_ids)
        assert_engine_empty(llm)
    llm = engine(tiny_dir, {"budget": 512})
    together = [o.token_ids for o in llm.generate(PROMPTS, [greedy(c) for c in cfgs])]
    assert_greedy_equal(alone, together)
    assert_engine_empty(llm)


# ---- disaggregated ----------------------------------------------------------------------------
def test_disaggregated_request_carries_its_sparse_config(tiny_dir, monkeypatch):
    """Prefill (sparse off, ignores the option) -> fake transport -> decode (sparse on): the decode side's
    steps select with the request's budget; tokens equal one engine serving the same request."""
    local = engine(tiny_dir, {"budget": 512})
    want = [o.token_ids for o in local.generate(PROMPTS, greedy(SMALL))]
    assert_engine_empty(local)
    seen = _spy(monkeypatch)
    pre = engine(tiny_dir, max_num_batched_tokens=32)
    dec = engine(tiny_dir, {"budget": 512})
    got, _, (tx, rx, transport) = ship_all(pre, dec, PROMPTS, greedy(SMALL))
    assert_greedy_equal(want, got)
    chosen = [rows for _, rows, sel in seen if sel is not None]
    assert chosen and all(r is not None and all(c.budget == 8 for c in r) for r in chosen)
    close_all(tx, rx, transport, [pre, dec])


def test_disaggregated_decode_pool_with_sparse_off_refuses_at_reserve(tiny_dir):
    from kv_transfer.config import ReceiverConfig
    from kv_transfer.fake_transport import FakeTransport
    from kv_transfer.receiver import KVReceiver

    dec = engine(tiny_dir)
    with pytest.raises(InvalidRequestError, match="sparse_attention"):
        dec.check_request(40, greedy(SMALL))
    rx = KVReceiver(dec, ReceiverConfig())
    transport = FakeTransport()
    rx.serve(transport)
    close_all(None, rx, transport, [dec])


# ---- YAML -------------------------------------------------------------------------------------
BASE = {"model": "smollm2-135m", "mode": "disaggregated", "pools": {"prefill": {}, "decode": {}}}


def _spec(**decode):
    return parse_spec({**BASE, "pools": {"prefill": {}, "decode": decode}})


def test_yaml_pool_key_round_trips_into_the_engine():
    s = _spec(sparse_attention={"budget": 512, "select_per": "row", "selection_layers": [0, 3]})
    kw = s.engine_kwargs("decode")["sparse_attention"]
    assert kw == {"method": "quest", "budget": 512, "sink_pages": 1, "recent": 64, "min_context": 0,
                  "select_per": "row", "gqa": "max", "selection_layers": [0, 3], "dense_layers": 0}
    assert SparseAttentionConfig.of(kw).selection_layers == (0, 3)
    assert "sparse_attention" not in s.engine_kwargs("prefill")
    assert parse_spec({**BASE, "pools": {"prefill": {}, "decode": {"sparse_attention": None}}}).pools.decode \
        .sparse_attention.budget == 1024  # `sparse_attention:` alone: the defaults
    assert "sparse_attention" not in _spec().engine_kwargs("decode")
    co = parse_spec({"model": "smollm2-135m", "mode": "colocated", "pools": {"colocated": {"sparse_attention": {}}}})
    assert co.engine_kwargs("colocated")["sparse_attention"]["budget"] == 1024


@pytest.mark.parametrize("pools, key", [
    ({"prefill": {"sparse_attention": {}}, "decode": {}}, "pools.prefill.sparse_attention"),
    ({"prefill": {}, "decode": {"sparse_attention": {"budget": 100}}}, "pools.decode.sparse_attention.budget"),
    ({"prefill": {}, "decode": {"sparse_attention": {"budget": 0}}}, "pools.decode.sparse_attention.budget"),
    ({"prefill": {}, "decode": {"sparse_attention": {"method": "oracle"}}}, "pools.decode.sparse_attention.method"),
    ({"prefill": {}, "decode": {"sparse_attention": {"bugdet": 64}}}, "pools.decode.sparse_attention.bugdet"),
    ({"prefill": {}, "decode": {"sparse_attention": {"selection_layers": [0, -2]}}},
     "pools.decode.sparse_attention.selection_layers"),
    ({"prefill": {"kv": {"storage": "kivi4"}}, "decode": {"kv": {"storage": "kivi4"}, "sparse_attention": {}}},
     "pools.decode.sparse_attention"),
    ({"prefill": {}, "decode": {"tensor_parallel": 3, "sparse_attention": {}}}, "pools.decode.sparse_attention"),
    ({"prefill": {}, "decode": {"sparse_attention": {"dense_layers": -1}}}, "pools.decode.sparse_attention.dense_layers"),
])
def test_yaml_bad_values_are_spec_errors_naming_the_key(pools, key):
    with pytest.raises(SpecError) as e:
        parse_spec({**BASE, "pools": pools})
    assert any(p.key == key for p in e.value.problems), str(e.value)


def test_dense_layers_read_every_page(tiny_dir, monkeypatch):
    """dense_layers=1: layer 0 never selects (full attention there), layer 1 does; nothing leaks."""
    seen_layers = []
    real = sp.choose

    def spy(cfg, rows, lo, hi, q, page_index, ctx_lens, ps, plan, layer):
        sel = real(cfg, rows, lo, hi, q, page_index, ctx_lens, ps, plan, layer)
        seen_layers.append((layer, sel is not None))
        return sel

    monkeypatch.setattr(sp, "choose", spy)
    llm = engine(tiny_dir, dict(SMALL, dense_layers=1))
    assert all(len(o.token_ids) == 12 for o in llm.generate(PROMPTS, greedy()))
    assert not any(chosen for layer, chosen in seen_layers if layer == 0)
    assert any(chosen for layer, chosen in seen_layers if layer == 1)
    assert_engine_empty(llm)
