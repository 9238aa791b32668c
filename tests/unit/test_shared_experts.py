"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): routed experts plus a shared SwiGLU expert on every token scaled by
sigmoid(shared_expert_gate(h)), against transformers' own implementation (issue 35).

Tiny random checkpoints written with transformers' `Qwen2MoeForCausalLM` (tests/tiny_moe_models.py; q/k/v
biases drawn): greedy tokens equal transformers' generate() in float32 for one prompt and for 8 ragged prompts
run together, with experts named one by one (sharded files, every layer sparse, top-k renormalised, no q/k/v
bias) and as fused 3-D tensors (layer 0 dense by `mlp_only_layers`); served by Hub id from a sharded snapshot
with transformers' tokens; bf16 first-token logits within the MoE tests' 0.25 of transformers' float32. The
sparse block equals transformers' for each implementation (grouped, per-token, dense); the config's fields
read as transformers reads them (`decoder_sparse_step`, `mlp_only_layers`, `qkv_bias`). The parallel forwards
as threads: TP=2 (the shared expert split as a dense MLP, its gate whole), EP=2 (the shared expert whole on
each rank, added once after the experts' all-reduce) and EP=2 x TP=2 equal one process. Rank processes against
transformers' tokens: tests/integration/test_shared_experts_parallel.py. DeepSeek's `n_shared_experts` stays
refused, named.
"""
from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from engine import SamplingParams
from engine.config import ModelConfig
from engine.errors import UnsupportedFeatureError
from engine.kv_cache.spec import KVPageSpec
from engine.loader import load_config, load_weights
from engine.model import LlamaForward
from engine.moe import IMPLS, load_moe_layer, moe_forward, routed_forward, shared_forward
from engine.parallel.errors import ParallelConfigError
from engine.parallel.expert_worker import expert_model
from engine.parallel.shard import shard_kv_spec
from engine.parallel.validate import check_supported as check_parallel
from tests.exactness import assert_greedy_equal
from tests.hub_cache import hub_env, lay_out
from tests.prompts import MIXED
from tests.tiny_llm import generate_to_empty, tiny_llm
from tests.tiny_moe_models import hf_greedy, hf_moe_config, write_tiny_moe
from tests.tp_threads import ThreadAllReduce, run_forward, tp_forward

NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
VARIANTS = {  # name -> write_tiny_moe options
    "per-expert": {"shard": "100KB", "norm_topk_prob": True, "qkv_bias": False},
    "fused-dense0": {"num_hidden_layers": 3, "mlp_only_layers": [0], "original_format": False},
}
ONE = [[7, 19, 3, 101, 55, 55, 240, 8, 9, 31, 64, 12, 200, 17, 5, 77, 150, 33, 4]]
RAGGED = [list(range(10 + i, 10 + i + n)) for i, n in enumerate([3, 40, 11, 1, 27, 6, 19, 33])]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """name -> (model dir, transformers' (tokens, logits) for ONE + RAGGED), each written and run once."""
    root, cache = tmp_path_factory.mktemp("qwen2moe"), {}

    def get(name: str):
        if name not in cache:
            d = write_tiny_moe("qwen2_moe", root / name, **VARIANTS[name])
            cache[name] = d, hf_greedy(d, ONE + RAGGED, NEW)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(VARIANTS))
def test_one_prompt_equals_transformers_generate(model, name):
    d, (tokens, logits) = model(name)
    assert_greedy_equal(tokens[:1], generate_to_empty(tiny_llm(d), ONE, GREEDY), logits[:1])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_eight_ragged_prompts_together_equal_transformers_generate(model, name):
    d, (tokens, logits) = model(name)
    llm = tiny_llm(d, max_num_batched_tokens=32)  # prefill in chunks beside decoding rows
    assert_greedy_equal(tokens[1:], generate_to_empty(llm, RAGGED, GREEDY), logits[1:])
    assert llm.scheduler.stats.num_chunked_prefills > 0
    sparse = [lw.moe for lw in llm.model.layers if lw.moe is not None]
    assert sparse and all(m.shared is not None for m in sparse)  # served with its shared experts
    assert all(lw.qkv.bias is not None for lw in llm.model.layers) == (name == "fused-dense0")


def test_served_by_hub_id_from_a_sharded_snapshot(model, tmp_path, monkeypatch):
    d, (tokens, logits) = model("per-expert")
    assert len(list(d.glob("*.safetensors"))) > 1
    hub_env(monkeypatch, tmp_path / "hf")
    files = ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"]
    files += [p.name for p in d.glob("*.safetensors")]
    lay_out(tmp_path / "hf", "pdserve-test/tiny-qwen2-moe", d, files=tuple(files))
    llm = tiny_llm("pdserve-test/tiny-qwen2-moe")
    assert llm.model_dir.parent.name == "snapshots"
    assert_greedy_equal(tokens[1:4], generate_to_empty(llm, RAGGED[:3], GREEDY), logits[1:4])


def test_bf16_engine_close_to_transformers(model):
    d, (_, logits) = model("fused-dense0")
    outs = tiny_llm(d, dtype="bfloat16", keep_logits=True).generate(RAGGED, SamplingParams(max_tokens=1, temperature=0))
    got = torch.stack([o.logits[0] for o in outs])
    ref = torch.stack([lg[0] for lg in logits[1:]])  # float32 transformers, first new token
    assert (got - ref).abs().max() < 0.25  # test_moe_models' bf16 bound
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


def test_configs_read_as_transformers_reads_them():
    def read(**over) -> ModelConfig:
        return ModelConfig.from_hf_dict(hf_moe_config("qwen2_moe", **over).to_dict())

    cfg = read()
    assert cfg.qkv_bias and cfg.moe.shared_intermediate_size == 48 and cfg.moe.weights_in_model_dtype
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (8, 3, 32)
    assert cfg.moe.sparse_layers == (0, 1) and not cfg.moe.norm_topk_prob and cfg.sliding_window is None
    assert not read(qkv_bias=False).qkv_bias and read(norm_topk_prob=True).moe.norm_topk_prob
    # (i + 1) % 2 == 0, minus layer 3: as Qwen2MoeDecoderLayer picks its sparse block
    assert read(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]).moe.sparse_layers == (1,)
    assert read(mlp_only_layers=[0, 1]).moe is None


