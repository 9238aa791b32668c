"""Gemma 3 text models (Gemma3ForCausalLM) in the engine against transformers' own implementation.

Tiny random checkpoints written with transformers' classes (tests/tiny_gemma_models.py: 6 layers, 5 local of
sliding window 8 : 1 global, their own RoPE each; one variant sharded with an index, one with tied
embeddings, logit soft-capping and another layer pattern) are served from a directory and by Hub id from an
offline Hub cache: greedy tokens equal transformers' generate() in float32 for one prompt and for 8 ragged
prompts run together (chunked prefill, continuous batching), every prompt or its decode crossing the window;
without the local window the tokens differ (the window is exercised). bf16 within the engine tests'
tolerance; head_dim 256 through the CPU kernels; prefix caching, draft-verify decoding and KV transfer give
the plain engine's tokens; both config spellings read alike; unsupported features are named. The multimodal
checkpoints (Gemma3ForConditionalGeneration, in the Hub's and transformers 5's tensor names) serve their
language model, token-exact against transformers' multimodal model on text; a Hub-shaped 27B config reads as
transformers and the planner's catalog entry read it.
"""
from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.attention_context import SeqLayout, build_context
from engine.config import ModelConfig
from engine.errors import UnsupportedArchitectureError, UnsupportedFeatureError
from tests.exactness import assert_greedy_equal, assert_logits_close
from tests.hub_cache import hub_env, lay_out
from tests.kv_helpers import close_all, ship_all
from tests.tiny_llm import generate_to_empty, tiny_llm
from tests.tiny_gemma_models import (WINDOW, hf_gemma_config, hf_gemma_greedy, write_tiny_gemma,
                                     write_tiny_gemma_multimodal)

NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
PATTERN = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention",
           "sliding_attention"]
VARIANTS = {  # name -> write_tiny_gemma options
    "gemma3": {"shard": "100KB"},
    # as the real checkpoints: LM head tied to the embeddings; plus a logit cap and another layer pattern
    "gemma3-tied-capped": {"tie_word_embeddings": True, "initializer_range": 0.03, "final_logit_softcapping": 2.0,
                           "layer_types": PATTERN},
}
ONE = [[7, 19, 3, 101, 55, 55, 240, 8, 9, 31, 64, 12, 200, 17, 5, 77, 150, 33, 4]]
RAGGED = [list(range(10 + i, 10 + i + n)) for i, n in enumerate([3, 40, 11, 1, 27, 6, 19, 33])]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """name -> (model dir, (tokens, logits) from transformers for ONE + RAGGED), each written and run once."""
    root, cache = tmp_path_factory.mktemp("gemma"), {}

    def get(name: str):
        if name not in cache:
            d = write_tiny_gemma(root / name, **VARIANTS[name])
            cache[name] = d, hf_gemma_greedy(d, ONE + RAGGED, NEW)
        return cache[name]

    return get


make = tiny_llm


def run(llm, prompts, params=GREEDY) -> list[list[int]]:
    return generate_to_empty(llm, prompts, params)


# ---- token-exact against transformers ---------------------------------------------------------------
@pytest.mark.parametrize("name", list(VARIANTS))
def test_one_prompt_equals_transformers_generate(model, name):
    """Tokens, and logits within 1e-4 (soft-capping is monotonic: only the logits show a missing cap)."""
    d, (tokens, logits) = model(name)
    out = make(d, keep_logits=True).generate(ONE, GREEDY)[0]
    assert_greedy_equal(tokens[:1], [out.token_ids], logits[:1])
    assert_logits_close(logits[0], torch.stack(out.logits), NEW, atol=1e-4)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_eight_ragged_prompts_together_equal_transformers_generate(model, name):
    d, (tokens, logits) = model(name)
    llm = make(d, max_num_batched_tokens=32)  # prefill in chunks beside decoding rows
    assert_greedy_equal(tokens[1:], run(llm, RAGGED), logits[1:])
    assert llm.scheduler.stats.num_chunked_prefills > 0


def test_the_local_window_is_exercised(model, monkeypatch):
    """Local layers attending to every position (no windowed view) give other tokens than transformers'."""
    d, (tokens, _) = model("gemma3")
    monkeypatch.setattr(ModelConfig, "local_window", property(lambda self: None))
    assert run(make(d), ONE + RAGGED[:2]) != tokens[:3]


def test_dense_decode_copies_serve_global_layers_only(model, monkeypatch):
    """float32 decode groups keep dense K/V copies across steps (kv_cache/dense_decode.py, every group here):
    planned on the step's full context, continued by every step; the local layers' windowed view gathers."""
    from engine.kv_cache import dense_decode as dd

    monkeypatch.setattr(dd, "MIN_GROUP_BYTES", 0)
    counts = {"continue": 0}
    real = dd.DenseDecode._continue

    def counting(self, *a):
        ok = real(self, *a)
        counts["continue"] += ok
        return ok
    monkeypatch.setattr(dd.DenseDecode, "_continue", counting)
    d, (tokens, logits) = model("gemma3")
    assert_greedy_equal(tokens[1:], run(make(d), RAGGED), logits[1:])
    assert counts["continue"] > 10


