"""pdserve cluster layer: CLI today; spec, Ray actors, router, HTTP frontend, planner and bench to come."""
