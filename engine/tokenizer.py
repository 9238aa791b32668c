"""Tokenizer and chat template for a model directory.

Encoding and decoding use the `tokenizers` library on `tokenizer.json` directly (importing transformers
costs seconds at start-up); the chat template, used less often, loads transformers' AutoTokenizer lazily.
"""
from __future__ import annotations

import json
from pathlib import Path


class Tokenizer:
    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer as FastTokenizer

        self.model_dir = Path(model_dir)
        self.fast = FastTokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        cfg_path = self.model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        eos = cfg.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_token_id = self.fast.token_to_id(eos) if eos else None
        self._hf = None

    def encode(self, text: str) -> list[int]:
        return self.fast.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.fast.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if self._hf is None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(str(self.model_dir))
        out = self._hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if hasattr(out, "keys"):  # BatchEncoding in newer transformers
            out = out["input_ids"]
        return list(out)
