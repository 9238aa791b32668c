"""SLO placement planner: profiles, latency models, simulator, search, `pdserve plan` (pure Python core)."""
