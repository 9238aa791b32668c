"""Splitwise's design comparison (ISCA'24, arXiv 2311.18677) in pdserve's planner simulator.

    python bench/repro/splitwise/repro.py                       # both models, both traces (a few minutes)
    python bench/repro/splitwise/repro.py --models llama-2-70b --traces conv --scale 20
    python bench/repro/splitwise/repro.py --perf artifact --pools 1,4,16,64   # the paper's own inputs, JSQ pools

The paper's inputs, as its artifact (github.com/Mutinifni/splitwise-sim) states them:
  machines   DGX-A100, DGX-H100 and DGX-H100 power-capped to 70% (H100cap, token machines only): price and
             provisioned GPU power per machine from deploy/hardware.yaml's `splitwise-*` entries ($17.6/h and
             8 x 400 W, $38/h and 8 x 700 W, $38/h and 0.7 x that: the paper's Table I, so that 40 DGX-H100 =
             70 DGX-A100 in power as its §VI-B states); one model instance per machine, TP 8
  models     Llama-2-70B and BLOOM-176B (deploy/models/)
  traces     the Azure LLM inference traces 2023, code and conversation (data/workloads/), lengths as
             recorded, Poisson arrivals (--perf planner: 2000 of them sampled and clamped to 8k tokens;
             --perf artifact: every one, unclipped, as the artifact's generate_trace.py draws them)
  SLO        slowdowns of each request against itself alone on a DGX-A100 (splitwise-sim notebooks,
             get_slo; perf_model.add_baseline_perf): TTFT P50/P90/P99 <= 2x/3x/6x, TBT 1.25x/1.5x/5x,
             end-to-end 1.25x/1.5x/5x; "alone" = the A100's prompt time for the request's prompt and its
             batch-1 token step at that context; TBT = a request's mean time between tokens, as the
             artifact computes it (`slo.SlowdownSLO`). A prompt machine is measured on the TTFT bounds,
             a token machine on the TBT bounds, a baseline machine on all nine; --verify checks all nine
             on each whole plan. --slo absolute: the earlier reading (one absolute TTFT/TPOT target at the
             trace's P90 lengths, 90% of requests), kept to compare
  designs    Baseline-A100/-H100 (colocated, mixed batching: the planner's colocated instance),
             Splitwise-AA, -HH, -HA (prompt H100, token A100), -HHcap (prompt H100, token H100cap)
  objectives (the artifact's sweeps, scaled by --scale): iso-power and iso-cost: the power / cost of
             `scale` DGX-H100s, each design's throughput at the SLO with the best prompt/token split
             within it (--splits paper: the paper's own machine counts); iso-throughput: the cost and
             power each design needs for the throughput Baseline-H100 reaches at that power (--perf
             artifact: for 70 req/s, as the artifact provisions; cost-optimized and power-optimized)

  step times --perf planner (default): the planner's GPU step model of each hardware entry; --perf artifact:
             the artifact's measured iteration times (deploy/profiles/splitwise-perf-model.yaml,
             `step_table.TableLatency`, a mixed iteration 1.1x), its memory (`TableMemory`), its
             batching (whole prompts in batches of 2048 tokens, decodes riding along), its schedulers
             (baselines: token_jsq, `baseline.ArtifactSetup.route="prompts"`; Splitwise: prompt, token and mixed
             pools, `mixed_pool`, with --verify) and its reading of "alone" and TBT (`slo_for`)
  pools      --pools K1,K2,..: each kind's per-machine goodput measured with K machines behind the router
             (least queued work: the artifact's JSQ schedulers) and interpolated in log2(n) for a pool of
             n; the default 1 is one machine's goodput times n, which under P99 bounds understates pools

Order: (1) per model and trace, each machine type's per-instance goodputs at the SLO (prompt machine: TTFT;
token machine: TPOT; baseline machine: both) from the planner's simulator (`phase.measure_phase`: the
planner's fine pass under the paper's setup), at each pool size; (2) per design and objective, integer machine counts (prompt,
token) within the budget that maximise min(n_p x g_p(n_p), n_t x g_t(n_t)) (colocated: n x g(n))
(bench/repro/splitwise/designs.py); (3) with --verify, each iso-power and iso-cost design runs as one cluster,
every request held to all nine bounds (the sizing holds a prompt pool to the TTFT ones and a token pool to
the TBT ones only), and its throughput is searched to the highest rate that meets them
(bench/repro/splitwise/verify.py; the iso-throughput objectives stay sized); (4) tables: throughput, cost and
power per design, ratios, ranking, beside the paper's two headline ratios.
Paper side (bench/repro/splitwise/paper.py): every per-design figure the paper's text states (Figs 18-19, BLOOM-176B,
as it sizes its clusters), its stated ranking (iso-cost: AA first), and the abstract's two headlines under our
reading of which designs they compare; the bars of its figures are images, not compared.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from bench.repro.splitwise.designs import (DESIGNS, GPUS, MACHINES, MAX_LEN, WORKLOADS, PoolGoodput,  # noqa: E402
                                     best_within, least_for, machine_latency, machine_numbers, spend)
from bench.repro.splitwise.paper import ISO_THROUGHPUT_RATE, PAPER_SPLITS, compare  # noqa: E402
from bench.repro.splitwise.phase import PhaseSetup, measure_phase  # noqa: E402
from bench.repro.splitwise.slo import SlowdownSLO  # noqa: E402
from bench.repro.splitwise.step_table import TableMemory  # noqa: E402
from bench.repro.splitwise.verify import better_split, verify_artifact, verify_planner  # noqa: E402
from cluster.planner.inputs.hardware import load_hardware  # noqa: E402
from cluster.planner.inputs.models import load_model  # noqa: E402
from cluster.planner.inputs.workload import clamp, subsample, trace_lengths  # noqa: E402
from cluster.planner.latency.base import Parallel  # noqa: E402
from cluster.planner.search.configs import instance_memory  # noqa: E402
from cluster.planner.search.goodput import FINE  # noqa: E402
from cluster.planner.search.request import PlanRequest  # noqa: E402
from cluster.planner.sim.metrics import SLO  # noqa: E402
from cluster.stats import percentile  # noqa: E402

def slo_for(model, pairs, ttft_x: float = 3.0, tbt_x: float = 1.5, kind: str = "slowdown", perf: str = "planner") -> SLO:
    """The paper's targets against one DGX-A100 running one request alone: per-request slowdowns
    (kind "slowdown"), or their P90 bounds made absolute at the trace's P90 lengths ("absolute"). With the
    artifact's tables, "alone" is as the artifact's notebooks compute it (perf_model.add_baseline_perf): the
    A100's prompt time at the prompt's tokens and its token time at as many batch tokens as the prompt
    has, and a request's TBT is over all its output tokens."""
    lm = machine_latency(model, "A100", perf)
    if perf == "artifact" and kind == "slowdown":
        t = lm.table
        p90_in = percentile([i for i, _ in pairs], 90)
        return SlowdownSLO(ttft_x * t.prompt(p90_in), tbt_x * t.token(1), alone_ttft=t.prompt, alone_tbt=t.token,
                           tbt_over_all_tokens=True)
    p90_in = percentile([i for i, _ in pairs], 90)
    p90_ctx = percentile([i + o for i, o in pairs], 90)
    absolute = SLO(ttft_x * lm.prefill(p90_in, p90_in ** 2), tbt_x * lm.decode(1, p90_ctx), 0.9)
    if kind == "absolute":
        return absolute
    ttft_alone = {i: lm.prefill(i, i * i) for i, _ in pairs}
    tbt_alone = {i: lm.decode(1, i) for i, _ in pairs}
    return SlowdownSLO(absolute.ttft_s, absolute.tpot_s, alone_ttft=ttft_alone.__getitem__,
                       alone_tbt=tbt_alone.__getitem__)


