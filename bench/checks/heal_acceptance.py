"""Issue 23's healing acceptance on the real deploy specs, unchanged but for float32, with SmolLM2: SIGKILL of
each worker role's process mid-stream, on a private local Ray started as `pdserve serve` starts it.

    python bench/checks/heal_acceptance.py                                   # every spec x role, 1 kill each
    python bench/checks/heal_acceptance.py --specs deploy/local-2d.yaml --roles decode --cycles 20

Order, per spec:
  1. `start_cluster(spec)` (its own Ray: loopback, token); a fault-free round of --streams greedy streams
     (ignore_eos, --max-tokens each) is the reference.
  2. per role in the spec's pools, --cycles times: the same streams start; once every stream has a token, the
     process of the role's last worker gets SIGKILL (`os.kill` of the actor's pid: what the OOM killer or a
     crash does, not `ray.kill`). Measured: seconds from the kill to /health "ok" with the slot replaced, each
     stream's end (finished, or a typed error before its deadline), tokens equal to the reference, the
     workers' leftovers (pages, reservations, requests, transfers), and the resident memory of the processes
     that survive (this process, which runs the router, and every worker but the victim).
  3. the ledger balances (admitted = completed + failed + cancelled), Ray holds exactly the live workers'
     actors and the pools' placement groups; the router shuts down.
Verdict per row: healed <= 30 s, no stream lost, tokens equal, nothing left; per (spec, role) with 2+
cycles: survivors' memory at the last cycle within 5% of cycle 1.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cluster.serving.ray_pools import start_cluster  # noqa: E402
from cluster.serving_api import GenerateRequest  # noqa: E402
from cluster.spec import parse_spec  # noqa: E402
from engine import SamplingParams  # noqa: E402

BOUND_S = 30.0


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % 900 + 100 for j in range(24 + 16 * i)] for i in range(n)]


def _own_rss() -> int:
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _stream(router, rid, prompt, params, first: asyncio.Event, out: dict) -> None:
    toks = []
    try:
        async for d in router.generate(GenerateRequest(rid, prompt, params, model=router.model_name)):
            toks += d.new_token_ids
            first.set()
            if d.finished:
                out[rid] = ("ok", toks)
    except Exception as e:  # a typed error is an allowed end; the row counts it
        first.set()
        out[rid] = (type(e).__name__, toks)


async def _round(router, prompts, params, tag, kill=None) -> dict:
    """Every prompt streams; `kill` (a coroutine function) runs once each has a token. Returns outputs by
    request id."""
    firsts = [asyncio.Event() for _ in prompts]
    out: dict = {}
    tasks = [asyncio.create_task(_stream(router, f"{tag}-{i}", p, params, firsts[i], out))
             for i, p in enumerate(prompts)]
    await asyncio.gather(*(f.wait() for f in firsts))
    if kill is not None:
        await kill()
    await asyncio.gather(*tasks)
    return out


def _ray_leftovers(router) -> str:
    """'' when Ray's live actors are exactly the router's live workers, else what differs."""
    from ray._private import state

    alive = sum(a.get("State") == "ALIVE" for a in state.actors().values())
    workers = sum(len(ws) for ws in router.workers.values())
    return "" if alive == workers else f"{alive} live actors in Ray for {workers} workers"


async def _kill_cycles(router, role, prompts, params, reference, cycles, rows) -> None:
    first_rss = None
    for c in range(cycles):
        victim = router.workers[role][-1]
        pid = await victim.handle.actor.__ray_call__.remote(lambda self: os.getpid())
        replaced, lost = router.ledger.workers_replaced, router.ledger.workers_lost
        marks: dict[str, float] = {}

        async def watch(t_kill):  # from the kill on: when the loss is seen, when the slot is healthy again
            while time.monotonic() - t_kill < 120:
                if "seen" not in marks and router.ledger.workers_lost > lost:
                    marks["seen"] = time.monotonic() - t_kill
                if router.health()["status"] == "ok" and router.ledger.workers_replaced > replaced:
                    marks["healed"] = time.monotonic() - t_kill
                    return
                await asyncio.sleep(0.05)
        watcher: list[asyncio.Task] = []

        async def kill():
            os.kill(pid, signal.SIGKILL)
            watcher.append(asyncio.create_task(watch(time.monotonic())))
        out = await _round(router, prompts, params, f"{role}{c}", kill)
        await watcher[0]
        healed, seen = marks.get("healed", float("inf")), marks.get("seen", float("inf"))
        left = await router.leftovers(30.0)
        ok = [rid for rid, (end, _) in out.items() if end == "ok"]
        equal = sum(out[f"{role}{c}-{i}"][1] == ref for i, ref in enumerate(reference)
                    if out[f"{role}{c}-{i}"][0] == "ok")
        errors = sorted({end for end, _ in out.values() if end != "ok"})
        survivors = [w for ws in router.workers.values() for w in ws if w is not router.workers[role][-1]]
        rss = _own_rss() + sum([await w.handle.actor.rss_bytes.remote() for w in survivors])
        first_rss = first_rss or rss
        row = {"role": role, "cycle": c + 1, "healed_s": healed, "seen_s": seen, "ok": len(ok),
               "n": len(prompts), "equal": equal, "errors": errors, "left": left, "ray": _ray_leftovers(router),
               "rss_mb": rss / 2**20, "rss_vs_1": rss / first_rss - 1}
        rows.append(row)
        print(f"  {role} kill {c + 1}: healthy {healed:.1f} s after (loss seen at {seen:.1f} s), "
              f"{len(ok)}/{len(prompts)} done "
              f"({', '.join(errors) or 'no errors'}), {equal}/{len(ok)} equal to the fault-free run, "
              f"leftovers {left or 'none'}{'; ' + row['ray'] if row['ray'] else ''}, survivors' RSS "
              f"{rss / 2**20:.0f} MiB ({100 * row['rss_vs_1']:+.1f}% vs cycle 1)", flush=True)


async def run_spec(path: str, roles: list[str] | None, cycles: int, streams: int, max_tokens: int) -> dict:
    data = yaml.safe_load(Path(path).read_text())
    spec = parse_spec({**data, "dtype": "float32"}, source=path)
    router = start_cluster(spec)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = _prompts(streams)
    rows: list[dict] = []
    try:
        ref_out = await _round(router, prompts, params, "ref")
        reference = [ref_out[f"ref-{i}"][1] for i in range(streams)]
        for role in [r for r in router.workers if roles is None or r in roles]:
            await _kill_cycles(router, role, prompts, params, reference, cycles, rows)
        led = router.ledger
        ledger = {"balanced": led.balanced(len(router.flights)), "admitted": led.admitted,
                  "completed": led.completed, "failed": led.failed, "lost": led.workers_lost,
                  "replaced": led.workers_replaced}
    finally:
        await router.shutdown()
    return {"spec": path, "rows": rows, "ledger": ledger}


def verdict(result: dict) -> list[str]:
    misses = []
    for r in result["rows"]:
        where = f"{result['spec']} {r['role']} kill {r['cycle']}"
        if r["healed_s"] > BOUND_S:
            misses.append(f"{where}: healthy {r['healed_s']:.1f} s after the kill (bound {BOUND_S:g} s)")
        if r["ok"] + len(r["errors"]) < r["n"] or r["equal"] < r["ok"]:
            misses.append(f"{where}: {r['ok']}/{r['n']} done, {r['equal']} equal")
        if r["left"] or r["ray"]:
            misses.append(f"{where}: left over {r['left']} {r['ray']}")
    by_role: dict[str, list[dict]] = {}
    for r in result["rows"]:
        by_role.setdefault(r["role"], []).append(r)
    for role, rs in by_role.items():
        if len(rs) > 1 and rs[-1]["rss_vs_1"] > 0.05:
            misses.append(f"{result['spec']} {role}: survivors' RSS {100 * rs[-1]['rss_vs_1']:+.1f}% after "
                          f"{len(rs)} kills (bound +5%)")
    if not result["ledger"]["balanced"]:
        misses.append(f"{result['spec']}: ledger not balanced {result['ledger']}")
    return misses


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--specs", default="deploy/local.yaml,deploy/local-2d.yaml,deploy/colocated.yaml")
    p.add_argument("--roles", default="", help="comma-separated pools to kill (default: every pool)")
    p.add_argument("--cycles", type=int, default=1, help="kills per spec and role (default %(default)s)")
    p.add_argument("--streams", type=int, default=6, help="concurrent greedy streams (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per stream (default %(default)s)")
    args = p.parse_args(argv)
    roles = [r for r in args.roles.split(",") if r] or None
    misses = []
    for path in [s for s in args.specs.split(",") if s]:
        print(f"[heal] {path} (float32)", flush=True)
        result = asyncio.run(run_spec(path, roles, args.cycles, args.streams, args.max_tokens))
        print(f"  ledger {result['ledger']}", flush=True)
        misses += verdict(result)
    print("[heal] " + ("every check met" if not misses else "missed:\n  " + "\n  ".join(misses)))
    return 0 if not misses else 1


if __name__ == "__main__":
    sys.exit(main())
