"""Expert parallelism's parts without rank processes (issue 35): which experts a rank holds and reads, each
MoE implementation's rank partials summing to the whole layer, a rank's weight bytes, the refusals (a dense
model, a degree that does not divide the experts, EP with PP, speculation, an unknown attention layout), and
the cluster spec serving
`expert_parallel` for an MoE model (`pdserve validate` accepts it) and refusing it for a dense one. The ranks
themselves run in tests/integration/test_moe_parallel.py."""
from __future__ import annotations

import threading

import pytest
import torch
import yaml

from cluster import cli
from cluster.serving import actors
from cluster.spec import SpecError, parse_spec
from engine.llm import LLM
from engine.loader import load_config, load_weights
from engine.model import LlamaForward
from engine.moe import IMPLS, moe_forward, route
from engine.parallel.dispatch import AllToAllDispatch
from engine.parallel.errors import ParallelConfigError, UnsupportedWithParallelError
from engine.parallel.expert_worker import expert_model
from engine.parallel.experts import expert_range, expert_slice
from engine.parallel.validate import check_supported, expert_attention_of, parallel_problems
from tests.tiny_moe_models import write_tiny_moe
from tests.tp_threads import ThreadAllToAll

ARCHS = {"qwen3_moe": {"original_format": False}, "mixtral": {}}  # fused [E, ...] experts / one by one


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    return {arch: write_tiny_moe(arch, root / arch, **kw) for arch, kw in ARCHS.items()}


