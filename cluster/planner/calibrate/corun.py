"""Co-run interference: how much slower one replica's step runs while a neighbour process on another core
of the same node runs steps (they share DRAM bandwidth and the last-level cache: each decode step
streams every weight once, so two replicas on one memory bus slow each other).

Called by `profiler.run_profile` (`pdserve profile`, or `--corun-only` to add it to an existing profile).
Order: spawn two worker processes (each one `engine.LLM` with one torch thread; niceness is inherited),
warm both; then `rounds` rounds, each visiting every (target kind, neighbour kind) pair in a shuffled
order: the neighbour starts looping its kind of step (none: it idles), reports once it is in steady
state, the target times a window of its own steps, the neighbour stops and reports its CPU share over
the window. Kinds: `decode` (a batch of DECODE_BATCH sequences of DECODE_PROMPT tokens, one token each
step) and `prefill` (one PREFILL_TOKENS prompt per step). Each window's median step time is compared with
the same round's `alone` window, so slow drift of a shared machine cancels; the factor is the median of
those per-round ratios, the spread their min and max. The CPU clock is primary (this process's CPU time:
the cost of stalls on the shared bus, not of being descheduled); wall-clock ratios are recorded beside it.
Output: the profile's `corun` entry (see `profiles.CorunEntry`).
"""
from __future__ import annotations

import multiprocessing as mp
import random
import statistics
import time

KINDS = ("decode", "prefill")
NEIGHBOURS = ("none", "decode", "prefill")
DECODE_BATCH, DECODE_PROMPT, DECODE_STEPS = 4, 128, 16
PREFILL_TOKENS, PREFILL_STEPS = 512, 2


def _llm(model: str, dtype: str):
    from engine import LLM

    return LLM(model=model, dtype=dtype, num_pages=256, max_num_seqs=DECODE_BATCH,
               max_num_batched_tokens=PREFILL_TOKENS, num_threads=1)


def _add(llm, kind: str, rng: random.Random, max_tokens: int) -> list[str]:
    from engine import SamplingParams

    n, count = (DECODE_PROMPT, DECODE_BATCH) if kind == "decode" else (PREFILL_TOKENS, 1)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    vocab = llm.config.vocab_size
    return [llm.add_request([rng.randrange(vocab) for _ in range(n)], params) for _ in range(count)]


def _clear(llm, ids: list[str]) -> None:
    for rid in ids:
        llm.abort(rid)


def _window(llm, kind: str, rng: random.Random) -> list[tuple[float, float]]:
    """(cpu s, wall s) of each timed step: decode steps after an untimed prefill, or whole prefills."""
    out = []
    if kind == "decode":
        ids = _add(llm, kind, rng, DECODE_STEPS + 2)
        llm.step()  # the prompts' prefill: not timed
        for _ in range(DECODE_STEPS):
            c0, w0 = time.process_time(), time.perf_counter()
            llm.step()
            out.append((time.process_time() - c0, time.perf_counter() - w0))
        _clear(llm, ids)
        return out
    for _ in range(PREFILL_STEPS):
        ids = _add(llm, kind, rng, 1)
        c0, w0 = time.process_time(), time.perf_counter()
        llm.step()
        out.append((time.process_time() - c0, time.perf_counter() - w0))
        _clear(llm, ids)
    return out


def _loop(llm, kind: str, rng: random.Random, stop, conn) -> tuple[float, float]:
    """Run `kind` steps until `stop` is set; tell `conn` once steady. Returns (cpu s, wall s) used."""
    ids: list[str] = []
    c0, w0, steps = time.process_time(), time.perf_counter(), 0
    steady = 2 if kind == "decode" else 1  # decode: past its prompts' prefill step
    while not stop.is_set():
        if not llm.has_unfinished():
            ids = _add(llm, kind, rng, 400 if kind == "decode" else 1)  # decode: one prefill per 400 steps
        llm.step()
        steps += 1
        if steps == steady:
            conn.send("steady")
    _clear(llm, ids)
    return time.process_time() - c0, time.perf_counter() - w0


def _worker(model: str, dtype: str, seed: int, conn, stop) -> None:
    llm, rng = _llm(model, dtype), random.Random(seed)
    _window(llm, "decode", rng)  # warm-up: first-call allocations and kernels
    _window(llm, "prefill", rng)
    conn.send("ready")
    while True:
        cmd, kind = conn.recv()
        if cmd == "quit":
            return
        if cmd == "window":
            conn.send(_window(llm, kind, rng))
        else:  # "loop"
            conn.send(("used", *_loop(llm, kind, rng, stop, conn)))


