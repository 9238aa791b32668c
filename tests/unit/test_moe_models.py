"""Qwen3, Qwen3-MoE and Mixtral in the engine against transformers' own implementation (float32 greedy).

Tiny random checkpoints written with transformers' classes (tests/tiny_moe_models.py; two sharded with an
index, one in transformers 5's fused expert layout) are served from a directory and by Hub id from an offline
Hub cache: greedy tokens equal transformers' generate() for one prompt and for 8 ragged prompts run
together (chunked prefill, continuous batching). The MoE layer's implementations (grouped, per-token
reference, dense) agree with each other and with transformers' router and sparse block; prefix caching,
draft-verify decoding and KV transfer (prefill engine -> decode engine) give the plain engine's tokens;
unsupported config features and a TP degree that does not divide the experts' width are typed errors
naming what is missing.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ModelConfig, MoEConfig
from engine.errors import UnsupportedArchitectureError, UnsupportedFeatureError
from engine import moe
from engine.moe import IMPLS, load_moe_layer, moe_forward, route
from engine.parallel.errors import ParallelConfigError
from engine.parallel.validate import check_supported as check_parallel
from tests.exactness import assert_greedy_equal
from tests.hub_cache import hub_env, lay_out
from tests.kv_helpers import close_all, ship_all
from tests.tiny_llm import generate_to_empty, tiny_llm
from tests.tiny_moe_models import hf_greedy, hf_moe_config, write_tiny_moe

NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
VARIANTS = {  # name -> (arch, write_tiny_moe options)
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {"shard": "100KB"}),
    "mixtral": ("mixtral", {"shard": "100KB"}),
    # layer 0 dense (mlp_only_layers), top-3 weights not renormalised, experts as fused 3-D tensors
    "qwen3_moe-mixed": ("qwen3_moe", {"mlp_only_layers": [0], "norm_topk_prob": False, "original_format": False}),
}
ONE = [[7, 19, 3, 101, 55, 55, 240, 8, 9, 31, 64, 12, 200, 17, 5, 77, 150, 33, 4]]
RAGGED = [list(range(10 + i, 10 + i + n)) for i, n in enumerate([3, 40, 11, 1, 27, 6, 19, 33])]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """name -> (model dir, {prompt set: (tokens, logits)} from transformers), each written and run once."""
    root, cache = tmp_path_factory.mktemp("moe"), {}

    def get(name: str):
        if name not in cache:
            arch, opts = VARIANTS[name]
            d = write_tiny_moe(arch, root / name, **opts)
            cache[name] = d, hf_greedy(d, ONE + RAGGED, NEW)
        return cache[name]

    return get


make = tiny_llm


def run(llm, prompts, params=GREEDY) -> list[list[int]]:
    return generate_to_empty(llm, prompts, params)


# ---- token-exact against transformers ---------------------------------------------------------------
@pytest.mark.parametrize("name", list(VARIANTS))
def test_one_prompt_equals_transformers_generate(model, name):
    d, (tokens, logits) = model(name)
    assert_greedy_equal(tokens[:1], run(make(d), ONE), logits[:1])


@pytest.mark.parametrize("name", list(VARIANTS))
def test_eight_ragged_prompts_together_equal_transformers_generate(model, name):
    d, (tokens, logits) = model(name)
    llm = make(d, max_num_batched_tokens=32)  # prefill in chunks beside decoding rows
    assert_greedy_equal(tokens[1:], run(llm, RAGGED), logits[1:])
    assert llm.scheduler.stats.num_chunked_prefills > 0


def test_configs_read_as_transformers_wrote_them(model):
    cfgs = {n: ModelConfig.from_hf_dict(hf_moe_config(VARIANTS[n][0], **{k: v for k, v in VARIANTS[n][1].items()
                                                                          if k not in ("shard", "original_format")}
                                                       ).to_dict()) for n in VARIANTS}
    assert cfgs["qwen3"].qk_norm and cfgs["qwen3"].moe is None and not cfgs["qwen3"].qkv_bias
    assert cfgs["qwen3_moe"].moe == MoEConfig(8, 3, 32, True, (0, 1), True, "qwen")
    assert cfgs["mixtral"].moe == MoEConfig(8, 2, 32, True, (0, 1), False, "mixtral") and not cfgs["mixtral"].qk_norm
    assert cfgs["qwen3_moe-mixed"].moe.sparse_layers == (1,) and not cfgs["qwen3_moe-mixed"].moe.norm_topk_prob
    four = hf_moe_config("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]).to_dict()
    assert ModelConfig.from_hf_dict(four).moe.sparse_layers == (1,)  # (i + 1) % 2 == 0, minus layer 3


# ---- the MoE layer: implementations and transformers' blocks --------------------------------------------
def _layer(arch: str, dtype: torch.dtype, seed: int = 3, **cfg_over):
    """transformers' sparse MoE block of a tiny `arch` config with random weights, and ours over the same."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf_cfg = hf_moe_config(arch, **cfg_over)
    hf_cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    block = (MixtralSparseMoeBlock if arch == "mixtral" else Qwen3MoeSparseMoeBlock)(hf_cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    block = block.to(dtype).eval()
    state = {f"model.layers.0.mlp.{k}": v for k, v in block.state_dict().items()}  # the fused 3-D layout
    cfg = ModelConfig.from_hf_dict(hf_cfg.to_dict()).moe
    return block, load_moe_layer(cfg, state, lambda n: state[n].contiguous(), "model.layers.0.")


@pytest.mark.parametrize("arch,over", [("mixtral", {}), ("qwen3_moe", {}), ("qwen3_moe", {"norm_topk_prob": False})])
def test_router_and_block_equal_transformers(arch, over):
    block, layer = _layer(arch, torch.float32, **over)
    h = torch.randn(21, 64, generator=torch.Generator().manual_seed(4))
    _, hf_weights, hf_ids = block.gate(h)
    weights, ids = route(layer, h)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
    with torch.inference_mode():
        want = block(h[None])[0]
    for impl in IMPLS:
        torch.testing.assert_close(moe_forward(layer, h, impl), want, atol=2e-5, rtol=1e-5)  # GEMM blocking


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 16, 37])
@pytest.mark.parametrize("host_max", [moe.HOST_GROUPING_MAX, 0, 10 ** 6])  # default; always sort; never sort
def test_grouped_equals_the_per_token_reference(dtype, rows, host_max, monkeypatch):
    """Each expert's rows in one GEMM (weights read once) vs one row at a time: the same numbers up to
    rounding (bf16: one bf16 step of the outputs' scale)."""
    monkeypatch.setattr(moe, "HOST_GROUPING_MAX", host_max)
    _, layer = _layer("qwen3_moe", dtype, seed=5)
    h = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).to(dtype)
    ref = moe_forward(layer, h, "per_token")
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=float(ref.abs().max()) / 64, rtol=0)
    torch.testing.assert_close(moe_forward(layer, h, "grouped"), ref, **tol)
    torch.testing.assert_close(moe_forward(layer, h, "dense"), ref, **tol)
    # the routing matters here: other experts' weights give other outputs
    moved = dict(vars(layer))
    moved["router"] = layer.router.roll(1, dims=0)
    assert (moe_forward(type(layer)(**moved), h, "grouped") - ref).abs().max() > 10 * tol["atol"]


