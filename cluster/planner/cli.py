"""`pdserve plan`, `pdserve profile` and `pdserve fit-gpu` (registered by cluster/cli.py; handlers import the work lazily).

    pdserve plan --model llama-3-8b --hardware h100 --nodes 4 --gpus-per-node 8 \\
        --workload data/workloads/azure_llm_2023_conv.csv --rate 40 --ttft-ms 250 --tpot-ms 100 \\
        --out cluster.yaml --report plan-report/
    pdserve profile deploy/local.yaml --out deploy/profiles/cpu-local-smollm2.json
    pdserve profile --device cuda --model random:llama-3-8b --hardware h100 --out h100-8b.json
    pdserve fit-gpu my-a100/mlp.csv my-a100/attention.csv my-a100/all_reduce.csv --hardware a100 \\
        --out deploy/profiles/my-a100.json
"""
from __future__ import annotations

import argparse


def _plan(args: argparse.Namespace) -> int:
    from cluster.planner.commands.plan_cmd import run_plan
    return run_plan(args)


def _profile(args: argparse.Namespace) -> int:
    from cluster.planner.calibrate.profiler import run_profile
    return run_profile(args)


def _fit_gpu(args: argparse.Namespace) -> int:
    from cluster.planner.calibrate.gpu_fit_cmd import run_fit_gpu
    return run_fit_gpu(args)