def test_local_view_only_where_a_row_reaches_past_the_window():
    short = [SeqLayout("a", 3, 4, [0, 1]), SeqLayout("b", 1, 7, [2, 3])]  # 7 and 8 slots: within 8
    assert build_context(short, 4, 0.5, local_window=WINDOW).local is None
    ctx = build_context(short + [SeqLayout("c", 1, 9, [4, 5, 6])], 4, 0.5, local_window=WINDOW)
    local = ctx.local
    assert local is not None and local.base is ctx and local.write_slots is ctx.write_slots
    g = local.groups[-1]  # c's decode row: 10 slots, sees the last 8
    assert g.windowed and g.mask[-1, 0, 0].tolist() == [False, False] + [True] * 8
    assert not any(g.windowed for g in ctx.groups)


def test_bf16_engine_close_to_transformers(model):
    d, (tokens, logits) = model("gemma3")
    outs = make(d, dtype="bfloat16", keep_logits=True).generate(RAGGED, SamplingParams(max_tokens=1, temperature=0))
    got = torch.stack([o.logits[0] for o in outs])
    ref = torch.stack([lg[0] for lg in logits[1:]])  # float32 transformers, first new token
    assert (got - ref).abs().max() < 0.25
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize("switch", ["paged_kernel", "prefill_kernel"])
def test_head_dim_256_through_the_cpu_kernels(tmp_path, monkeypatch, switch):
    """Real Gemma 3 heads are 256 wide: bf16 global layers' decode (numba) and prefill chunks (AVX512-BF16 C,
    where the CPU has it) through the kernels give the tokens of the SDPA path."""
    from engine.kv_cache.raw import RawKVBackend

    d = write_tiny_gemma(tmp_path / "g256", head_dim=256, query_pre_attn_scalar=256, num_hidden_layers=3,
                         layer_types=PATTERN[:3])
    prompts = [ONE[0], RAGGED[1][:20], RAGGED[4]]
    with_kernel = run(make(d, dtype="bfloat16", max_num_batched_tokens=16), prompts)
    monkeypatch.setattr(RawKVBackend, switch, False)
    assert_greedy_equal(run(make(d, dtype="bfloat16", max_num_batched_tokens=16), prompts), with_kernel)


# ---- the engine's features over Gemma layers --------------------------------------------------------
def test_prefix_caching_and_speculation_keep_plain_tokens(model):
    d, _ = model("gemma3")
    system = list(range(100, 117))  # 17 tokens: past the window
    prompts = [system + [3, 4, 5], system + [9], system + [7, 7, 7, 7, 7]]
    want = run(make(d), prompts)
    cached = make(d, enable_prefix_caching=True)
    assert_greedy_equal(want, [run(cached, [p])[0] for p in prompts])
    assert cached.prefix_stats()["hit_tokens"] >= 32
    spec = make(d, speculative={"proposer": "ngram", "max_draft": 3, "gate": False})
    assert_greedy_equal(want, run(spec, prompts))
    assert spec.spec.stats.num_drafted > 0


def test_kv_transfer_round_trip_equals_one_engine(model):
    """A prefill engine ships each prompt's KV layer by layer into another page size; decoding there gives
    the one-engine tokens (every layer's pages shipped: local layers keep theirs too)."""
    d, _ = model("gemma3-tied-capped")
    want = run(make(d), RAGGED[:3])
    pre, dec = make(d, page_size=4, max_num_batched_tokens=16), make(d, page_size=8)
    got, _, (tx, rx, transport) = ship_all(pre, dec, RAGGED[:3], GREEDY)
    assert_greedy_equal(want, got)
    close_all(tx, rx, transport, [pre, dec])


def test_served_by_hub_id_from_a_sharded_snapshot(model, tmp_path, monkeypatch):
    d, _ = model("gemma3")
    assert len(list(d.glob("*.safetensors"))) > 1 and (d / "model.safetensors.index.json").exists()
    hub_env(monkeypatch, tmp_path / "hf")
    files = ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"]
    files += [p.name for p in d.glob("*.safetensors")]
    lay_out(tmp_path / "hf", "pdserve-test/tiny-gemma-3", d, files=tuple(files))
    by_id = make("pdserve-test/tiny-gemma-3")
    assert by_id.model_dir.parent.name == "snapshots"
    assert_greedy_equal(run(make(d), RAGGED[:3]), run(by_id, RAGGED[:3]))