def test_engine_tokens_do_not_depend_on_the_moe_path(model, monkeypatch):
    d, _ = model("mixtral")
    want = run(make(d), RAGGED[:4])
    for impl in ("per_token", "dense"):
        monkeypatch.setenv("PDSERVE_MOE", impl)
        assert_greedy_equal(want, run(make(d), RAGGED[:4]))
    monkeypatch.setenv("PDSERVE_MOE", "sorted")
    with pytest.raises(ValueError, match="PDSERVE_MOE"):
        run(make(d), RAGGED[:1])


def test_bf16_engine_close_to_transformers(model):
    d, (tokens, logits) = model("qwen3_moe")
    outs = make(d, dtype="bfloat16", keep_logits=True).generate(RAGGED, SamplingParams(max_tokens=1, temperature=0))
    got = torch.stack([o.logits[0] for o in outs])
    ref = torch.stack([lg[0] for lg in logits[1:]])  # float32 transformers, first new token
    assert (got - ref).abs().max() < 0.25
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


# ---- the engine's features over MoE layers -----------------------------------------------------------
def test_prefix_caching_and_speculation_keep_plain_tokens(model):
    d, _ = model("qwen3_moe")
    system = list(range(100, 117))
    prompts = [system + [3, 4, 5], system + [9], system + [7, 7, 7, 7, 7]]
    want = run(make(d), prompts)
    cached = make(d, enable_prefix_caching=True)
    assert_greedy_equal(want, [run(cached, [p])[0] for p in prompts])
    assert cached.prefix_stats()["hit_tokens"] >= 32
    spec = make(d, speculative={"proposer": "ngram", "max_draft": 3, "gate": False})
    assert_greedy_equal(want, run(spec, prompts))
    assert spec.spec.stats.num_drafted > 0


