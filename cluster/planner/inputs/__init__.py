"""What the planner plans for, read from deploy/ and data/ (pure Python; pydantic at the YAML edge).

    paths.py          deploy_dir() (PDSERVE_DEPLOY_DIR overrides), YAML/JSON reading, pydantic problems
    models.py         ModelSpec from deploy/models/*.yaml, an HF config.json or a Hub id (load_model)
    hardware.py       Hardware from deploy/hardware.yaml (load_hardware), with its GPU step constants
    gpu_constants.py  the `step:` block: the GPU step model's constants (StepConstants) and their schema
    workload.py       request lengths (traces, distributions), Poisson arrivals (Request)
"""
