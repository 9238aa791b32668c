"""`pdserve bench`: open-loop load over the OpenAI-compatible HTTP API, SLO attainment and goodput.

Map (in the order a run uses them):
    cli.py       flags -> workload, targets, BenchConfig; registered by cluster/cli.py (cheap register)
    workload.py  synthetic (seeded lengths, Poisson/gamma arrivals) and trace replay (Azure 2023 CSV,
                 Mooncake JSONL) with time and length scaling; pure
    mooncake.py  Mooncake rows with prefix-block ids; whole-conversation sampling (`mooncake:sessions=N`)
    prompts.py   prompts of exact token counts cut from the interpreter's own documentation; shared
                 prefix blocks for Mooncake; a new round of prompts per probe
    server.py    `pdserve serve SPEC` as a child process on a free port; `--set` spec variants
    runner.py    per target: warm-up, unloaded run (SLO reference), rate probes, goodput search
    loadgen.py   one probe: asyncio + httpx streaming, one RequestRecord (record.py) per request
    server_stats.py  the server's /metrics counters before and after a probe (KV bytes, prefix hits)
    metrics.py   TTFT/TPOT/e2e, attainment, summaries, goodput bisection; pure, no clock (percentiles:
                 cluster/stats.py, shared with the planner)
    qoe.py       Andes QoE per request (token arrivals against a reader's expected TTFT and pace); pure
    report.py    bench.json, summary.md, PNGs, the --compare ratio and its SLO-scale sweep
Beside `pdserve bench`, for bench/checks/external_clients.py (real clients against the same server):
    external_clients.py  GuideLLM's scenario and AIPerf's argv for one rate, their environment and venvs
    external_results.py  their output files parsed into rows, the table and verdicts against pdserve bench,
                         several runs pooled; pure apart from files
Only loadgen and server touch the network; nothing here imports ray or torch at import time.
"""
