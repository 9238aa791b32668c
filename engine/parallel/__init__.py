"""Tensor-, pipeline- and expert-parallel execution of one engine replica (issues 9 and 35).

The replica's driver (`engine.LLM`) keeps the scheduler, the page allocator and the block tables and
sends each step as a plain `StepBatch` to N processes, each with its own page pool under the same page
ids (expert ranks with data-parallel attention: each its own rows, its partition of the page ids). Module map, in the order a step meets them:
- `tp_runner.py`: `TPRunner` / `PPRunner` / `EPRunner` / `EPDataRunner`, the driver's runners (same `execute(batch) ->
  StepOutput` as `ModelRunner`), `make_parallel_runner`, and `check_supported` (degrees and options, before launch).
- `launcher.py`: `RankProcesses`, N local processes behind socketpairs (free loopback port, shutdown).
- `rank_worker.py`: `RankWorker`, one tensor-parallel rank (process group, weight shard, KV heads).
- `stage_worker.py`: `StageWorker`, one pipeline stage (its layers, hidden states to the next stage,
  micro-batches in flight).
- `expert_worker.py`: `ExpertWorker`, one expert-parallel rank (the whole attention, its block of every MoE
  layer's experts); with TP, one rank of an expert group of TP ranks (its heads and slices, attention reduced
  within the group). Data-parallel attention (the default): the group's own sequences in its own page pool (a
  partition of the driver's allocator, `EPDataRunner`), tokens sent to their experts' groups and back
  (`dispatch.py`, `AllToAllDispatch`). Replicated: every sequence, the replica's whole KV, partial MoE outputs
  all-reduced.
- `shard.py` / `stages.py` / `experts.py`: pure functions: which heads / layers / experts a rank holds (KV-head
  replication when TP exceeds the KV heads), which weights it reads, its `KVPageSpec`, validation with typed errors.
- `kv_io.py`: a request's KV out of / into a replica of any layout by (layer, KV-head range, tokens),
  routed to the ranks or stages that hold them (KV resharding between prefill and decode layouts).
- `validate.py`: `validate_tp` / `validate_pp` / `validate_ep` / `check_supported` / `parallel_problems` (no
  torch): the one judge of degrees and options, shared by `LLM` and the cluster spec.
- `errors.py`: `ParallelConfigError`, `UnsupportedWithParallelError`, `RankFailedError`.
Workers are free of process-launch concerns, so `cluster/` can host them in Ray actors. The forward is
`engine.model.LlamaForward` given a shard (local head counts, an `all_reduce`), a layer slice, or a block of
experts (`experts`, an `expert_reduce`).
"""