def test_kv_transfer_round_trip_equals_one_engine(model):
    """A prefill engine ships each prompt's KV layer by layer (KVSender -> KVReceiver over the in-process
    fake transport) into another page size; decoding there gives the one-engine tokens."""
    d, _ = model("mixtral")
    want = run(make(d), RAGGED[:3])
    pre, dec = make(d, page_size=4, max_num_batched_tokens=16), make(d, page_size=8)
    got, _, (tx, rx, transport) = ship_all(pre, dec, RAGGED[:3], GREEDY)
    assert_greedy_equal(want, got)
    close_all(tx, rx, transport, [pre, dec])


def test_served_by_hub_id_from_a_sharded_snapshot(model, tmp_path, monkeypatch):
    d, _ = model("qwen3_moe")
    assert len(list(d.glob("*.safetensors"))) > 1 and (d / "model.safetensors.index.json").exists()
    hub_env(monkeypatch, tmp_path / "hf")
    files = ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"]
    files += [p.name for p in d.glob("*.safetensors")]
    lay_out(tmp_path / "hf", "pdserve-test/tiny-qwen3-moe", d, files=tuple(files))
    by_id = make("pdserve-test/tiny-qwen3-moe")
    assert by_id.model_dir.parent.name == "snapshots"
    assert_greedy_equal(run(make(d), RAGGED[:3]), run(by_id, RAGGED[:3]))


# ---- what is refused -------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,over,feature", [
    ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                   "original_max_position_embeddings": 128}}, "rope_type=yarn"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act=gelu"),
    ("qwen3", {"attention_bias": True}, "o_proj bias"),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, "layer_types"),
])
def test_unsupported_features_are_named(arch, over, feature):
    d = hf_moe_config(arch, **over).to_dict()
    with pytest.raises(UnsupportedFeatureError, match=feature) as e:
        ModelConfig.from_hf_dict(d)
    assert isinstance(e.value, UnsupportedArchitectureError) and e.value.field == "model"
    assert e.value.features and any(feature in f for f in e.value.features)


def test_a_hub_config_with_an_unsupported_feature_fails_before_any_weights(tmp_path, monkeypatch):
    src = tmp_path / "yarn"
    src.mkdir()
    rope = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "original_max_position_embeddings": 128}
    hf_moe_config("qwen3_moe", rope_parameters=rope).save_pretrained(src)
    hub_env(monkeypatch, tmp_path / "hf")
    lay_out(tmp_path / "hf", "pdserve-test/qwen3-moe-yarn", src, files=("config.json",))  # no weights cached
    with pytest.raises(UnsupportedFeatureError) as e:
        LLM(model="pdserve-test/qwen3-moe-yarn")
    assert "'pdserve-test/qwen3-moe-yarn'" in str(e.value) and "rope_type=yarn" in str(e.value)


def test_shared_experts_are_refused():
    d = dict(hf_moe_config("qwen3_moe").to_dict(), shared_expert_intermediate_size=64)
    with pytest.raises(UnsupportedFeatureError, match="shared experts"):
        ModelConfig.from_hf_dict(d)


def test_unknown_architecture_lists_the_new_ones():
    with pytest.raises(UnsupportedArchitectureError) as e:
        ModelConfig.from_hf_dict({"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]})
    assert all(a in str(e.value) for a in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
                                           "Gemma3ForCausalLM"))


def test_tensor_parallel_splits_experts_and_refuses_a_width_it_does_not_divide():
    moe = ModelConfig.from_hf_dict(hf_moe_config("mixtral").to_dict())
    check_parallel(moe, 2)  # every expert split by its width (tests/unit/test_tp_moe.py)
    odd = ModelConfig.from_hf_dict(hf_moe_config("qwen3_moe", moe_intermediate_size=30).to_dict())
    with pytest.raises(ParallelConfigError, match="expert intermediate size 30") as e:
        check_parallel(odd, 4)
    assert e.value.field == "tensor_parallel_size"
    check_parallel(moe, 1, pp=2)  # pipeline stages hold whole layers: experts and all
    check_parallel(ModelConfig.from_hf_dict(hf_moe_config("qwen3").to_dict()), 2)
