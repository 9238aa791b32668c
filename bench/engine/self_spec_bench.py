"""Self-speculation (`self_sparse`) vs plain decoding at long context: output tokens/s side by side, as ratios.

    .venv/bin/python bench/engine/self_spec_bench.py --cells 4096:1 8192:8 --new 32

For each context length, one real-text prompt (Python's own documentation) is prefilled once by a plain
engine and its KV exported (`page_io.export_kv`); each cell (context x batch) then builds a plain engine
and a self_sparse engine (SmolLM2-135M bf16, one thread, same process) and joins `batch` copies of that
request into both through `reserve` + `import_kv` + `add_prefilled_request` (as a decode worker receives KV:
the self_sparse engine builds page summaries on import). Rows are identical, so a batch's rows make the
same tokens; what is timed is decode only: a warm-up of 6 tokens per side, then plain, spec, spec, plain
(--repeats pairs, order alternating), `--new` tokens per row, greedy, EOS ignored. Printed per cell: output
tokens/s of each side and their ratio (median over pairs), whether both made the same tokens, the spec
side's acceptance rate, tokens per verify, share of steps speculated, and the draft cost: ms per sparse
draft forward beside ms per plain decode step, and the share of the spec run spent drafting.

The machine is shared and noisy (2 cores, other processes): a figure needs a quiet machine; read the
ratios of one interleaved run. SmolLM2's context window is 8,192, so the largest context is 8,192 - new - 1.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pydoc_data.topics import topics  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.kv_cache.page_io import export_kv, import_kv  # noqa: E402

now = time.perf_counter
WINDOW = 8192


def long_prompt(llm: LLM, n: int) -> list[int]:
    ids: list[int] = []
    for key in sorted(topics):
        ids += llm.tokenizer.encode(topics[key] + "\n")
        if len(ids) >= n:
            return ids[:n]
    raise ValueError(f"not {n} tokens of documentation")


def prefill(ctx: int, dtype: str) -> tuple[list[int], int, list[bytes]]:
    """(prompt, first token, K-then-V bytes per layer) of one ctx-token prompt."""
    llm = LLM(dtype=dtype, num_pages=-(-ctx // 16) + 8, max_model_len=WINDOW, max_num_batched_tokens=1024)
    prompt = long_prompt(llm, ctx)
    rid = llm.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0), prefill_only=True)  # (1: ends at length, not HELD)
    first = [o for o in llm.generate_until_idle() if o.request_id == rid][0].token_ids[0]
    pages, n = llm.held_pages(rid)
    kv = [b"".join(bytes(x) for x in export_kv(llm.backend, layer, pages, 0, n)) for layer in llm.kv_spec.local_layers]
    llm.release_held(rid)
    return prompt, first, kv


def join(llm: LLM, prompt, first, kv, batch: int, new: int) -> None:
    for _ in range(batch):
        res = llm.reserve(len(prompt))
        for layer, payload in zip(llm.kv_spec.local_layers, kv):
            import_kv(llm.backend, layer, res.pages, 0, len(prompt), payload)
        llm.add_prefilled_request(prompt, first, res.reservation_id,
                                  SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))


def run(llm: LLM, prompt, first, kv, batch: int, new: int) -> tuple[float, list[list[int]]]:
    """Seconds to decode `new` tokens for `batch` rows (joined first, not timed) and their tokens."""
    join(llm, prompt, first, kv, batch, new)
    t0, outs = now(), {}
    while llm.has_unfinished():
        for o in llm.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
    return now() - t0, list(outs.values())


class DraftTimer:
    """Wall seconds and forwards spent in the self_sparse proposer."""

    def __init__(self, llm: LLM):
        self.seconds, p = 0.0, llm.spec.proposers["self_sparse"]
        real = p.propose_batch

        def timed(states):
            t0 = now()
            try:
                return real(states)
            finally:
                self.seconds += now() - t0

        p.propose_batch = timed
        self.proposer = p


def cell(ctx: int, batch: int, new: int, repeats: int, data, a) -> dict:
    prompt, first, kv = data
    pages = batch * -(-(ctx + new + 2 * a.max_draft) // 16) + 16
    kw = dict(dtype=a.dtype, num_pages=pages, max_model_len=WINDOW, max_num_seqs=batch)
    plain = LLM(**kw)
    spec = LLM(**kw, speculative={"proposer": "self_sparse", "max_draft": a.max_draft, "gate": not a.no_gate,
                                  "proposer_options": {"budget": a.budget, "select_per": a.select_per}})
    run(plain, prompt, first, kv, batch, 6)  # warm-up: kernels compiled/loaded, the gate's first fit
    run(spec, prompt, first, kv, batch, 6)  # (>= 3 tokens: a request drafts from its second output on)
    timer = DraftTimer(spec)
    spec.spec.stats = type(spec.spec.stats)()
    timer.proposer.num_draft_forwards = 0
    plain_s, spec_s, ratios, same = [], [], [], True
    for r in range(repeats):
        order = [(plain, plain_s), (spec, spec_s)][:: 1 if r % 2 == 0 else -1]
        toks = {}
        for llm, acc in order:
            sec, t = run(llm, prompt, first, kv, batch, new)
            acc.append(sec)
            toks[id(llm)] = t
        same &= toks[id(plain)] == toks[id(spec)]
        ratios.append(plain_s[-1] / spec_s[-1])
    st = spec.spec.stats
    n_plain_steps = new * repeats  # one token per row per plain step
    fwd = timer.proposer.num_draft_forwards
    out = dict(context=ctx, batch=batch, new=new, plain_tok_s=batch * new / statistics.median(plain_s),
               spec_tok_s=batch * new / statistics.median(spec_s), ratio=statistics.median(ratios), same=same,
               acceptance=st.acceptance_rate, tokens_per_verify=st.tokens_per_verify, spec_share=st.spec_share,
               plain_step_ms=1000 * sum(plain_s) / n_plain_steps,
               draft_fwd_ms=1000 * timer.seconds / fwd if fwd else float("nan"),
               draft_share=timer.seconds / sum(spec_s), runs_plain_s=plain_s, runs_spec_s=spec_s)
    print(f"{ctx:>7} {batch:>5} {out['plain_tok_s']:>9.2f} {out['spec_tok_s']:>9.2f} {out['ratio']:>6.2f}x "
          f"{str(same):>5} {out['acceptance']:>6.2f} {out['tokens_per_verify']:>6.2f} {out['spec_share']:>6.2f} "
          f"{out['plain_step_ms']:>8.1f} {out['draft_fwd_ms']:>8.1f} {out['draft_share']:>6.2f}", flush=True)
    for llm in (plain, spec):
        assert not llm.has_unfinished() and llm.kv_usage()["pages_in_use"] == 0
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", nargs="+", default=["4096:1", "4096:8", "8160:1", "8160:8"],
                    help="context:batch (context <= 8192 - new - 1)")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--select-per", default="row", choices=["row", "kv_head"])
    ap.add_argument("--max-draft", type=int, default=4)
    ap.add_argument("--no-gate", action="store_true")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    cells = [tuple(int(x) for x in c.split(":")) for c in a.cells]
    prefilled = {}
    print(f"{'context':>7} {'batch':>5} {'plain t/s':>9} {'spec t/s':>9} {'ratio':>7} {'same':>5} {'accept':>6} "
          f"{'tok/vf':>6} {'share':>6} {'plain ms':>8} {'draft ms':>8} {'draft%':>6}")
    results = []
    for ctx, batch in cells:
        ctx = min(ctx, WINDOW - a.new - 2 * a.max_draft - 1)
        if ctx not in prefilled:
            prefilled[ctx] = prefill(ctx, a.dtype)
        results.append(cell(ctx, batch, a.new, a.repeats, prefilled[ctx], a))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(a).items()}, results=results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
