"""`pdserve bench`: open-loop load over the OpenAI-compatible HTTP API, SLO attainment and goodput."""
