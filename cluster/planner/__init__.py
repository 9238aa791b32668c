"""The planner: `pdserve plan`, `pdserve profile`, `pdserve fit-gpu` (registered by `cli.py`).

Rooms, each below the next (a room imports only the ones above it in this list, never one below):

    errors.py    the typed errors every room raises (`PlannerError` and its kinds)
    inputs/      what is planned for: model shapes, the hardware table (with its GPU step constants),
                 workload lengths, the deploy/ folder
    latency/     seconds per step: the model's base and the roofline, the GPU step model, measured profiles,
                 co-run factors and the serving drift as the simulators apply them
    sim/         discrete-event simulators of pools (disaggregated, colocated, elastic) and what they return
                 (`SimResult`, the SLO); the autoscaler runs them too (cluster/serving/autoscale_capacity.py)
    search/      from a `PlanRequest` to plans: instance configurations, per-instance goodput, placement,
                 whole-plan checks, machine-type designs with cost and power
    emit/        the chosen plan as a cluster spec and a report
    commands/    `pdserve plan`'s argument handling (one type: `plan_cmd`; designs: `designs_cmd`)
    calibrate/   the measuring side: `pdserve profile` (engine timing, co-run, serving calibration),
                 `pdserve fit-gpu`, table readers and fits; the only room that imports numpy, torch or the
                 engine's model; of the rooms above, only `commands` imports it (tables fitted on the spot)

The core (inputs, latency, sim, search) is pure Python: no torch, numpy, ray, engine or cluster.spec.
`emit/spec_writer.py` alone reaches the engine's config modules (no torch): it checks the spec it writes
with the cluster's own schema (`cluster.spec`) and names the architectures the engine runs.
Reproduction-only code (Splitwise's mixed pools and baseline machines, its step tables and slowdown SLO, its
per-instance measurement) lives in bench/repro/splitwise/, not here.
"""