def _block(dtype: torch.dtype, seed: int = 3, **over):
    """transformers' Qwen2-MoE sparse block (shared expert included) with random weights, and ours over them."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    hf_cfg = hf_moe_config("qwen2_moe", **over)
    hf_cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    block = Qwen2MoeSparseMoeBlock(hf_cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    block = block.to(dtype).eval()
    state = {f"model.layers.0.mlp.{k}": v for k, v in block.state_dict().items()}
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict()).moe
    return block, load_moe_layer(cfg, state, lambda n: state[n].contiguous(), "model.layers.0.")


@pytest.mark.parametrize("over", [{}, {"norm_topk_prob": True}])
def test_sparse_block_equals_transformers(over):
    block, layer = _block(torch.float32, **over)
    h = torch.randn(21, 64, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        want = block(h[None])[0]
        gated = torch.sigmoid(block.shared_expert_gate(h)) * block.shared_expert(h)
    assert layer.shared.gate.shape == (1, 64)
    torch.testing.assert_close(shared_forward(layer, h), gated, atol=1e-6, rtol=1e-6)
    assert gated.abs().max() > 0.1  # the shared expert moves the output: leaving it out would fail
    for impl in IMPLS:
        got = moe_forward(layer, h, impl)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)  # GEMM blocking
        assert torch.equal(got, routed_forward(layer, h, impl) + shared_forward(layer, h))


# ---- parallel forwards as threads ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fused(model):
    d, _ = model("fused-dense0")
    cfg = load_config(d)
    return d, cfg, KVPageSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, "float32")


def _reference(d, cfg, spec) -> torch.Tensor:
    return run_forward(LlamaForward(cfg, load_weights(d), torch.float32), spec, list(MIXED))


def _close(got: torch.Tensor, reference: torch.Tensor) -> None:
    assert (got - reference).abs().max() < 1e-4
    assert torch.equal(got.argmax(-1), reference.argmax(-1))


def test_tp2_splits_the_shared_expert_and_equals_one_process(fused):
    d, cfg, spec = fused
    check_parallel(cfg, 2)
    _close(tp_forward(cfg, load_weights(d), spec, list(MIXED), 2), _reference(d, cfg, spec))
    odd = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, shared_intermediate_size=30))
    check_parallel(odd, 2)
    with pytest.raises(ParallelConfigError, match="shared expert intermediate size 30") as e:
        check_parallel(odd, 4)  # divides the heads, the dense and the experts' widths, not the shared one's
    assert e.value.field == "tensor_parallel_size"


def _expert_ranks(d, cfg, spec, ep: int, tp: int) -> list[torch.Tensor]:
    """ep x tp ranks as threads: rank (e, t) holds expert block e, TP rank t's slices; MoE outputs reduced over
    all of them, attention, dense layers and the shared expert within the group (`LlamaForward._moe`)."""
    world, groups, out = ThreadAllReduce(ep * tp), [ThreadAllReduce(tp) for _ in range(ep)], [None] * (ep * tp)

    def rank(g: int) -> None:
        e, t = divmod(g, tp)
        model = expert_model(d, cfg, "float32", e, ep, expert_reduce=world.for_rank(g), tp_rank=t, tp=tp,
                             all_reduce=groups[e].for_rank(t) if tp > 1 else None)
        shared = [lw.moe.shared for lw in model.layers if lw.moe is not None]
        assert shared and all(s.down.weight.shape == (64, 48 // tp) for s in shared)  # whole width / tp
        out[g] = run_forward(model, shard_kv_spec(spec, t, tp) if tp > 1 else spec, list(MIXED))

    threads = [threading.Thread(target=rank, args=(g,)) for g in range(ep * tp)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads), "a rank thread is stuck in an all-reduce"
    return out


@pytest.mark.parametrize("ep, tp", [(2, 1), (2, 2)], ids=["ep2", "ep2xtp2"])
def test_expert_ranks_add_the_shared_expert_once(fused, ep, tp):
    d, cfg, spec = fused
    out = _expert_ranks(d, cfg, spec, ep, tp)
    assert all(o is not None and torch.equal(o, out[0]) for o in out)
    _close(out[0], _reference(d, cfg, spec))


# ---- what is refused ---------------------------------------------------------------------------------
def test_deepseek_style_shared_experts_stay_refused():
    for arch, over, key in [("qwen3_moe", {"n_shared_experts": 2}, "n_shared_experts"),
                            ("qwen2_moe", {"n_shared_experts": 1}, "n_shared_experts"),
                            ("qwen3_moe", {"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size")]:
        d = dict(hf_moe_config(arch).to_dict(), **over)
        with pytest.raises(UnsupportedFeatureError, match="shared experts") as e:
            ModelConfig.from_hf_dict(d)
        assert any(key in f for f in e.value.features)
