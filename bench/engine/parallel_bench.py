"""Tensor/pipeline-parallel benchmark: one engine per layout (TP=1, TP=2, PP=2, ...), side by side, as ratios.

A random-weight Llama of a real model's shapes (preset `llama3-8b`: hidden 4096, 32 query / 8 KV heads,
intermediate 14336, vocab 128256) with only `--layers` layers (time per layer is what TP changes; the
checkpoint stays small enough to write in seconds) is written once under bench/out/. For each layout the
same engine API runs: prefill of `--prompt` tokens at batch 1 (time to first token), then decode steps at
each `--batch` (median step time over `--steps` steps). Ratios are against the first layout (TP=1).

Run:   .venv/bin/python bench/engine/parallel_bench.py [--device cuda] [--dtype bfloat16] [--layouts tp1 tp2 pp2]
                                                [--preset llama3-8b|tiny] [--layers 4] [--batch 1 16]
On CPU (gloo, one thread per rank) this mostly measures the cost of all-reduces and process hops; the
numbers that matter come from a CUDA machine (NCCL). Writes bench/out/parallel_<preset>_<device>.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine import SamplingParams  # noqa: E402
from engine.llm import LLM  # noqa: E402
from tests.tiny_models import write_tiny_tokenizer  # noqa: E402

PRESETS = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=128256, rope_theta=500000.0),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4,
                 vocab_size=512, rope_theta=10000.0),
}
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "tp4": (4, 1), "tp8": (8, 1), "pp2": (1, 2), "pp4": (1, 4)}


def write_random_llama(out: Path, preset: str, layers: int) -> Path:
    """config.json + one safetensors file of N(0, 0.02) weights in float32 (cast at load) + a word tokenizer."""
    from safetensors.torch import save_file

    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    p = PRESETS[preset]
    h, i, hd = p["hidden_size"], p["intermediate_size"], p["hidden_size"] // p["num_attention_heads"]
    q, kv = p["num_attention_heads"] * hd, p["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)  # bf16 on disk: half the bytes

    w = {"model.embed_tokens.weight": rnd(p["vocab_size"], h), "lm_head.weight": rnd(p["vocab_size"], h),
         "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for n in range(layers):
        pre = f"model.layers.{n}."
        w.update({pre + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                  pre + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                  pre + "self_attn.q_proj.weight": rnd(q, h), pre + "self_attn.k_proj.weight": rnd(kv, h),
                  pre + "self_attn.v_proj.weight": rnd(kv, h), pre + "self_attn.o_proj.weight": rnd(h, q),
                  pre + "mlp.gate_proj.weight": rnd(i, h), pre + "mlp.up_proj.weight": rnd(i, h),
                  pre + "mlp.down_proj.weight": rnd(h, i)})
    save_file(w, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(model_type="llama", num_hidden_layers=layers, rms_norm_eps=1e-5, max_position_embeddings=4096,
               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, **p)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tiny_tokenizer(out, p["vocab_size"])
    return out


def measure(model_dir: Path, layout: str, args) -> dict:
    tp, pp = LAYOUTS[layout]
    with LLM(model=str(model_dir), dtype=args.dtype, device=args.device, num_pages=args.pages, page_size=16,
             max_num_batched_tokens=max(args.prompt, max(args.batch)), max_num_seqs=max(args.batch),
             tensor_parallel_size=tp, pipeline_parallel_size=pp) as llm:
        params = SamplingParams(max_tokens=args.steps + 2, temperature=0.0, ignore_eos=True)
        prompt = [5 + (j % 500) for j in range(args.prompt)]
        llm.generate([prompt[:32]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        row = {"layout": layout, "prefill_s": time.perf_counter() - t}
        for b in args.batch:
            for k in range(b):
                llm.add_request([7 + k, 9, 11, 13], params)
            llm.step()  # the prompts
            times = []
            while llm.has_unfinished():
                t = time.perf_counter()
                llm.step()
                times.append(time.perf_counter() - t)
            row[f"decode_b{b}_s"] = statistics.median(times)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--layouts", nargs="+", default=["tp1", "tp2", "pp2"], choices=sorted(LAYOUTS))
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--pages", type=int, default=256)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = write_random_llama(ROOT / "bench" / "out" / f"random-{args.preset}-{args.layers}l", args.preset,
                                   args.layers)
    rows = [measure(model_dir, layout, args) for layout in args.layouts]
    base = rows[0]
    keys = [k for k in base if k.endswith("_s")]
    print(f"{'layout':8}" + "".join(f"{k:>17}" for k in keys) + "   (ratio to " + base["layout"] + ")")
    for r in rows:
        print(f"{r['layout']:8}" + "".join(f"{r[k] * 1e3:10.1f}ms {base[k] / r[k]:4.2f}x" for k in keys))
    out = args.out or ROOT / "bench" / "out" / f"parallel_{args.preset}_{args.device}.json"
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
