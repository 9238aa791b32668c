"""Engine benchmark: pdserve `LLM` against Hugging Face transformers, side by side in one run, as ratios.

What it measures (SmolLM2-135M, one torch thread, same dtype on both sides; transformers with sdpa under
`torch.inference_mode`, left padding; one warm-up per side, then engine, HF, engine, HF ... --repeats
times, median reported):
  single  1 request, 128 new tokens (greedy, EOS ignored): engine tokens/s / HF tokens/s    target >= 1.5x
  step16  decode step at batch 16, context ~300: engine ms / HF ms                           target <= 0.5x
  batch   16 requests, real-text prompts of 64-512 tokens, 64 new tokens each: output tokens/s of
          the engine (continuous batching) / HF generate() on the left-padded batch         target >= 2x
  floor   decode step at batch 1 / floor, floor = weight bytes / read bandwidth (sum over a
          1 GiB float32 tensor written first; best of a few runs)                            target <= 2.5x

Order: load engine + HF model -> each figure in turn (setup, warm-up, interleaved runs) -> table -> JSON.
Run:   .venv/bin/python bench/engine/engine_bench.py [--dtype float32] [--repeats 3] [--quick] [--only step16 ...]
Writes bench/out/engine_<dtype>.json (engine_<dtype>_quick.json with --quick) or --out PATH.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from pydoc_data.topics import topics

torch.set_num_threads(1)  # before any op: the comparison is one thread on both sides
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # plain script folder: make `engine` importable without an install
    sys.path.insert(0, str(ROOT))

import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402

FIGURES = ("single", "step16", "batch", "floor")
now = time.perf_counter


@dataclass(frozen=True)
class Sizes:
    single_prompt: int = 64
    single_new: int = 128
    step_batch: int = 16
    step_ctx: int = 300
    step_steps: int = 16  # timed decode steps per run
    batch_n: int = 16
    batch_min: int = 64
    batch_max: int = 512
    batch_new: int = 64
    floor_ctx: int = 300
    floor_steps: int = 32
    bw_runs: int = 5


QUICK = Sizes(single_new=32, step_batch=4, step_ctx=128, step_steps=8, batch_n=4, batch_max=256,
              batch_new=16, floor_ctx=128, floor_steps=8, bw_runs=3)


@dataclass
class Figure:
    name: str
    what: str
    unit: str
    engine: float  # median
    ref: float  # median of transformers, or the floor
    ref_name: str
    higher_is_better: bool
    target: float
    samples: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.engine / self.ref

    @property
    def ok(self) -> bool:
        return self.ratio >= self.target if self.higher_is_better else self.ratio <= self.target


@dataclass
class Bench:
    llm: LLM
    hf: object  # transformers model
    pad_id: int
    sizes: Sizes
    repeats: int


def check(cond: bool, what: str) -> None:
    if not cond:
        raise RuntimeError(f"benchmark invariant broken: {what}")


# ---- inputs --------------------------------------------------------------------------------------
def text_prompts(llm: LLM, lengths: list[int]) -> list[list[int]]:
    """Real English prompts: stdlib documentation topics, tokenized and cut to each wanted length."""
    need = max(lengths)
    texts = [topics[k] for k in sorted(topics) if len(topics[k]) > 6 * need]  # ~4 chars per token
    check(bool(texts), f"no pydoc topic long enough for {need} tokens")
    out = []
    for i, n in enumerate(lengths):
        ids = llm.tokenizer.encode(texts[i % len(texts)])
        start = (i // len(texts)) * 17  # reuse a topic at a shifted offset when there are more prompts
        check(len(ids) >= start + n, f"topic too short for a {n}-token prompt")
        out.append(ids[start:start + n])
    return out


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> input_ids, attention_mask, both [batch, longest prompt], padding on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


def interleave(engine_fn, hf_fn, repeats: int, warm=None) -> tuple[list[float], list[float]]:
    """One warm-up per side, then engine, HF, engine, HF ... `repeats` times."""
    for fn in warm or (engine_fn, hf_fn):
        fn()
    e, h = [], []
    for _ in range(repeats):
        e.append(engine_fn())
        h.append(hf_fn())
    return e, h


def greedy(new: int) -> SamplingParams:  # EOS ignored: every request runs to max_tokens
    return SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)


# ---- generation (figures single and batch) ----------------------------------------------------
def engine_generate(b: Bench, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    """-> output tokens/s over the whole run (prefill included), output token ids per prompt."""
    llm, t0 = b.llm, now()
    outs = llm.generate(prompts, greedy(new))
    dt = now() - t0
    toks = [o.token_ids for o in outs]
    check(all(len(t) == new for t in toks), f"engine produced {[len(t) for t in toks]} tokens, wanted {new}")
    check(llm.kv_usage()["pages_in_use"] == 0, "engine kept KV pages after generate()")
    return sum(map(len, toks)) / dt, toks


@torch.inference_mode()
def hf_generate(b: Bench, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    ids, mask = left_pad(prompts, b.pad_id)
    t0 = now()
    out = b.hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    dt = now() - t0
    gen = out[:, ids.shape[1]:]
    check(gen.shape[1] == new, f"transformers produced {gen.shape[1]} tokens, wanted {new}")
    return gen.numel() / dt, gen.tolist()


def fig_single(b: Bench) -> Figure:
    s = b.sizes
    prompt = text_prompts(b.llm, [s.single_prompt])
    seen = {}

    def run(side: str, gen) -> float:  # keeps each side's last tokens to compare them
        tps, seen[side] = gen(b, prompt, s.single_new)
        return tps

    e, h = interleave(lambda: run("engine", engine_generate), lambda: run("hf", hf_generate), b.repeats)
    a, c = seen["engine"][0], seen["hf"][0]
    agree = next((i for i, (x, y) in enumerate(zip(a, c)) if x != y), len(a))  # greedy tokens in common
    return Figure("single", f"1 request, {s.single_new} new tokens", "tok/s", statistics.median(e),
                  statistics.median(h), "transformers", True, 1.5, {"engine": e, "transformers": h},
                  {"prompt_tokens": s.single_prompt, "greedy_tokens_agreeing": agree})


def fig_batch(b: Bench) -> Figure:
    s = b.sizes
    step = (s.batch_max - s.batch_min) / max(1, s.batch_n - 1)
    lengths = [round(s.batch_min + i * step) for i in range(s.batch_n)]
    lengths = lengths[0::2] + lengths[1::2][::-1]  # mix short and long in arrival order
    prompts = text_prompts(b.llm, lengths)
    warm = (lambda: engine_generate(b, prompts[:4], 4), lambda: hf_generate(b, prompts[:4], 4))
    e, h = interleave(lambda: engine_generate(b, prompts, s.batch_new)[0],
                      lambda: hf_generate(b, prompts, s.batch_new)[0], b.repeats, warm)
    return Figure("batch", f"{s.batch_n} requests x {s.batch_new} new, prompts {s.batch_min}-{s.batch_max}",
                  "tok/s", statistics.median(e), statistics.median(h), "transformers", True, 2.0,
                  {"engine": e, "transformers": h}, {"prompt_lengths": lengths})


# ---- decode steps (figures step16 and floor) ---------------------------------------------------
def engine_prefill(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """Add the requests and step until every one has its first token: later steps are pure decode."""
    rids = [llm.add_request(p, greedy(max_tokens)) for p in prompts]
    started: set[str] = set()
    while len(started) < len(rids):
        check(llm.has_unfinished(), "engine ran out of work before prefill finished")
        started.update(o.request_id for o in llm.step() if o.token_ids)
    return rids


def engine_steps(llm: LLM, n: int, batch: int) -> float:
    """Mean ms of `n` decode steps, each advancing all `batch` requests by one token."""
    t0 = now()
    for _ in range(n):
        outs = llm.step()
        check(len(outs) == batch and not any(o.finished for o in outs), "a decode step lost a request")
    return (now() - t0) * 1e3 / n


class HFDecoder:
    """Prefill a left-padded batch once, then time single-token forwards over its DynamicCache."""

    @torch.inference_mode()
    def __init__(self, model, prompts: list[list[int]], pad_id: int):
        self.model = model
        ids, self.mask = left_pad(prompts, pad_id)
        pos = (self.mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=self.mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)  # [batch, 1]

    @torch.inference_mode()
    def steps(self, n: int) -> float:
        t0 = now()
        for _ in range(n):
            self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
            pos = self.mask.sum(-1, keepdim=True) - 1  # [batch, 1]
            out = self.model(input_ids=self.next, attention_mask=self.mask, position_ids=pos,
                             past_key_values=self.cache, use_cache=True)
            self.cache = out.past_key_values
            self.next = out.logits[:, -1].argmax(-1, keepdim=True)
        return (now() - t0) * 1e3 / n


def decode_steps(b: Bench, batch: int, ctx: int, n: int) -> tuple[list[float], list[float]]:
    """Interleaved step timings at `batch` x `ctx`; both sides keep their caches across runs, so context
    grows by the same number of tokens on each side."""
    prompts = text_prompts(b.llm, [ctx] * batch)
    # margin: requests that finish prefill early decode while the others still prefill
    rids = engine_prefill(b.llm, prompts, n * (b.repeats + 1) + 8 + ctx * batch // 256)
    dec = HFDecoder(b.hf, prompts, b.pad_id)
    e, h = interleave(lambda: engine_steps(b.llm, n, batch), lambda: dec.steps(n), b.repeats)
    for rid in rids:
        b.llm.abort(rid)
    check(not b.llm.has_unfinished() and b.llm.kv_usage()["pages_in_use"] == 0, "abort left KV pages behind")
    return e, h


def fig_step16(b: Bench) -> Figure:
    s = b.sizes
    e, h = decode_steps(b, s.step_batch, s.step_ctx, s.step_steps)
    return Figure("step16", f"decode step, batch {s.step_batch}, context ~{s.step_ctx}", "ms",
                  statistics.median(e), statistics.median(h), "transformers", False, 0.5,
                  {"engine": e, "transformers": h}, {"steps_per_run": s.step_steps})


def read_bandwidth(runs: int, gib: float = 1.0) -> float:
    """Bytes/s of one thread summing a float32 tensor that was written first (an untouched one maps
    the zero page and reads impossibly fast); best of `runs`."""
    x = torch.empty(int(gib * 2**30) // 4, dtype=torch.float32)
    x.fill_(1.0)
    best = float("inf")
    for _ in range(runs):
        t0 = now()
        x.sum()
        best = min(best, now() - t0)
    return x.numel() * x.element_size() / best


def fig_floor(b: Bench) -> Figure:
    s = b.sizes
    bw, wbytes = read_bandwidth(s.bw_runs), b.llm.model.weight_bytes()
    e, h = decode_steps(b, 1, s.floor_ctx, s.floor_steps)  # transformers' steps: context, not the ratio
    return Figure("floor", f"decode step, batch 1, context ~{s.floor_ctx}", "ms", statistics.median(e),
                  wbytes / bw * 1e3, f"floor: {wbytes / 1e6:.0f} MB / {bw / 1e9:.1f} GB/s", False, 2.5,
                  {"engine": e, "transformers": h},
                  {"weight_bytes": wbytes, "read_GBps": bw / 1e9, "transformers_ms": statistics.median(h)})


# ---- driver --------------------------------------------------------------------------------------
def load(args) -> Bench:
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    # 1024 pages = 16k tokens of KV: covers the batch figure (16 x 576) and step16 (16 x ~380)
    llm = LLM(model="smollm2-135m", dtype=args.dtype, num_pages=1024, max_num_seqs=32,
              max_num_batched_tokens=512, page_size=16)
    hf = AutoModelForCausalLM.from_pretrained(llm.model_dir, dtype=getattr(torch, args.dtype),
                                              attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(llm.model_dir)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    hf.generation_config.eos_token_id = None  # EOS ignored: always max_new_tokens (no min_new_tokens)
    hf.generation_config.pad_token_id = pad
    check(torch.get_num_threads() == 1, f"torch uses {torch.get_num_threads()} threads, wanted 1")
    return Bench(llm, hf, pad, QUICK if args.quick else Sizes(), args.repeats)


def table(figs: list[Figure]) -> str:
    rows = [("figure", "what", "engine", "reference", "ratio", "target", "result")]
    for f in figs:
        rows.append((f.name, f.what, f"{f.engine:.2f} {f.unit}", f"{f.ref:.2f} {f.unit} ({f.ref_name})",
                     f"{f.ratio:.2f}x", f"{'>=' if f.higher_is_better else '<='} {f.target}x",
                     "PASS" if f.ok else "MISS"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]  # left-aligned columns
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--repeats", type=int, default=3, help="interleaved engine/HF runs per figure (median)")
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke test (~1-2 minutes)")
    p.add_argument("--only", action="append", choices=FIGURES, help="run just this figure (repeatable)")
    p.add_argument("--out", type=Path, help="JSON of all figures (default bench/out/engine_<dtype>[_quick].json)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.out is None:
        args.out = ROOT / "bench" / "out" / f"engine_{args.dtype}{'_quick' if args.quick else ''}.json"
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    b = load(args)
    command = shlex.join([".venv/bin/python", "bench/engine/engine_bench.py", *argv])
    print(f"pdserve engine vs transformers {transformers.__version__} | torch {torch.__version__} | "
          f"{args.dtype} | 1 thread | repeats {args.repeats}{' | quick' if args.quick else ''}", flush=True)
    runners = {"single": fig_single, "step16": fig_step16, "batch": fig_batch, "floor": fig_floor}
    figs = []
    for name in FIGURES:
        if args.only and name not in args.only:
            continue
        t0, f = now(), runners[name](b)
        figs.append(f)
        runs = " | ".join(f"{k} " + " ".join(f"{x:.2f}" for x in v) for k, v in f.samples.items())
        print(f"  {name} ({f.unit}): {runs} | {f.extra} [{now() - t0:.0f} s]", flush=True)
    print("\n" + table(figs))
    print(f"reproduce: {command}")
    write_json(args, b, command, figs)
    return 0


def write_json(args, b: Bench, command: str, figs: list[Figure]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"command": command, "dtype": args.dtype, "repeats": args.repeats, "quick": args.quick,
              "sizes": asdict(b.sizes), "torch": torch.__version__, "transformers": transformers.__version__,
              "figures": [{**asdict(f), "ratio": f.ratio, "pass": f.ok} for f in figs]}
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