def _add_fit_gpu(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fit-gpu", help="fit the planner's GPU step model to measured operator tables (Vidur layout)")
    p.add_argument("tables", nargs="+", help="CSV/JSON tables or directories of them, all measured on one GPU kind")
    p.add_argument("--hardware", required=True, help="the GPU they were measured on (deploy/hardware.yaml)")
    p.add_argument("--out", help="write a profile JSON for `pdserve plan --profile`")
    p.add_argument("--name", help="profile name (default: the --out file's stem)")
    p.set_defaults(func=_fit_gpu)


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="pick parallelism and pool sizes that meet TTFT/TPOT SLOs; write a spec")
    p.add_argument("--model", required=True,
                   help="a short name (deploy/models/*.yaml) or its Hugging Face Hub id, or an HF config.json")
    p.add_argument("--hardware", required=True,
                   help="a name from deploy/hardware.yaml (h100, a100, ...), or several joined by commas: every "
                        "prefill-type x decode-type pairing and colocated per type is planned (--nodes per type)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8, help="devices per node (cores for cpu-local)")
    w = p.add_mutually_exclusive_group(required=True)
    w.add_argument("--workload", help="a trace: Azure CSV (ContextTokens, GeneratedTokens) or Mooncake JSONL")
    w.add_argument("--input-len", help="prompt lengths: N, uniform:LO:HI or exp:MEAN (with --output-len)")
    p.add_argument("--output-len", help="output lengths: N, uniform:LO:HI or exp:MEAN")
    p.add_argument("--input-scale", type=float, default=1.0,
                   help="--workload: prompt length factor (as `pdserve bench --input-scale`; bench's default 0.25)")
    p.add_argument("--output-scale", type=float, default=1.0, help="--workload: output length factor (bench: 0.5)")
    p.add_argument("--max-input", type=int, help="--workload: prompt length cap after scaling (bench: 1024)")
    p.add_argument("--max-output", type=int, help="--workload: output length cap after scaling (bench: 256)")
    p.add_argument("--rate", type=float, help="requests per second the plan must sustain (required unless a budget "
                                               "asks for the most goodput)")
    p.add_argument("--ttft-ms", type=float, required=True)
    p.add_argument("--tpot-ms", type=float, required=True)
    p.add_argument("--attainment", type=float, default=0.9, help="fraction of requests meeting both targets")
    p.add_argument("--out", default="cluster.yaml", help="where to write the cluster spec")
    p.add_argument("--report", help="directory for report.md, attainment.png, plan.json")
    p.add_argument("--profile", help="a latency profile (deploy/profiles/NAME.json or a path), or measured GPU "
                                     "tables in Vidur's layout (a CSV, a directory, or several joined by commas: "
                                     "fitted on the spot for --hardware); default: --hardware's GPU step model "
                                     "(roofline for CPUs)")
    p.add_argument("--corun", default="cpu", choices=["cpu", "wall", "off"],
                   help="the profile's co-run slowdowns of instances sharing a node: cpu (memory bus and cache "
                        "only), wall (also time lost to other processes on oversubscribed cores), off")
    p.add_argument("--serving", default="off", choices=["on", "off"],
                   help="on: apply the profile's serving calibration (runtime overheads and the machine's drift, "
                        "measured by a bench run; trust it when taken just before what you predict: on a shared "
                        "machine its factors move with the time of day); off: the engine's fitted times")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--inter-node-gbs", type=float, help="cross-node GB/s per device (default: the table's)")
    p.add_argument("--max-len", type=int, default=0, help="max_model_len (default: the model's, <= 32768)")
    p.add_argument("--spec-model", help="what the spec's `model:` says (a Hub id org/name, a model directory, "
                                        "smollm2-135m); default: the model's Hub id (hf_id of its model file)")
    p.add_argument("--seed", type=int, default=0)
    _add_cost_flags(p)
    p.set_defaults(func=_plan)


def _add_cost_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--objective", choices=["gpus", "cost", "power", "goodput-per-dollar"],
                   help="rank designs by fewest GPUs, lowest cost/hour, lowest power, or most goodput per dollar "
                        "(default with one --hardware: today's GPU-count search)")
    b = p.add_mutually_exclusive_group()
    b.add_argument("--budget-cost", type=float, metavar="USD_PER_HOUR", help="the most goodput within this cost")
    b.add_argument("--budget-power", type=float, metavar="WATTS", help="the most goodput within this power")
    p.add_argument("--price", action="append", metavar="NAME=USD",
                   help="override a hardware entry's price per device-hour (repeatable)")
    p.add_argument("--power", action="append", metavar="NAME=W",
                   help="override a hardware entry's draw per device, both phases (repeatable)")


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="time the real engine over a batch grid and fit the planner's latency model")
    p.add_argument("spec", nargs="?", help="a cluster spec: its model and dtype are profiled (optional with --model)")
    p.add_argument("--out", required=True, help="profile JSON to write, e.g. deploy/profiles/NAME.json")
    p.add_argument("--hardware", default="cpu-local", help="the hardware name recorded in the profile")
    p.add_argument("--grid", choices=["tiny", "small", "large", "gpu", "gpu-tiny"],
                   help="tiny: seconds (tests); small (the CPU's default): ~3-5 min on one core; large: ~15 min; "
                        "gpu (the default on CUDA): prefill 512-8064 tokens, decode 1-128 rows at 512-4096; "
                        "gpu-tiny: the GPU grid's path at tiny sizes (CPU dry runs)")
    p.add_argument("--repeats", type=int, default=2, help="timings per point (the median is kept)")
    p.add_argument("--clock", choices=["cpu", "wall"],
                   help="cpu (the CPU's default): this process's CPU time (robust on a shared machine); wall: "
                        "wall-clock (the only one on CUDA, synchronised around each step)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N]: profile the engine on that GPU")
    p.add_argument("--model", help="profile this model instead of the spec's (its dtype stays): a name or directory "
                                   "`LLM` takes, or random:<deploy/models name> (that shape, random weights made "
                                   "on the device: no model files needed)")
    p.add_argument("--dtype", help="weights and KV dtype (default: the spec's, else bfloat16)")
    p.add_argument("--name", help="profile name (default: the --out file's stem)")
    p.add_argument("--corun-rounds", type=int, default=5,
                   help="rounds of the co-run interference measurement (two processes, ~15-30 s a round; 0: skip)")
    p.add_argument("--corun-only", action="store_true",
                   help="only measure co-run interference and add it to the existing profile --out")
    p.add_argument("--serving-from", nargs="+", metavar="BENCH_JSON",
                   help="only calibrate the runtime's overheads from finished `pdserve bench --spec` runs of one spec "
                        "at low load (bench.json or probe files) and add them, under the spec's mode, to the existing "
                        "profile --out")
    p.set_defaults(func=_profile)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add this subpackage's subcommands; keep it cheap (no heavy imports here)."""
    _add_plan(subparsers)
    _add_profile(subparsers)
    _add_fit_gpu(subparsers)
