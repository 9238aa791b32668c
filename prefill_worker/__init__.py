"""pdserve prefill_worker: prompts in, first token and KV out (see docs/design.md).

- `worker`  `PrefillWorker`: an `engine.LLM` (its scheduler batches prompts by token budget and admits by
            free pages) plus a `kv_transfer` `KVSender` that publishes each layer's KV as it is computed;
            `submit` / `cancel` / `step() -> PrefillEvent`s / `stats()`. A plain class: `cluster/serving/actors.py`
            runs it in a Ray actor, tests run it in-process.
"""
