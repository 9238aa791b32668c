"""Tiny random-weight Llama / Mistral / Qwen2 checkpoints for fast tests (written once per session).

Most tests read one model, the `tiny_dir` fixture (tests/conftest.py: `write_tiny_llama`, written once per
session); a test that needs another shape writes its own with `write_tiny`."""
from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# Weights drawn this wide make greedy tokens vary and logits differ (HF's default 0.02 leaves attention nearly
# uniform, so a RoPE or mask bug would move logits by less than the tests' tolerances).
INIT_RANGE = 0.1


def hf_config(arch: str, **overrides):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    kw = dict(TINY, **overrides)
    if arch == "llama":
        kw.setdefault("tie_word_embeddings", False)
        kw.setdefault("rope_theta", 10000.0)
        return LlamaConfig(**kw)
    if arch == "mistral":
        kw.setdefault("sliding_window", None)
        return MistralConfig(**kw)
    if arch == "qwen2":
        kw.setdefault("tie_word_embeddings", True)
        return Qwen2Config(**kw)
    raise ValueError(arch)


def write_tiny(arch: str, out: Path, seed: int = 0, **overrides) -> Path:
    """Save a random-weight model of `arch` as a safetensors directory; returns the directory."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(arch, **overrides), dtype=torch.float32)
    with torch.no_grad():  # default init leaves biases at zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(out)
    write_tiny_tokenizer(Path(out), model.config.vocab_size)
    return Path(out)


def write_tiny_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the words t0 .. t{vocab-1} ("t2" is EOS), so `LLM` can load the dir."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2", "bos_token": "t1"}))


def write_tiny_llama(tmp_path_factory, name: str = "tiny", **overrides) -> Path:
    """The tiny Llama most tests serve (`TINY`, weights drawn with `INIT_RANGE`, seed 0) in a fresh folder;
    `overrides` change its config (a longer context, another vocabulary)."""
    return write_tiny("llama", tmp_path_factory.mktemp(name) / "llama", initializer_range=INIT_RANGE, **overrides)
