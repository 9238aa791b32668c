"""From a `PlanRequest` to plans (pure Python).

    request.py         PlanRequest: what the search is asked (every part below imports it from here)
    configs.py         TP x PP configurations that fit memory (instance_configs, InstanceMemory)
    expert_parallel.py EP x TP decode instances of mixture-of-experts models (decode_ep_configs)
    goodput.py         one instance's goodput at the SLO by bisection over the rate (Precision levels)
    plans.py           PhaseChoice, Plan
    kv_link.py         the KV transfer's bandwidth and re-shard cost between two instances
    pool_placement.py  replica counts and placements, whole-plan simulation, bump and shrink
    plan_search.py     search(req) -> SearchResult: the order of the work
    probe.py           PlanProbe: one plan's whole-plan goodput and attainment curve
    cost.py, pareto.py cost and power of a plan, objectives, the Pareto front
    designs.py         the design search over machine types (plan_designs)
"""
