"""pdserve kv_transfer: moving one request's KV pages from a prefill engine into a decode engine's pages.

Map (each module opens with its own):
- `contract`       descriptors, polled state (pending/transferring/done/failed), typed errors with
                   grpc-independent codes, the `KVSource`/`KVSink`/`Transport` protocols, `TRANSPORTS`.
- `codec`          pure: build frames (wire bytes), parse them (zero-copy payloads), check them against
                   a reservation (sizes before allocation, XXH3-64 checksum before commit), dtype/format
                   allow-list. Fuzzed.
- `config`         endpoint settings (caps, deadlines, keepalive, TLS, auth token) and the start-up
                   security checks (loopback unless a token is set; `hmac.compare_digest`).
- `sender`         `KVSender` (KVSource): layer hook on the prefill engine, push threads.
- `receiver`       `KVReceiver` (KVSink): admits pushes into reservations, writes validated chunks into
                   pages pinned for them (off the engine thread), commits through
                   `LLM.add_prefilled_request`; `inbound` is its per-transfer record.
- `grpc_transport` the only hand-written module importing grpc; `fake_transport` its in-process twin.
- `null_sink`      a push handler that keeps nothing: the bare transport, for the benches to measure.
- `kv_transfer_pb2*` generated from `proto/kv_transfer.proto` by `stubs` (committed; a test regenerates).

Importing this package imports nothing; transports are imported by name on first use.
"""
