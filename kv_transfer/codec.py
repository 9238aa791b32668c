"""Frames on the KV plane: build them (sender) and check them against a reservation (receiver). Pure.

No torch, no grpc, no I/O: bytes in, `kv_transfer_pb2` messages and plain dataclasses out, so the decoder
can be fuzzed. Only protobuf parses bytes here (no Python object serialization of any kind).

Sender:   encode(open_frame()) -> chunk_wire() per layer and token range -> encode(finish_frame())
          (transports carry frames as wire bytes)
Receiver: parse_wire() on the wire bytes (the decoder the fuzz tests drive; chunk payloads come back as
          zero-copy views), then
          check_open() once, check_chunk() per chunk -- every count, range and size against the
          reservation's `TransferLayout` BEFORE anything is allocated or written -- then
          verify_payload() (length and XXH3-64 checksum) before the chunk may be committed to pages.
A chunk's payload is K then V, each [tokens, heads, head_dim] in the pool's storage format; the layout
says how many bytes one (token, head) takes, so the codec never interprets the bytes.
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass

import xxhash
from google.protobuf.message import DecodeError

from engine.kv_cache.spec import DTYPES, STORAGE_FORMATS, KVPageSpec
from kv_transfer import kv_transfer_pb2 as pb
from kv_transfer.contract import (DataLoss, FailedPrecondition, InvalidFrame, ResourceExhausted,
                                  TransferDescriptor)

ALLOWED_DTYPES = frozenset(DTYPES)  # float32, bfloat16, float16
ALLOWED_FORMATS = frozenset(STORAGE_FORMATS)  # every engine format: cells are shipped as stored
_U32 = (1 << 32) - 1
_CHUNK_TAG = bytes([(2 << 3) | 2])  # Frame.chunk: field 2, length-delimited
_PAYLOAD_TAG = bytes([(12 << 3) | 2])  # Chunk.payload: field 12, length-delimited
_MIB = 1 << 20
CHUNK_SLACK = 64  # a planned chunk may exceed the target by 1/64 (see plan_token_ranges)


@dataclass(frozen=True)
class TransferLayout:
    """The shape both ends agree on (from the `KVPageSpec`, page size aside): what a chunk may address."""
    dtype: str
    storage_format: str
    num_layers: int
    layer_start: int  # local layers [layer_start, layer_end)
    layer_end: int
    head_start: int  # global KV heads held by this shard [head_start, head_end)
    head_end: int
    head_dim: int
    tp_rank: int
    tp_size: int
    token_head_bytes: int  # stored bytes of one token of one head, for K (V the same)

    @classmethod
    def from_spec(cls, spec: KVPageSpec, token_head_bytes: int) -> "TransferLayout":
        h0 = spec.tp_rank * spec.num_kv_heads
        return cls(spec.dtype, spec.storage_format, spec.num_layers, spec.layer_start, spec.layers_end,
                   h0, h0 + spec.num_kv_heads, spec.head_dim, spec.tp_rank, spec.tp_size, token_head_bytes)

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start

    @property
    def num_local_layers(self) -> int:
        return self.layer_end - self.layer_start

    def payload_bytes(self, tokens: int, heads: int) -> int:
        return 2 * tokens * heads * self.token_head_bytes

    def transfer_bytes(self, num_tokens: int) -> int:
        """Payload bytes of a whole transfer of `num_tokens` tokens (every local layer and head)."""
        return self.num_local_layers * self.payload_bytes(num_tokens, self.num_heads)


@dataclass(frozen=True)
class ChunkHeader:
    layer: int
    head_start: int
    head_end: int
    token_start: int
    token_end: int
    byte_length: int
    checksum: int  # XXH3-64 of the payload

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


# ---- sender side ---------------------------------------------------------------------------------
def open_frame(desc: TransferDescriptor, layout: TransferLayout, prompt_token_ids: list[int],
               num_kv_heads: int) -> pb.Frame:
    return pb.Frame(open=pb.Open(
        request_id=desc.request_id, reservation_id=desc.reservation_id, nonce=desc.nonce,
        model_fingerprint=desc.model_fingerprint, layout_signature=desc.layout_signature,
        prompt_token_ids=prompt_token_ids, dtype=layout.dtype, storage_format=layout.storage_format,
        num_layers=layout.num_layers, num_kv_heads=num_kv_heads, head_dim=layout.head_dim,
        tp_rank=layout.tp_rank, tp_size=layout.tp_size, kv_start=desc.kv_start))


def plan_token_ranges(start: int, stop: int, layout: TransferLayout, target_bytes: int,
                      num_heads: int | None = None) -> list[tuple[int, int]]:
    """Split tokens [start, stop) of one layer (all local heads, or `num_heads` of them) into chunks of
    about `target_bytes`: token counts spread evenly, none over `target_bytes` + 1/64 (`CHUNK_SLACK`), nor
    over 1 MiB (receivers' default `max_chunk_bytes`) unless the target itself is.

    Why the slack: a layer is rarely a whole number of target-sized chunks, and cutting at exactly the
    target leaves a tail chunk of a few tokens (2,048 SmolLM2 tokens at 512 KiB: 682 + 682 + 682 + 2),
    a third more chunks -- each a gRPC message with its own per-message cost -- for the same bytes."""
    per_token = layout.payload_bytes(1, layout.num_heads if num_heads is None else num_heads)
    limit = target_bytes + target_bytes // CHUNK_SLACK
    limit = min(limit, max(target_bytes, _MIB))
    max_step = max(1, limit // per_token)
    count = -(-(stop - start) // max_step)  # fewest chunks within the limit ...
    step = -(-(stop - start) // count)  # ... with their tokens spread evenly
    return [(a, min(a + step, stop)) for a in range(start, stop, step)]


def chunk_wire(layout: TransferLayout, layer: int, token_start: int, token_end: int,
               k: memoryview, v: memoryview, heads: range | None = None) -> bytes:
    """Wire bytes of `Frame(chunk=Chunk(...))` for all local heads (or the global KV heads `heads`: a
    parallel replica ships each rank's heads); `k`, `v`: stored bytes of these tokens.

    Protobuf serializes the small header; the payload goes in front of it as field 12 (protobuf fields
    may come in any order and be concatenated: any protobuf parser reads the same message), so the
    receiver finds it with three varints and parses only the header (`parse_wire`). The K/V bytes are
    copied exactly once, straight into the frame, and checksummed in place.
    """
    n = len(k) + len(v)
    h0, h1 = (layout.head_start, layout.head_end) if heads is None else (heads.start, heads.stop)
    head = pb.Chunk(layer=layer, head_start=h0, head_end=h1, token_start=token_start,
                    token_end=token_end, tp_rank=layout.tp_rank, tp_size=layout.tp_size, dtype=layout.dtype,
                    storage_format=layout.storage_format, byte_length=n,
                    checksum=checksum(k, v)).SerializeToString()
    payload_tag = _PAYLOAD_TAG + _varint(n)
    return b"".join((_CHUNK_TAG, _varint(len(head) + len(payload_tag) + n), payload_tag, k, v, head))


def checksum(*parts) -> int:
    """XXH3-64 of the concatenated parts (bytes-like), without concatenating them."""
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return h.intdigest()


def encode(frame: pb.Frame) -> bytes:
    return frame.SerializeToString()


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def finish_frame(first_token_id: int, num_chunks: int, num_slots: int = 0) -> pb.Frame:
    """num_slots: tokens of KV shipped when the prefill evicted some (0: the whole prompt)."""
    return pb.Frame(finish=pb.Finish(first_token_id=first_token_id, num_chunks=num_chunks, num_slots=num_slots))


# ---- receiver side -------------------------------------------------------------------------------
def parse_frame(data: bytes) -> pb.Frame:
    """Bytes -> a Frame with exactly one kind set (InvalidFrame otherwise)."""
    try:
        frame = pb.Frame.FromString(data)
    except DecodeError as e:
        raise InvalidFrame(f"frame does not parse: {e}") from None
    if frame.WhichOneof("kind") is None:
        raise InvalidFrame("frame has no open, chunk or finish")
    return frame


def parse_wire(data: bytes) -> tuple[pb.Frame, memoryview | bytes | None]:
    """Bytes -> (frame, payload). For a chunk frame the payload is returned beside it -- a zero-copy view
    of `data` on the fast path -- and `frame.chunk.payload` is left empty; otherwise payload is None.

    Fast paths: `data` is exactly one chunk field whose payload (field 12) comes first, followed by a
    header in protobuf's own encoding without a payload (what `chunk_wire` makes): three varints find the
    payload and protobuf parses the header alone. Or one whose payload occurs once anywhere: a walk over
    the fields finds it. Either way protobuf parses the header with the payload cut out, which is what it
    would make of the whole. Anything else goes through a full protobuf parse (same result, one more
    copy). Typed errors only."""
    view = memoryview(data)
    first = _payload_first(view)
    if first is not None:
        return first
    span = _single_chunk_payload(view)
    if span is None:
        frame = parse_frame(data)
        if frame.WhichOneof("kind") != "chunk":
            return frame, None
        payload = frame.chunk.payload
        frame.chunk.ClearField("payload")
        return frame, payload
    chunk_start, key_start, pay_start, pay_end = span
    head = bytes(view[chunk_start:key_start]) + bytes(view[pay_end:])
    try:
        chunk = pb.Chunk.FromString(head)
    except DecodeError as e:
        raise InvalidFrame(f"chunk header does not parse: {e}") from None
    return pb.Frame(chunk=chunk), view[pay_start:pay_end]


def _payload_first(view: memoryview) -> tuple[pb.Frame, memoryview] | None:
    """(frame, payload view) when `view` is one Frame.chunk field spanning the buffer that starts with
    its payload and goes on with a canonical payload-free header; None to try the other paths."""
    end = len(view)
    if end < 3 or view[0] != _CHUNK_TAG[0]:
        return None
    length, pos = _read_varint(view, 1, end)
    if length is None or pos + length != end or pos >= end or view[pos] != _PAYLOAD_TAG[0]:
        return None
    n, pay_start = _read_varint(view, pos + 1, end)
    if n is None or pay_start + n > end:
        return None
    head = bytes(view[pay_start + n:])
    try:
        chunk = pb.Chunk.FromString(head)
    except DecodeError:
        return None  # the general paths name the error
    if chunk.payload or chunk.SerializeToString() != head:  # a second payload field, or not canonical
        return None
    return pb.Frame(chunk=chunk), view[pay_start:pay_start + n]


def _single_chunk_payload(buf: memoryview) -> tuple[int, int, int, int] | None:
    """(chunk start, payload key start, payload start, payload end) when `buf` is one Frame.chunk field
    spanning the buffer with exactly one well-formed payload field; None to fall back to protobuf."""
    end = len(buf)
    if end < 2 or buf[0] != _CHUNK_TAG[0]:
        return None
    length, pos = _read_varint(buf, 1, end)
    if length is None or pos + length != end:
        return None
    start, span = pos, None
    while pos < end:
        key_start = pos
        key, pos = _read_varint(buf, pos, end)
        if key is None:
            return None
        wire_type = key & 7
        if wire_type == 0:
            _, pos = _read_varint(buf, pos, end)
        elif wire_type == 1 or wire_type == 5:
            pos += 8 if wire_type == 1 else 4
        elif wire_type == 2:
            n, pos = _read_varint(buf, pos, end)
            if n is None or pos + n > end:
                return None
            if key >> 3 == 12:
                if span is not None:
                    return None  # repeated payload field: protobuf's last-one-wins, not ours
                span = (start, key_start, pos, pos + n)
            pos += n
        else:
            return None
        if pos is None or pos > end:
            return None
    return span


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int | None, int | None]:
    value = shift = 0
    while pos < end and shift < 64:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
    return None, None


def check_layout(msg: pb.Open, layout: TransferLayout, num_kv_heads: int) -> None:
    """The sender's layout, field by field, against ours (FailedPrecondition naming the first mismatch)."""
    if msg.dtype not in ALLOWED_DTYPES:
        raise InvalidFrame(f"dtype {msg.dtype!r} is not allowed ({sorted(ALLOWED_DTYPES)})")
    if msg.storage_format not in ALLOWED_FORMATS:
        raise InvalidFrame(f"storage format {msg.storage_format!r} is not allowed ({sorted(ALLOWED_FORMATS)})")
    ours = dict(dtype=layout.dtype, storage_format=layout.storage_format, num_layers=layout.num_layers,
                num_kv_heads=num_kv_heads, head_dim=layout.head_dim, tp_rank=layout.tp_rank,
                tp_size=layout.tp_size)
    for name, want in ours.items():
        got = getattr(msg, name)
        if got != want:
            raise FailedPrecondition(f"layout mismatch: sender {name}={got!r}, receiver {name}={want!r}")


def check_binding(msg: pb.Open, fingerprint: str, signature: str, num_tokens: int, kv_start: int = 0) -> None:
    """Model and layout identity, the prompt against the reservation's token count, and the first token
    the sender ships against the reservation's `kv_start` (the KV before it is on the receiver already)."""
    if not hmac.compare_digest(msg.model_fingerprint.encode(), fingerprint.encode()):
        raise FailedPrecondition(f"model fingerprint {msg.model_fingerprint!r} != receiver's {fingerprint!r}")
    if not hmac.compare_digest(msg.layout_signature.encode(), signature.encode()):
        raise FailedPrecondition(f"layout signature {msg.layout_signature!r} != receiver's {signature!r}")
    if len(msg.prompt_token_ids) != num_tokens:
        raise InvalidFrame(f"{len(msg.prompt_token_ids)} prompt token ids; the reservation is for {num_tokens}")
    if msg.kv_start != kv_start:
        raise FailedPrecondition(f"sender ships KV from token {msg.kv_start}; the reservation holds tokens "
                                 f"[0, {kv_start}) already and takes KV from token {kv_start} on")


def check_chunk(msg: pb.Chunk, layout: TransferLayout, num_tokens: int, max_chunk_bytes: int,
                kv_start: int = 0) -> ChunkHeader:
    """Every count, range and declared size of a chunk against the reservation, before the payload is
    touched (each read of `msg.payload` copies it) or anything is allocated. Tokens below `kv_start` are
    refused: the receiver holds them in shared cached pages, which nothing may write."""
    if msg.byte_length > max_chunk_bytes:
        raise ResourceExhausted(f"chunk of {msg.byte_length} bytes exceeds the {max_chunk_bytes}-byte cap")
    if msg.dtype not in ALLOWED_DTYPES or msg.dtype != layout.dtype:
        raise InvalidFrame(f"chunk dtype {msg.dtype!r}: expected {layout.dtype!r}")
    if msg.storage_format not in ALLOWED_FORMATS or msg.storage_format != layout.storage_format:
        raise InvalidFrame(f"chunk storage format {msg.storage_format!r}: expected {layout.storage_format!r}")
    if (msg.tp_rank, msg.tp_size) != (layout.tp_rank, layout.tp_size):
        raise InvalidFrame(f"chunk from tp rank {msg.tp_rank}/{msg.tp_size}; this receiver takes "
                           f"{layout.tp_rank}/{layout.tp_size} (a transfer is addressed in the replica's whole "
                           f"layout, global KV heads and layers; each side maps them to its own ranks)")
    _check_range("layer", msg.layer, msg.layer + 1, layout.layer_start, layout.layer_end)
    _check_range("heads", msg.head_start, msg.head_end, layout.head_start, layout.head_end)
    _check_range("tokens", msg.token_start, msg.token_end, kv_start, num_tokens)
    want = layout.payload_bytes(msg.token_end - msg.token_start, msg.head_end - msg.head_start)
    if msg.byte_length != want:
        raise InvalidFrame(f"chunk says {msg.byte_length} bytes; its ranges hold {want}")
    return ChunkHeader(msg.layer, msg.head_start, msg.head_end, msg.token_start, msg.token_end,
                       msg.byte_length, msg.checksum)


def verify_payload(header: ChunkHeader, payload: memoryview | bytes) -> None:
    """Length and checksum, before the chunk may be committed."""
    if len(payload) != header.byte_length:
        raise DataLoss(f"payload is {len(payload)} bytes; header says {header.byte_length}")
    got = xxhash.xxh3_64_intdigest(payload)
    if got != header.checksum:
        raise DataLoss(f"checksum mismatch on layer {header.layer} tokens "
                       f"[{header.token_start}, {header.token_end}): {got:#018x} != {header.checksum:#018x}")


def decode_chunk(data: bytes, layout: TransferLayout, num_tokens: int,
                 max_chunk_bytes: int) -> tuple[ChunkHeader, memoryview | bytes]:
    """Bytes of one frame -> a checked chunk header and its verified payload (typed errors only)."""
    frame, payload = parse_wire(data)
    if payload is None:
        raise InvalidFrame(f"expected a chunk frame, got {frame.WhichOneof('kind')}")
    header = check_chunk(frame.chunk, layout, num_tokens, max_chunk_bytes)
    verify_payload(header, payload)
    return header, payload


def _check_range(what: str, lo: int, hi: int, min_lo: int, max_hi: int) -> None:
    if not (min_lo <= lo < hi <= max_hi and hi <= _U32):
        raise InvalidFrame(f"{what} [{lo}, {hi}) outside [{min_lo}, {max_hi}) or empty")
