"""`pdserve plan`'s command modules (the parser is `cluster/planner/cli.py`).

    plan_inputs.py  arguments -> PlanRequest (build_request), shared by both commands
    plan_cmd.py     one hardware type: search, spec, report, terminal summary
    designs_cmd.py  several types, an objective or a budget: the design search
"""
