"""pdserve decode_worker: KV in, tokens out (see docs/design.md).

- `worker`  `DecodeWorker`: an `engine.LLM` (continuous batching; preemption by local recompute) plus a
            `kv_transfer` `KVReceiver`; `reserve` (admission by free pages) / `abort` / `step() ->
            DecodeDelta`s / `stats()`; without a receiver it is a colocated replica (`add_request`). A plain
            class: `cluster/serving/actors.py` runs it in a Ray actor, tests run it in-process. Draft-verify
            decoding runs inside its engine (`EngineConfig.speculative`; proposers and verify live in
            engine/spec_decode so the standalone/colocated `LLM` shares them); `spec_*` stats.
"""
