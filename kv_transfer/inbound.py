"""`Inbound`: the receiver's record of one transfer into one reservation (pure Python).

Owned by `kv_transfer.receiver.KVReceiver`, always touched under its lock. Tracks the polled state
(PENDING -> TRANSFERRING -> DONE | FAILED, ended exactly once through `end()`), which (layer, head,
token) cells have arrived -- one bytearray per local layer, [tokens * heads] cells -- so a duplicated
chunk is recognised and ignored and a partly overlapping one refused, the byte budget of the stream,
the chunk writes in flight (pages stay pinned until they land), whether pump() picked it for commit,
and what the `Finish` frame brought (first token). A kivi4 reservation expects only the prompt's whole
pages (`num_shipped`; the decode engine recomputes the tail, `engine/kv_cache/kivi.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kv_transfer.codec import ChunkHeader, TransferLayout
from kv_transfer.contract import (ErrorCode, InvalidFrame, TransferDescriptor, TransferState,
                                  TransferStatus)


@dataclass
class Inbound:
    desc: TransferDescriptor
    layout: TransferLayout
    pages: list[int]  # the reservation's pages, in order (the receiver's page size)
    params: object  # SamplingParams for the decode, or None for the engine default
    expires_at: float  # lease end on the receiver's clock (mirrors the allocator's reservation)
    max_stream_bytes: int
    state: TransferState = TransferState.PENDING
    reason: str | None = None
    code: ErrorCode | None = None
    prompt: list[int] | None = None
    first_token: int | None = None
    streams: int = 0  # open push streams (one at a time)
    received_bytes: int = 0  # every payload byte, duplicates included (the stream cap)
    bytes: int = 0  # bytes of distinct chunks
    chunks: int = 0
    duplicates: int = 0
    pending_writes: int = 0  # chunks being written by transport threads right now
    committing: bool = False  # picked by pump() for commit: transport threads leave it alone
    covered: int = 0
    num_slots: int | None = None  # tokens of KV the finish frame announced (< num_tokens after eviction)
    num_shipped: int | None = None  # tokens [kv_start, num_shipped) arrive (kivi4: whole pages); None = all
    fence: object = None  # device pages: engine-stream event at reservation, which chunk writes wait for
    _cells: list[bytearray] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = self.desc.num_tokens * self.layout.num_heads
        self._cells = [bytearray(n) for _ in range(self.layout.num_local_layers)]

    @property
    def total_cells(self) -> int:
        """Cells to receive: every prompt token from `desc.kv_start` on (the ones before it are in shared
        cached pages already) up to `shipped`, or the `num_slots` the finish frame announced."""
        tokens = self.shipped - self.desc.kv_start if self.num_slots is None else self.num_slots
        return self.layout.num_local_layers * tokens * self.layout.num_heads

    @property
    def shipped(self) -> int:
        return self.desc.num_tokens if self.num_shipped is None else self.num_shipped

    def covers_prefix(self, num_slots: int) -> bool:
        """Exactly the cells of tokens [0, num_slots) of every layer were received (after eviction)."""
        n = num_slots * self.layout.num_heads
        return all(cells.count(1, 0, n) == n and cells.count(1) == n for cells in self._cells)

    @property
    def ready(self) -> bool:
        """Every cell written and the first token known: the engine may commit the request."""
        return (self.state == TransferState.TRANSFERRING and not self.committing
                and self.first_token is not None and self.covered == self.total_cells
                and self.pending_writes == 0)

    def mark(self, h: ChunkHeader) -> bool:
        """Record the chunk's cells: True if new, False for a duplicate; InvalidFrame on partial overlap."""
        cells = self._cells[h.layer - self.layout.layer_start]
        heads = self.layout.num_heads
        a, b = h.head_start - self.layout.head_start, h.head_end - self.layout.head_start
        spans = ([(h.token_start * heads, h.token_end * heads)] if (a, b) == (0, heads) else
                 [(t * heads + a, t * heads + b) for t in range(h.token_start, h.token_end)])
        size = sum(e - s for s, e in spans)
        seen = sum(cells.count(1, s, e) for s, e in spans)
        if seen == size:
            return False
        if seen:
            raise InvalidFrame(f"chunk layer {h.layer} heads [{h.head_start}, {h.head_end}) tokens "
                               f"[{h.token_start}, {h.token_end}) partly overlaps chunks already received")
        for s, e in spans:
            cells[s:e] = b"\x01" * (e - s)
        self.covered += size
        return True

    def missing(self) -> str:
        """Where data is missing, for error messages."""
        heads = self.layout.num_heads
        for i, cells in enumerate(self._cells):
            got = cells.count(1)
            if got != (self.shipped - self.desc.kv_start) * heads:
                return (f"layer {self.layout.layer_start + i} has {got // heads if heads else 0} of "
                        f"{self.shipped - self.desc.kv_start} tokens from token {self.desc.kv_start} "
                        f"({self.total_cells - self.covered} cells missing in all)")
        return "nothing"

    def end(self, state: TransferState, reason: str | None = None, code: ErrorCode | None = None) -> bool:
        """Move to a terminal state; False (and no change) if it already ended."""
        assert state.terminal, state
        if self.state.terminal:
            return False
        self.state, self.reason, self.code = state, reason, code
        return True

    def status(self) -> TransferStatus:
        return TransferStatus(self.state, self.reason, self.code, self.bytes, self.chunks, self.duplicates)
