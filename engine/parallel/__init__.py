"""Tensor-parallel execution of one engine replica (issue 9).

Module map, in the order a step meets them:
- `shard.py`: pure functions: validate a degree against the heads, which heads a rank holds (with KV-head
  replication), the slice of each weight a rank holds, a rank's KV page spec.
- `tp_runner.py`: `TPRunner`, the driver's runner (same `execute(batch) -> StepOutput` as `ModelRunner`);
  `LLM(tensor_parallel_size=N)` uses it; `check_supported` names the options that cannot run across ranks.
- `launcher.py`: `RankProcesses`, N local rank processes behind pipes (spawn, free loopback port, shutdown).
- `rank_worker.py`: `RankWorker`, one rank (process group, weight shard, own page pool, `ModelRunner`);
  free of process-launch concerns so `cluster/` can host it in a Ray actor.
- `errors.py`: `ParallelConfigError`, `UnsupportedWithParallelError`, `RankFailedError`.
The forward itself is `engine.model.LlamaForward` given a shard, local head counts and an `all_reduce`.
"""