def phase_slo(slo: SLO, kind: str) -> SLO:
    """What one machine kind is measured on alone: a prompt machine the TTFT bounds, a token machine the
    TBT bounds (its requests' TTFT and end-to-end include no prompt here), a baseline machine all."""
    if not isinstance(slo, SlowdownSLO) or kind == "colocated":
        return slo
    return slo.only("ttft") if kind == "prefill" else slo.only("tbt")


def per_instance(model, pairs, slo: SLO, baseline_budget: int | None = None, copies: int = 1,
                 perf: str = "planner") -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], int]]:
    """{(machine, kind): goodput of one TP-8 instance at the SLO} (kind: prefill, decode, colocated), and the
    token budget that gave it; with `copies`, per instance of that many behind the router. With the
    artifact's tables: its batching (start_state configs: 2048 batch tokens), prompt batches of 2048
    tokens (a longer prompt alone) and the baselines' whole prompts in mixed batches of 2048 tokens."""
    out, budget_of = {}, {}
    for machine, name in MACHINES.items():
        hw = load_hardware(name)
        req = PlanRequest(model, hw, 1, GPUS, tuple(pairs), 1.0, slo, max_len=MAX_LEN)
        mem = instance_memory(model, hw, Parallel(GPUS, 1))
        if perf == "artifact":  # (its own accounting: 80 GiB per GPU less the weights, every KV head cached)
            mem = replace(mem, kv_tokens=TableMemory.load(model.name).kv_tokens)
        artifact = perf == "artifact"  # its tables, its baselines' batching and router
        setup = PhaseSetup(copies, machine_latency(model, machine, perf) if artifact else None, artifact,
                           "prompts" if artifact else "outstanding")
        pre_b, col_b, _, _ = req.budgets()
        if perf == "artifact":
            pre_b, col_b = (2048,), (2048,)
        col_b = (baseline_budget,) if baseline_budget else col_b
        kinds = {"prefill": pre_b, "decode": (0,)} | ({} if machine == "H100cap" else {"colocated": col_b})
        for kind, budgets in kinds.items():
            if kind == "prefill" and machine == "H100cap":
                continue  # H100cap serves token machines only (the paper's HHcap)
            kreq = replace(req, slo=phase_slo(slo, kind))
            out[(machine, kind)], budget_of[(machine, kind)] = max(
                (measure_phase(kreq, kind, mem, b, FINE, setup).goodput, b) for b in budgets)
    return out, budget_of