# ---- configs: both spellings, and what is refused ----------------------------------------------------
def test_configs_read_as_transformers_wrote_them():
    cfg = ModelConfig.from_hf_dict(hf_gemma_config().to_dict())
    g = cfg.gemma
    assert (g.sliding_window, g.local_layers, g.query_pre_attn_scalar) == (WINDOW, (0, 1, 2, 3, 4), 24.0)
    assert cfg.local_window == WINDOW and cfg.sliding_window is None and cfg.head_dim == 32
    assert cfg.rope == {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}
    assert g.local_rope == {"rope_type": "default", "rope_theta": 10_000.0}
    # the Hub's older spelling (google/gemma-3-*'s config.json): rope_theta / rope_local_base_freq /
    # rope_scaling / sliding_window_pattern instead of rope_parameters per layer type and layer_types
    old = {k: v for k, v in hf_gemma_config().to_dict().items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1e6, rope_local_base_freq=10_000.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
               sliding_window_pattern=6)
    assert ModelConfig.from_hf_dict(old) == cfg
    every_layer_global = ModelConfig.from_hf_dict(hf_gemma_config(layer_types=["full_attention"] * 6).to_dict())
    assert every_layer_global.local_window is None


@pytest.mark.parametrize("over,feature", [
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"hidden_activation": "gelu"}, "hidden_activation=gelu"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6,
                                             "original_max_position_embeddings": 128}}},
     "rope_type=yarn for full_attention"),
])
def test_unsupported_features_are_named(over, feature):
    d = hf_gemma_config(**over).to_dict()
    with pytest.raises(UnsupportedFeatureError, match=feature) as e:
        ModelConfig.from_hf_dict(d)
    assert isinstance(e.value, UnsupportedArchitectureError) and e.value.field == "model"


# ---- the multimodal checkpoints (google/gemma-3-4b/12b/27b-it): their language model --------------------
@pytest.mark.parametrize("original_format", [True, False])  # the Hub's language_model.*; transformers 5's names
def test_multimodal_checkpoint_serves_its_language_model(tmp_path, original_format):
    """Gemma3ForConditionalGeneration saved by transformers: the engine reads its text_config and its language
    model's tensors (the vision tower unread) and gives transformers' own multimodal generate() on text."""
    d = write_tiny_gemma_multimodal(tmp_path / "mm", original_format=original_format, initializer_range=0.03)
    prompts = ONE + RAGGED[1:3]
    tokens, logits = hf_gemma_greedy(d, prompts, NEW)
    assert_greedy_equal(tokens, run(make(d, max_num_batched_tokens=32), prompts), logits)


def test_multimodal_weights_load_by_tensor_parallel_rank(tmp_path):
    from engine.loader import load_config, load_weights
    from engine.parallel.rank_worker import load_shard

    d = write_tiny_gemma_multimodal(tmp_path / "mm")
    whole, half = load_weights(d), load_shard(d, load_config(d), 1, 2)
    assert set(whole) == set(half) and not any("vision" in n or "projector" in n for n in whole)
    assert "model.embed_tokens.weight" in whole and "lm_head.weight" not in whole  # tied
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(half[q], whole[q][64:])  # rank 1's two query heads of 32


# google/gemma-3-27b-it's config.json (vision_config left out): the text_config writes only what differs from
# transformers' Gemma3TextConfig defaults, in the older spelling (rope_scaling for the global layers)
GEMMA3_27B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
    "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144, "mm_tokens_per_image": 256,
    "text_config": {"head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
                    "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
                    "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
}


def test_a_hub_multimodal_config_reads_as_transformers_and_the_planner_catalog_read_it():
    from transformers import Gemma3Config

    from cluster.planner.inputs.models import load_model

    cfg = ModelConfig.from_hf_dict(GEMMA3_27B_IT)
    hf = Gemma3Config(**GEMMA3_27B_IT).text_config.to_dict()  # transformers fills in its defaults
    want = ModelConfig.from_hf_dict({**hf, "eos_token_id": [1, 106], "tie_word_embeddings": True})
    assert cfg == want and cfg.eos_token_ids == (1, 106) and cfg.tie_word_embeddings
    assert cfg.rope == {"factor": 8.0, "rope_type": "linear", "rope_theta": 1e6}
    assert (cfg.local_window, len(cfg.gemma.local_layers), cfg.gemma.local_rope["rope_theta"]) == (1024, 52, 1e4)
    g = load_model("gemma-3-27b")  # deploy/models/gemma-3-27b.yaml, whose hf_id is this checkpoint
    assert g.hf_id == "google/gemma-3-27b-it" and g.architecture == "Gemma3ForCausalLM"
    assert (g.layers, g.hidden, g.heads, g.kv_heads, g.head_dim, g.ffn, g.sliding_window, g.local_layers) == (
        cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
        cfg.local_window, len(cfg.gemma.local_layers))


def test_a_multimodal_config_without_a_text_config_is_refused():
    with pytest.raises(UnsupportedFeatureError) as e:
        ModelConfig.from_hf_dict({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]})
    assert "Gemma3ForConditionalGeneration" in str(e.value) and "text_config" in str(e.value)