def _busy_cores() -> tuple[float, float] | None:
    """(busy CPU seconds of the whole machine, wall s) from /proc/stat; None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields) - idle) / 100.0, time.perf_counter()  # USER_HZ is 100 on Linux


def _foreign(before, after, ours_cpu: float) -> float | None:
    """Cores' worth of CPU that other processes used during a window (the machine is shared)."""
    if before is None or after is None:
        return None
    return max(0.0, (after[0] - before[0] - ours_cpu) / (after[1] - before[1]))


def _median_step(steps: list[tuple[float, float]], clock: int) -> float:
    return statistics.median(s[clock] for s in steps)


def measure_corun(model: str, dtype: str, rounds: int = 5, seed: int = 0, log=print) -> dict:
    """The profile's `corun` entry: slowdown factors (CPU clock), their spread, wall-clock factors,
    per-window medians and the neighbours' CPU share (did the neighbour really run beside the target)."""
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs, conns = [], []
    for k in range(2):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(model, dtype, seed + k, theirs, stop), daemon=True)
        p.start()
        procs.append(p)
        conns.append(mine)
    try:
        for c in conns:
            assert c.recv() == "ready"
        target, neighbour = conns
        pairs = [(t, n) for t in KINDS for n in NEIGHBOURS]
        rng = random.Random(seed)
        windows: dict[tuple[str, str], list[tuple[float, float]]] = {p: [] for p in pairs}  # per round medians
        share: dict[tuple[str, str], list[float]] = {p: [] for p in pairs if p[1] != "none"}
        foreign: dict[tuple[str, str], list[float | None]] = {p: [] for p in pairs}
        for r in range(rounds):
            rng.shuffle(pairs)
            for t, n in pairs:
                if n != "none":
                    neighbour.send(("loop", n))
                    assert neighbour.recv() == "steady"
                before = _busy_cores()
                target.send(("window", t))
                steps = target.recv()
                after = _busy_cores()
                ours = sum(c for c, _ in steps)  # untimed prefill of a decode window: a small undercount
                if n != "none":
                    stop.set()
                    _, cpu, wall = neighbour.recv()
                    stop.clear()
                    share[(t, n)].append(cpu / wall)
                    ours += cpu / wall * sum(w for _, w in steps)
                foreign[(t, n)].append(_foreign(before, after, ours))
                windows[(t, n)].append((_median_step(steps, 0), _median_step(steps, 1)))
            log(f"  corun round {r + 1}/{rounds}: " + ", ".join(
                f"{t}|{n} {windows[(t, n)][-1][0] * 1000:.0f} ms" for t, n in sorted(pairs)))
        for c in conns:
            c.send(("quit", ""))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return summarize(windows, share, rounds, foreign)


def summarize(windows: dict, share: dict, rounds: int, foreign: dict | None = None) -> dict:
    """Per-round ratios against the same round's `alone` window; median and [min, max] per pair."""
    slowdown, spread, wall, ms, neighbour_cpu = {}, {}, {}, {}, {}
    for (t, n), meds in sorted(windows.items()):
        ms[f"{t}_beside_{n}"] = [round(statistics.median(m[c] for m in meds) * 1000, 2) for c in (0, 1)]
        if n == "none":
            continue
        key = f"{t}_beside_{n}"
        alone = windows[(t, "none")]
        ratios = [m[0] / a[0] for m, a in zip(meds, alone)]
        wall_ratios = [m[1] / a[1] for m, a in zip(meds, alone)]
        slowdown[key] = round(statistics.median(ratios), 4)
        spread[key] = [round(min(ratios), 4), round(max(ratios), 4)]
        wall[key] = round(statistics.median(wall_ratios), 4)
        neighbour_cpu[key] = round(statistics.median(share[(t, n)]), 3)
    busy = {f"{t}_beside_{n}": round(statistics.median(v), 2) for (t, n), v in sorted((foreign or {}).items())
            if v and None not in v}
    return {"slowdown": slowdown, "spread": spread, "wall_slowdown": wall,
            "step_ms": ms, "neighbour_cpu_share": neighbour_cpu, "machine_busy": busy,
            "method": (f"{rounds} rounds, pairs shuffled per round; decode: batch {DECODE_BATCH} x "
                       f"{DECODE_PROMPT}-token prompts, median of {DECODE_STEPS} steps; prefill: one "
                       f"{PREFILL_TOKENS}-token prompt, median of {PREFILL_STEPS}; factor = median over rounds "
                       f"of (window median / same round's alone window median), CPU clock; step_ms = "
                       f"[cpu, wall] medians; machine_busy = other processes' cores in use (median)")}