def run_case(model_name: str, trace: str, scale: int, do_verify: bool, tbt_x: float = 1.5,
             slo_kind: str = "slowdown", baseline_budget: int | None = None, pools: tuple[int, ...] = (1,),
             perf: str = "planner", paper_splits: bool = False) -> dict:
    start = time.perf_counter()
    model = load_model(model_name)
    lengths = trace_lengths(WORKLOADS / f"azure_llm_2023_{trace}.csv")
    # the artifact draws from the whole trace, unclipped (generate_trace.py); the planner's reading samples
    pairs = lengths if perf == "artifact" else clamp(subsample(lengths, n=2000, seed=0), MAX_LEN)
    slo = slo_for(model, pairs, tbt_x=tbt_x, kind=slo_kind, perf=perf)
    measured = {k: per_instance(model, pairs, slo, baseline_budget, copies=k, perf=perf) for k in pools}
    g = PoolGoodput({k: m[0] for k, m in measured.items()})
    budget_of = measured[max(pools)][1]
    h_cost, h_power = machine_numbers("H100")
    rows = {}
    for design in DESIGNS:
        iso_power = best_within(design, g, scale * h_power, 1)
        iso_cost = best_within(design, g, scale * h_cost, 0)
        rows[design] = {"iso_power": iso_power, "iso_cost": iso_cost}
        if paper_splits:  # the paper's machine counts; the sized rate only starts the verification's search
            for key in ("iso_power", "iso_cost"):
                rows[design][key] = at_split(design, g, *PAPER_SPLITS[(trace, key)][design])
    if do_verify:  # whole designs, all nine bounds: the sized figures become the verified ones
        for design in DESIGNS:
            for key, limit, by in (("iso_power", scale * h_power, 1), ("iso_cost", scale * h_cost, 0)):
                thr, a, b = rows[design][key]
                rows[design][key + "_sized"] = thr
                if perf == "artifact":  # (and the neighbouring splits, as the artifact sweeps them)
                    ok = verify_artifact(model, pairs, slo, design, a, b, thr)
                    if not paper_splits:
                        ok, a, b = better_split(model, pairs, slo, design, a, b, ok, limit, by)
                else:
                    ok = verify_planner(model, pairs, slo, design, a, b, thr, budget_of)
                rows[design][key] = (ok, a, b)
    # iso-throughput: the artifact's provisioning rate; the planner's reading: Baseline-H100's iso-power rate
    target = ISO_THROUGHPUT_RATE if perf == "artifact" else rows["Baseline-H100"]["iso_power"][0]
    for design in DESIGNS:
        rows[design]["cost_opt"] = least_for(design, g, target, 0)
        rows[design]["power_opt"] = least_for(design, g, target, 1)
    return {"model": model_name, "trace": trace, "slo": slo, "g": g.by_pool, "rows": rows, "target": target,
            "seconds": time.perf_counter() - start}


