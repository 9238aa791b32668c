"""The measuring side: the only planner room that imports numpy, torch or the engine's model.

    profiler.py      `pdserve profile`: times the engine over a batch grid and fits the latency forms
    corun.py         co-run interference measured between two processes
    serving_fit.py   serving calibration from a `pdserve bench` run's timelines
    random_model.py  random weights of a deploy/models shape, made on the device
    fit.py           least-squares fits (numpy)
    vidur_tables.py  Vidur's measured operator tables
    gpu_fit.py       the GPU step model fitted to those tables (table_profile: `pdserve plan --profile`)
    gpu_fit_cmd.py   `pdserve fit-gpu`
Checks of the models against measurements (their command lines: bench/checks/):
    bench_check.py   the simulator on what a `pdserve bench` run sent, beside what it measured
    gpu_check.py     the GPU step model against Vidur's measured steps, fitted and held-out rows
    moe_check.py     the MoE step against measured fused-MoE kernel times and a served step (pure Python)
"""
