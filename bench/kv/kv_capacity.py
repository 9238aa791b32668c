"""How many requests a decode worker holds at once in a fixed KV memory budget, with and without compression.

For each config (storage format, optionally an eviction policy on the prefill side -- the same strings as
bench/kv/kv_quality.py), a prefill engine and a decode engine run in this process with the in-process fake
transport (the real sender, receiver, reservations and admission; only the wire is skipped). The decode
engine gets `--budget-mb` of KV pages in its format (pages = budget / bytes per page). `--requests`
prompts of `--prompt` tokens (real text) with `--output` new tokens each are offered at once; a request
is admitted when the decode side can reserve pages for its whole prompt (the reservation is sized before
the prefill runs; after an eviction the surplus returns at commit). Reported per config: pages, peak
running requests on the decode side, decode preemptions, KV bytes shipped per prompt token vs raw, and
wall time. The ratio of peaks vs raw is the capacity gain.
kivi4 (engine/kv_cache/kivi.py) ships whole pages only (keep `--prompt` a multiple of the page size, 16)
and keeps a full-precision staging copy of the page each running sequence is filling, outside the page
budget: `staging_mb` reports its high-water mark on the decode side.
Run:  .venv/bin/python bench/kv/kv_capacity.py [--configs raw,int8,snapkv:0.3+int8] [--budget-mb 32]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.kv_cache.quality import corpus_ids, parse_config  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.errors import OutOfPagesError  # noqa: E402
from kv_transfer.config import ReceiverConfig, SenderConfig  # noqa: E402
from kv_transfer.fake_transport import FakeTransport  # noqa: E402
from kv_transfer.receiver import KVReceiver  # noqa: E402
from kv_transfer.sender import KVSender  # noqa: E402


def run(name: str, a) -> dict:
    fmt, eviction = parse_config(name)
    if eviction:
        eviction["min_prompt"] = min(eviction["min_prompt"], a.prompt)
    kw = dict(model=a.model, dtype=a.dtype, kv_storage=fmt, page_size=16, max_num_batched_tokens=1024,
              max_num_seqs=256)
    pre = LLM(num_pages=-(-(a.prompt + 16) * 4 // 16), kv_eviction=eviction, **kw)
    num_pages = int(a.budget_mb * 2**20 // pre.kv_spec.bytes_per_page())
    dec = LLM(num_pages=num_pages, **kw)
    transport = FakeTransport()
    rx = KVReceiver(dec, ReceiverConfig())
    address = rx.serve(transport)
    tx = KVSender(pre, transport, SenderConfig(chunk_bytes=256 << 10))
    params = SamplingParams(max_tokens=a.output, temperature=0.0, ignore_eos=True)
    pending = [corpus_ids(pre.tokenizer, a.prompt, offset=1000 + 97 * i) for i in range(a.requests)]
    peak, done, t0 = 0, 0, time.perf_counter()
    while pending or tx.num_live or rx.num_live or dec.has_unfinished():
        while pending and len(pre.scheduler.waiting) + len(pre.scheduler.running) < 2:
            try:
                desc = rx.reserve(len(pending[0]), params, lease_s=3600)  # a shared machine: no lapses
            except OutOfPagesError:
                break
            tx.send(pre.add_request(pending.pop(0), params, prefill_only=True), desc, address)
        if pre.has_unfinished():
            tx.step()
        else:
            tx.poll()
        done += sum(o.finished for o in rx.step())
        peak = max(peak, len(dec.scheduler.running))
    statuses = [tx.status(rid) for rid in list(tx._ended)]
    failed = [s.reason for s in statuses if s.state.value != "done"]
    sent_bytes = [s.bytes for s in statuses if s.state.value == "done"]
    raw = pre.config.num_layers * 2 * pre.config.num_kv_heads * pre.config.head_dim * 2  # bf16 raw per token
    tx.close()
    rx.close()
    transport.close()
    assert not failed and done == a.requests, (done, failed[:3])
    return {"pages": num_pages, "peak_running": peak, "finished": done,
            "preemptions": dec.scheduler.stats.num_preemptions,
            "staging_mb": getattr(dec.backend, "staging_rows", 0) * dec.kv_spec.page_size * 2 * dec.config.num_layers
            * dec.config.num_kv_heads * dec.config.head_dim * dec.kv_spec.itemsize / 2**20,
            "bytes_per_prompt_token_vs_raw_bf16": sum(sent_bytes) / (len(sent_bytes) * a.prompt * raw),
            "seconds": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--configs", default="raw,int8,snapkv:0.3,snapkv:0.3+int8")
    ap.add_argument("--budget-mb", type=float, default=32.0)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--out")
    a = ap.parse_args()
    results = {}
    for name in a.configs.split(","):
        results[name] = run(name, a)
        print(name, results[name], flush=True)
    base = results[next(iter(results))]["peak_running"]
    print(f"\nKV capacity | {a.model} {a.dtype} | {a.budget_mb} MB of decode KV | {a.requests} x ({a.prompt} prompt "
          f"+ {a.output} new)")
    print(f"{'config':16} {'pages':>6} {'peak running':>12} {'vs first':>8} {'preempt':>7} {'bytes/token':>11}")
    for name, r in results.items():
        print(f"{name:16} {r['pages']:6d} {r['peak_running']:12d} {r['peak_running'] / max(base, 1):7.2f}x "
              f"{r['preemptions']:7d} {r['bytes_per_prompt_token_vs_raw_bf16']:10.3f}x")
    out = Path(a.out) if a.out else ROOT / "bench" / "out" / "kv_capacity.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "results": results}, indent=1))
    print(f"reproduce: .venv/bin/python bench/kv/kv_capacity.py {' '.join(sys.argv[1:])}\nwrote {out}")


if __name__ == "__main__":
    main()