def at_split(design: str, g: PoolGoodput, a: int, b: int) -> tuple[float, int, int]:
    """(sized throughput, a, b) of a given split: colocated n x g(n), else the slower pool's."""
    prompt, token = DESIGNS[design]
    if prompt is None:
        return g.total((token, "colocated"), a), a, 0
    return min(g.total((prompt, "prefill"), a), g.total((token, "decode"), b)), a, b


def _split(a: int, b: int) -> str:
    return f"{a}" if b == 0 else f"{a}P+{b}T"


def report(case: dict, scale: int) -> list[str]:
    rows, slo = case["rows"], case["slo"]
    verified = "iso_power_sized" in rows["Splitwise-AA"]
    target = ("per-request slowdowns vs the A100 alone, " + ", ".join(f"{m} P{q} <= {x:g}x" for m, q, x in slo.bounds)
              if isinstance(slo, SlowdownSLO) else
              f"TTFT <= {slo.ttft_s * 1000:.0f} ms, TPOT <= {slo.tpot_s * 1000:.1f} ms, {slo.attainment:.0%}")
    out = [f"\n## {case['model']} / {case['trace']} ({target}; {case['seconds']:.0f} s)",
           *(f"per-instance goodput (req/s, one TP-8 machine of {n} behind the router): " + ", ".join(
               f"{m} {k} {v:.2f}" for (m, k), v in g.items()) for n, g in case["g"].items()), "",
           f"| design | iso-power ({scale} DGX-H100 power): req/s (machines) | x Baseline-H100 | cost x | "
           f"iso-cost: req/s (machines) | x Baseline-H100 | cost-opt for {case['target']:.1f} req/s: $/h | "
           f"x Baseline-H100 | power-opt: kW | x Baseline-H100 |" + (" sized iso-power / iso-cost req/s |"
                                                                      if verified else ""),
           "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if verified else "")]
    base = rows["Baseline-H100"]
    for d, r in rows.items():
        ip, ic, co, po = r["iso_power"], r["iso_cost"], r["cost_opt"], r["power_opt"]
        line = (f"| {d} | {ip[0]:.1f} ({_split(ip[1], ip[2])}) | {ip[0] / base['iso_power'][0]:.2f} | "
                f"{spend(d, ip) / spend('Baseline-H100', base['iso_power']):.2f} | {ic[0]:.1f} ({_split(ic[1], ic[2])}) | "
                f"{ic[0] / base['iso_cost'][0]:.2f} | {co[0]:.0f} ({_split(co[1], co[2])}) | "
                f"{co[0] / base['cost_opt'][0]:.2f} | {po[0] / 1000:.0f} ({_split(po[1], po[2])}) | "
                f"{po[0] / base['power_opt'][0]:.2f} |")
        if verified:
            line += f" {r['iso_power_sized']:.1f} / {r['iso_cost_sized']:.1f} |"
        out.append(line)
    for key, label in (("iso_power", "iso-power throughput"), ("iso_cost", "iso-cost throughput")):
        out.append(f"ranking, {label}: " + " > ".join(sorted(rows, key=lambda d: -rows[d][key][0])))
    for key, label in (("cost_opt", "iso-throughput cost"), ("power_opt", "iso-throughput power")):
        out.append(f"ranking, {label} (least first): " + " < ".join(sorted(rows, key=lambda d: rows[d][key][0])))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama-2-70b,bloom-176b")
    ap.add_argument("--traces", default="code,conv")
    ap.add_argument("--scale", type=int, default=40, help="budget = this many DGX-H100s' power or cost (artifact: 40)")
    ap.add_argument("--verify", action="store_true", help="run each iso-power and iso-cost design as one cluster on all nine bounds (slow)")
    ap.add_argument("--slo", choices=("slowdown", "absolute"), default="slowdown",
                    help="slowdown: the paper's per-request bounds at P50/P90/P99; absolute: one TTFT/TPOT "
                         "target at the trace's P90 lengths for 90%% of requests (the earlier reading)")
    ap.add_argument("--baseline-budget", type=int, default=None,
                    help="the baselines' token budget per step (default: the best of the planner's); 8192 takes "
                         "whole prompts into a mixed batch, as the paper's mixed continuous batching does")
    ap.add_argument("--pools", default="1",
                    help="pool sizes (machines behind the router) at which each kind's per-machine goodput is "
                         "measured, interpolated in between: '1' is one machine times n; '1,4,16,64' "
                         "measures the pooling effect of JSQ routing (the artifact's schedulers)")
    ap.add_argument("--perf", choices=("planner", "artifact"), default="planner",
                    help="planner: the planner's step model per hardware entry; artifact: the paper's own "
                         "measured iteration times and batching (deploy/profiles/splitwise-perf-model.yaml)")
    ap.add_argument("--splits", choices=("planner", "paper"), default="planner",
                    help="iso-power and iso-cost machine counts: the planner's search (with --perf artifact and "
                         "--verify: and its neighbours), or the paper's own (BLOOM-176B; its artifact's notebook)")
    ap.add_argument("--tbt-slowdown", type=float, default=1.5,
                    help="with --slo absolute: the TPOT target as a multiple of the A100's batch-1 step")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    pools = tuple(sorted({int(k) for k in args.pools.split(",")}))
    if not pools or pools[0] < 1:
        ap.error("--pools: positive machine counts, e.g. 1,4,16,64")
    if args.splits == "paper" and (args.models != "bloom-176b" or args.scale != 40 or not args.verify):
        ap.error("--splits paper: the paper's BLOOM-176B clusters (--models bloom-176b, --scale 40) with --verify")
    cases = [run_case(m, t, args.scale, args.verify, args.tbt_slowdown, args.slo, args.baseline_budget, pools,
                      args.perf, args.splits == "paper") for m in args.models.split(",") for t in args.traces.split(",")]
    slo_text = "the paper's slowdown SLO" if args.slo == "slowdown" else f"TTFT 3x, TPOT {args.tbt_slowdown:g}x"
    perf_text = "the artifact's measured tables" if args.perf == "artifact" else "the planner's model"
    lines = [f"# Splitwise design comparison in pdserve's planner simulator ({slo_text} "
             f"against the A100 alone; budgets: {args.scale} DGX-H100s; step times: {perf_text}; "
             f"per-machine goodput in pools of {args.pools})"]
    for c in cases:
        lines += report(c, args.scale)
    lines += compare(cases, spend)
    lines.append(f"\ntotal {time.perf_counter() - start:.0f} s")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
