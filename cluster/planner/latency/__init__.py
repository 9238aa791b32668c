"""Seconds per step of one engine instance: what the simulators ask (pure Python).

    base.py          LatencyModel (prefill, decode, mixed steps; pipeline stages), Parallel, Coeffs,
                     FittedLatency (a profile's fitted coefficients), ZeroLatency
    roofline.py      the roofline of a hardware entry (CPUs; old profiles)
    gpu_latency.py   the GPU step model, kernel by kernel (OperatorLatency)
    moe.py           mixture-of-experts steps: experts touched per step, expert parallelism's groups and
                     all-to-all (MoEOperatorLatency, MoERooflineLatency)
    profiles.py      latency profiles (deploy/profiles/*.json) and `latency_model(...)`, which picks one
    interference.py  Corun: co-run slowdown factors of instances sharing a node
    drift.py         the serving calibration as the simulators apply it (factors, a seeded Drift)
    stepping.py      closed-form runs of decode steps (StepRun), so a long generation is not one event a token
"""