def test_contiguous_expert_blocks_and_what_a_rank_reads():
    assert [expert_range(8, r, 2) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [expert_range(8, r, 4) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    mine = range(4, 8)
    assert expert_slice("model.layers.1.mlp.experts.5.gate_proj.weight", mine) is True
    assert expert_slice("model.layers.1.mlp.experts.3.down_proj.weight", mine) is False
    assert expert_slice("model.layers.0.block_sparse_moe.experts.12.w1.weight", mine) is False
    assert expert_slice("model.layers.0.mlp.experts.gate_up_proj", mine) == mine  # fused: the rank's rows
    for whole in ("model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.q_proj.weight",
                  "model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.down_proj.weight"):
        assert expert_slice(whole, mine) is True


@pytest.mark.parametrize("rows", [1, 13], ids=["host-grouped", "sorted"])
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_rank_partials_sum_to_the_whole_moe_layer(models, arch, impl, rows):
    """Each rank holds its block of experts and computes only the assignments routed to them (zero rows for
    tokens none of its experts got); the ranks' outputs sum to one process's layer."""
    d = models[arch]
    cfg = load_config(d)
    whole = LlamaForward(cfg, load_weights(d), torch.float32).layers[0].moe
    ranks = [expert_model(d, cfg, "float32", r, 2).layers[0].moe for r in range(2)]
    assert [(m.experts, m.gate_up.shape[0], len(m.down_linear)) for m in ranks] == [(range(0, 4), 4, 4),
                                                                                     (range(4, 8), 4, 4)]
    h = torch.randn(rows, cfg.hidden_size, generator=torch.Generator().manual_seed(rows))
    ref = moe_forward(whole, h, impl)
    parts = [moe_forward(m, h, impl) for m in ranks]
    torch.testing.assert_close(parts[0] + parts[1], ref, atol=1e-6, rtol=1e-5)
    _, ids = route(whole, h)
    for m, part in zip(ranks, parts):
        chosen = ((ids >= m.experts.start) & (ids < m.experts.stop)).any(dim=1)  # [rows]
        assert (part[~chosen] == 0).all() and (part[chosen].abs().sum(dim=1) > 0).all()


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("first", [5, 0, 13], ids=["both", "rank0-idle", "rank1-idle"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_dispatched_tokens_equal_one_process_layer(models, arch, first, tp):
    """Data-parallel attention's MoE layer (`AllToAllDispatch`, ranks as threads): expert group 0 holds the first
    `first` of 13 tokens and group 1 the rest, each its block of experts (with tp=2 each of its two ranks a width
    slice of them, trading with the same slice of the other group); tokens go to their experts' groups and back,
    and each group's output (its slices summed, as its all-reduce does) is one process's rows of the whole layer.
    A group with no tokens still serves the other's."""
    d = models[arch]
    cfg = load_config(d)
    whole = LlamaForward(cfg, load_weights(d), torch.float32).layers[0].moe
    h = torch.randn(13, cfg.hidden_size, generator=torch.Generator().manual_seed(first))
    ref = moe_forward(whole, h)
    rows, exchanges, out = [h[:first], h[first:]], [ThreadAllToAll(2) for _ in range(tp)], {}

    def rank(g: int, t: int) -> None:
        layer = expert_model(d, cfg, "float32", g, 2, tp_rank=t, tp=tp).layers[0].moe
        out[g, t] = AllToAllDispatch(g, 2, 4, all_to_all=exchanges[t].for_rank(g))(layer, rows[g])

    threads = [threading.Thread(target=rank, args=(g, t)) for g in range(2) for t in range(tp)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert len(out) == 2 * tp, "a rank thread failed"
    groups = [sum(out[g, t] for t in range(tp)) for g in range(2)]
    torch.testing.assert_close(torch.cat(groups), ref, atol=1e-6, rtol=1e-5)


def test_a_rank_holds_its_experts_and_all_the_rest(models):
    d = models["mixtral"]
    cfg = load_config(d)
    one = expert_model(d, cfg, "float32", 0, 1)
    experts = sum(lw.moe.gate_up.nbytes + lw.moe.down.nbytes for lw in one.layers)
    for rank in range(2):
        assert expert_model(d, cfg, "float32", rank, 2).weight_bytes() == one.weight_bytes() - experts // 2


def test_refusals_are_typed_and_come_before_any_rank_starts(models, tiny_dir):
    with pytest.raises(ParallelConfigError, match="no experts") as e:
        LLM(model=str(tiny_dir), dtype="float32", expert_parallel_size=2)
    assert e.value.field == "expert_parallel_size"
    moe = str(models["mixtral"])
    with pytest.raises(ParallelConfigError, match="3 does not divide the model's 8 experts"):
        LLM(model=moe, dtype="float32", expert_parallel_size=3)
    with pytest.raises(UnsupportedWithParallelError, match="expert ranks together with") as e:
        LLM(model=moe, dtype="float32", expert_parallel_size=2, pipeline_parallel_size=2)
    assert e.value.field == "expert_parallel_size"
    with pytest.raises(UnsupportedWithParallelError) as e:
        LLM(model=moe, dtype="float32", expert_parallel_size=2, speculative={"proposer": "ngram"})
    assert e.value.field == "speculative"
    cfg = load_config(models["mixtral"])
    assert parallel_problems(cfg, 2, 1, ep=2) == []  # expert groups of TP ranks (test_tp_moe.py)
    fields = [(type(p).__name__, p.field) for p in parallel_problems(cfg, 1, 2, ep=2)]
    assert ("UnsupportedWithParallelError", "expert_parallel_size") in fields  # EP x PP: not built
    with pytest.raises(ParallelConfigError, match="positive integer"):
        check_supported(cfg, 1, ep=0)
    check_supported(cfg, 1, ep=8)  # one expert per rank
    with pytest.raises(ParallelConfigError, match="name one of auto, data, replicated") as e:
        LLM(model=moe, dtype="float32", expert_attention="sharded")
    assert e.value.field == "expert_attention"
    # data-parallel attention by default, with or without TP in the expert groups
    assert [expert_attention_of("auto", tp, ep) for tp, ep in ((1, 1), (1, 2), (2, 2))] == [None, "data", "data"]
    assert expert_attention_of("replicated", 2, 2) == "replicated"


def _spec(model, decode: dict) -> dict:
    return {"model": str(model), "dtype": "float32", "pools": {"prefill": {}, "decode": decode}}


def test_spec_serves_expert_parallel_for_moe_and_validate_refuses_it_for_dense(models, tiny_dir, tmp_path, capsys):
    s = parse_spec(_spec(models["qwen3_moe"], {"expert_parallel": 2, "resources": {"num_cpus": 0.5}}))
    s.check_against_model(load_config(models["qwen3_moe"]))
    assert s.engine_config("decode").expert_parallel_size == 2 and s.engine_config("prefill").expert_parallel_size == 1
    assert actors.actor_options(s.pools.decode, s)["num_cpus"] == 1.0  # pack: both ranks' share, as TP/PP
    with pytest.raises(SpecError, match="expert_parallel: 3 does not divide the model's 8 experts.*use one of 1, 2, 4, 8"):
        parse_spec(_spec(models["qwen3_moe"], {"expert_parallel": 3})).check_against_model(load_config(models["qwen3_moe"]))
    # each expert group holds its share of the pages (data-parallel attention): one sequence must fit a share
    short = {"expert_parallel": 2, "kv": {"page_size": 16, "num_pages": 8}, "max_model_len": 128}
    with pytest.raises(SpecError, match="8 pages / 2 expert groups x 16 tokens = 64 tokens cannot hold one 128-token "
                                        "sequence; raise num_pages to >= 16"):
        parse_spec(_spec(models["qwen3_moe"], short))
    parse_spec(_spec(models["qwen3_moe"], {**short, "kv": {"page_size": 16, "num_pages": 16}}))
    good, dense = tmp_path / "moe.yaml", tmp_path / "dense.yaml"
    good.write_text(yaml.safe_dump(_spec(models["qwen3_moe"], {"expert_parallel": 2})))
    dense.write_text(yaml.safe_dump(_spec(tiny_dir, {"expert_parallel": 2})))
    assert cli.main(["validate", str(good)]) == 0
    assert "ep 2" in capsys.readouterr().out
    assert cli.main(["validate", str(dense)]) == 2
    assert "pools.decode.expert_parallel: 2: the model has no experts (a dense MLP)" in capsys.readouterr().err
