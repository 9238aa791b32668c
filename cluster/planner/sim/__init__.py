"""Discrete-event simulators of instance pools over a latency model (pure Python).

    events.py    the event queue
    metrics.py   SLO, RequestResult, SimResult (attainment, percentiles), percentile
    bus.py       a node's shared memory bus: co-run slowdowns while neighbours are mid-step
    disagg.py    prefill and decode pools with the KV link between them (simulate_disaggregated,
                 simulate_decode_only)
    coloc.py     colocated replicas (simulate_colocated)
    elastic.py   colocated replicas joining and leaving under an autoscaler (simulate_elastic)

Who runs them: the search (`search/`), the report, the autoscaler's capacity model
(cluster/serving/autoscale_capacity.py), bench/checks/planner_check.py and bench/serving/autoscale_sim.py.
"""
