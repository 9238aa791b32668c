"""The KV-plane codec: frames built by the sender decode back bit-exactly; every malformed frame -- random,
truncated, oversized, wrong-dtype, wrong-range -- raises a typed `TransferError` and nothing else (fuzzed);
`Inbound` recognises duplicates and refuses partial overlaps. Pure: no engine, no network."""
from __future__ import annotations

import xxhash

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv_cache.spec import KVPageSpec
from kv_transfer import codec
from kv_transfer import kv_transfer_pb2 as pb
from kv_transfer.contract import (DataLoss, ErrorCode, FailedPrecondition, InvalidFrame, ResourceExhausted,
                                  TransferDescriptor, TransferError, TransferState)
from kv_transfer.inbound import Inbound

SPEC = KVPageSpec(num_layers=3, num_kv_heads=2, head_dim=4, page_size=4, dtype="bfloat16")
LAYOUT = codec.TransferLayout.from_spec(SPEC, token_head_bytes=SPEC.head_dim * SPEC.itemsize)  # 8 B
NUM_TOKENS = 10
CAP = 4096
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def kv_bytes(layer: int, a: int, b: int) -> tuple[memoryview, memoryview]:
    row = LAYOUT.payload_bytes(1, LAYOUT.num_heads) // 2
    k = bytes((layer * 31 + i) % 251 for i in range(a * row, b * row))
    return memoryview(k), memoryview(bytes(reversed(k)))


def good_chunk(layer=1, a=2, b=5) -> pb.Frame:
    return codec.parse_frame(codec.chunk_wire(LAYOUT, layer, a, b, *kv_bytes(layer, a, b)))


def decode(frame_or_bytes):
    data = frame_or_bytes if isinstance(frame_or_bytes, bytes) else frame_or_bytes.SerializeToString()
    return codec.decode_chunk(data, LAYOUT, NUM_TOKENS, CAP)


# ---- round trip and planning ---------------------------------------------------------------------
def test_chunk_round_trip_is_bit_exact():
    k, v = kv_bytes(1, 2, 5)
    header, payload = decode(good_chunk())
    assert (header.layer, header.token_start, header.token_end, header.head_start, header.head_end) == (1, 2, 5, 0, 2)
    assert payload == bytes(k) + bytes(v) and header.byte_length == len(payload) == 2 * 3 * 2 * 8
    assert header.checksum == xxhash.xxh3_64_intdigest(payload)


@given(layer=st.integers(0, 2), a=st.integers(0, 9), n=st.integers(1, 10))
def test_chunk_wire_is_the_message_protobuf_builds_payload_first(layer, a, n):
    b = min(a + n, NUM_TOKENS)
    k, v = kv_bytes(layer, a, b)
    data = codec.chunk_wire(LAYOUT, layer, a, b, k, v)
    whole = codec.parse_frame(data)  # protobuf's own parse of the hand-made wire
    assert whole.chunk.payload == bytes(k) + bytes(v) and whole.chunk.checksum == codec.checksum(k, v)
    assert (whole.chunk.layer, whole.chunk.token_start, whole.chunk.token_end) == (layer, a, b)
    assert len(data) == len(whole.SerializeToString())  # same fields, payload moved to the front
    frame, payload = codec.parse_wire(data)  # the payload-first fast path: a view, not a copy
    assert isinstance(payload, memoryview) and bytes(payload) == whole.chunk.payload
    frame.chunk.payload = bytes(payload)
    assert frame == whole
    big = codec.chunk_wire(LAYOUT, 0, 0, 1, memoryview(b"k" * 70000), memoryview(b"v" * 70000))
    frame, payload = codec.parse_wire(big)  # multi-byte length varints
    assert bytes(payload) == b"k" * 70000 + b"v" * 70000 and frame.chunk.byte_length == 140000


def test_payload_last_and_repeated_payload_frames_parse_as_protobuf_does():
    """The other encodings of a chunk: protobuf's own (payload last) takes the field walk; a second
    payload field (protobuf keeps the last one) is never served from the first."""
    k, v = kv_bytes(1, 2, 5)
    msg = codec.parse_frame(codec.chunk_wire(LAYOUT, 1, 2, 5, k, v))
    frame, payload = codec.parse_wire(msg.SerializeToString())
    assert bytes(payload) == msg.chunk.payload and frame.chunk.token_end == 5
    head = pb.Chunk()
    head.CopyFrom(msg.chunk)
    head.ClearField("payload")

    def field(data: bytes) -> bytes:
        return codec._PAYLOAD_TAG + codec._varint(len(data)) + data

    body = field(bytes(k) + bytes(v)) + head.SerializeToString() + field(b"xyz")
    data = codec._CHUNK_TAG + codec._varint(len(body)) + body
    whole = pb.Frame.FromString(data)
    frame, payload = codec.parse_wire(data)
    assert bytes(payload) == whole.chunk.payload == b"xyz"
    body = field(bytes(k) + bytes(v)) + head.SerializeToString() + field(b"")  # an empty last one wins too
    frame, payload = codec.parse_wire(codec._CHUNK_TAG + codec._varint(len(body)) + body)
    assert bytes(payload) == b"" and frame.chunk.token_end == 5


@given(start=st.integers(0, 50), length=st.integers(1, 300), target=st.integers(1, 5000))
def test_plan_covers_the_range_in_chunks_under_target(start, length, target):
    ranges = codec.plan_token_ranges(start, start + length, LAYOUT, target)
    assert ranges[0][0] == start and ranges[-1][1] == start + length
    assert all(a < b and b == c for (a, b), (c, _) in zip(ranges, ranges[1:] + [(ranges[-1][1], 0)]))
    per_token = LAYOUT.payload_bytes(1, LAYOUT.num_heads)
    limit = max(target + target // codec.CHUNK_SLACK, per_token)
    assert all((b - a) * per_token <= limit for a, b in ranges)
    step = max(1, limit // per_token)
    assert len(ranges) == -(-length // step)  # the fewest chunks within the limit: no tiny tail chunk


# ---- each malformed field, its typed error -------------------------------------------------------
def _with(**fields) -> pb.Frame:
    f = good_chunk()
    for name, value in fields.items():
        setattr(f.chunk, name, value)
    return f


@pytest.mark.parametrize("fields, error, match", [
    (dict(dtype="float64"), InvalidFrame, "dtype"),
    (dict(dtype="float32"), InvalidFrame, "dtype"),
    (dict(storage_format="int8"), InvalidFrame, "storage format"),
    (dict(tp_size=2), InvalidFrame, "tp rank"),
    (dict(layer=3), InvalidFrame, "layer"),
    (dict(head_end=3), InvalidFrame, "heads"),
    (dict(head_start=2), InvalidFrame, "heads"),
    (dict(token_end=11), InvalidFrame, "tokens"),
    (dict(token_start=5), InvalidFrame, "tokens"),
    (dict(byte_length=95), InvalidFrame, "ranges hold"),
    (dict(byte_length=CAP + 1), ResourceExhausted, "cap"),
    (dict(payload=b"\x00" * 95), DataLoss, "payload is 95 bytes"),
    (dict(checksum=1), DataLoss, "checksum"),
])
def test_bad_chunk_field_raises_its_typed_error(fields, error, match):
    with pytest.raises(error, match=match):
        decode(_with(**fields))


def test_non_chunk_and_garbage_frames_are_invalid():
    with pytest.raises(InvalidFrame, match="expected a chunk"):
        decode(codec.finish_frame(3, 1))
    with pytest.raises(InvalidFrame, match="no open, chunk or finish"):
        decode(b"")
    with pytest.raises(InvalidFrame, match="does not parse"):
        decode(b"\xff\xff\xff")


def test_open_layout_and_binding_checks():
    desc = TransferDescriptor("r", "res", "n", "fp", SPEC.signature(), 3)
    frame = codec.open_frame(desc, LAYOUT, [1, 2, 3], SPEC.num_kv_heads)
    codec.check_layout(frame.open, LAYOUT, SPEC.num_kv_heads)
    codec.check_binding(frame.open, "fp", SPEC.signature(), 3)
    with pytest.raises(FailedPrecondition, match="head_dim"):
        frame.open.head_dim = 8
        codec.check_layout(frame.open, LAYOUT, SPEC.num_kv_heads)
    with pytest.raises(InvalidFrame, match="not allowed"):
        frame.open.dtype = "int64"
        codec.check_layout(frame.open, LAYOUT, SPEC.num_kv_heads)
    with pytest.raises(FailedPrecondition, match="fingerprint"):
        codec.check_binding(frame.open, "other", SPEC.signature(), 3)
    with pytest.raises(FailedPrecondition, match="signature"):
        codec.check_binding(frame.open, "fp", "0" * 16, 3)
    with pytest.raises(InvalidFrame, match="prompt token ids"):
        codec.check_binding(frame.open, "fp", SPEC.signature(), 4)


# ---- fuzzing: only typed errors, and anything accepted is self-consistent ------------------------
def _accepted_is_consistent(header, payload) -> None:
    assert LAYOUT.layer_start <= header.layer < LAYOUT.layer_end
    assert LAYOUT.head_start <= header.head_start < header.head_end <= LAYOUT.head_end
    assert 0 <= header.token_start < header.token_end <= NUM_TOKENS
    assert len(payload) == header.byte_length <= CAP and xxhash.xxh3_64_intdigest(payload) == header.checksum


def _decode_typed(data: bytes):
    try:
        return decode(data)
    except TransferError as e:
        assert isinstance(e.code, ErrorCode) and e.message
        return None


@FUZZ
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes(data):
    got = _decode_typed(data)
    if got is not None:
        _accepted_is_consistent(*got)


@FUZZ
@given(cut=st.integers(0, 400), layer=st.integers(0, 2), a=st.integers(0, 9), n=st.integers(1, 5))
def test_fuzz_truncated_frames(cut, layer, a, n):
    data = good_chunk(layer, a, min(a + n, NUM_TOKENS)).SerializeToString()
    got = _decode_typed(data[:min(cut, len(data) - 1)])
    if got is not None:
        _accepted_is_consistent(*got)


_FIELDS = st.fixed_dictionaries({}, optional={
    "layer": st.integers(0, 2**32 - 1), "head_start": st.integers(0, 2**32 - 1),
    "head_end": st.integers(0, 2**32 - 1), "token_start": st.integers(0, 2**32 - 1),
    "token_end": st.integers(0, 2**32 - 1), "tp_rank": st.integers(0, 4), "tp_size": st.integers(0, 4),
    "dtype": st.sampled_from(["float32", "bfloat16", "float16", "int8", "float64", "", "bfloat16\x00"]),
    "storage_format": st.sampled_from(["raw", "int8", "fp8", ""]),
    "byte_length": st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 200)),
    "checksum": st.integers(0, 2**64 - 1),
    "payload": st.one_of(st.binary(max_size=300), st.just(b"\x00" * (CAP + 7))),
})


@FUZZ
@given(_FIELDS)
def test_fuzz_wrong_fields_ranges_sizes_and_dtypes(fields):
    got = _decode_typed(_with(**fields).SerializeToString())
    if got is not None:
        _accepted_is_consistent(*got)


@FUZZ
@given(st.binary(min_size=1, max_size=64), st.integers(0, 10_000))
def test_fuzz_bytes_spliced_into_a_valid_frame(noise, at):
    data = bytearray(good_chunk().SerializeToString())
    at %= len(data)
    data[at:at + len(noise)] = noise
    got = _decode_typed(bytes(data))
    if got is not None:
        _accepted_is_consistent(*got)


def _valid_or_spliced():
    wires = st.builds(lambda layer, a, n: codec.chunk_wire(LAYOUT, layer, a, min(a + n, NUM_TOKENS),
                                                           *kv_bytes(layer, a, min(a + n, NUM_TOKENS))),
                      st.integers(0, 2), st.integers(0, 9), st.integers(1, 4))
    noise = st.tuples(wires, st.binary(min_size=1, max_size=8), st.integers(0, 400), st.integers(0, 3))

    def splice(args):
        data, junk, at, mode = args
        data, at = bytearray(data), at % len(data)
        if mode == 0:
            data[at:at + len(junk)] = junk  # overwrite
        elif mode == 1:
            data[at:at] = junk  # insert
        elif mode == 2:
            del data[at:]  # truncate
        else:
            data = data + (codec.encode(codec.finish_frame(1, 1)) if at % 2 else bytes(data))  # extra fields
        return bytes(data)

    return st.one_of(wires, st.binary(max_size=600), noise.map(splice))


@FUZZ
@given(_valid_or_spliced())
def test_fuzz_fast_chunk_parse_agrees_with_protobuf(data):
    try:
        frame, payload = codec.parse_wire(data)
    except TransferError:
        return
    whole = pb.Frame.FromString(data)  # whatever the fast path accepts, protobuf parses the same way
    if payload is None:
        assert frame == whole and whole.WhichOneof("kind") != "chunk"
        return
    frame.chunk.payload = bytes(payload)
    assert frame == whole


# ---- coverage bookkeeping ------------------------------------------------------------------------
def _inbound() -> Inbound:
    desc = TransferDescriptor("r", "res", "n", "fp", "sig", NUM_TOKENS)
    return Inbound(desc, LAYOUT, pages=[0, 1, 2], params=None, expires_at=10.0, max_stream_bytes=1 << 20)


def test_inbound_duplicates_overlaps_and_head_subranges():
    ib = _inbound()
    h = codec.ChunkHeader(0, 0, 2, 0, 4, 0, 0)
    assert ib.mark(h) and not ib.mark(h)  # new, then an idempotent duplicate
    with pytest.raises(InvalidFrame, match="partly overlaps"):
        ib.mark(codec.ChunkHeader(0, 0, 2, 3, 6, 0, 0))
    assert ib.mark(codec.ChunkHeader(0, 0, 1, 4, 10, 0, 0))  # one head of the rest ...
    assert ib.mark(codec.ChunkHeader(0, 1, 2, 4, 10, 0, 0))  # ... then the other
    assert not ib.mark(codec.ChunkHeader(0, 0, 2, 4, 10, 0, 0))  # all of it again: a duplicate
    assert "layer 1" in ib.missing()
    for layer in (1, 2):
        ib.mark(codec.ChunkHeader(layer, 0, 2, 0, NUM_TOKENS, 0, 0))
    assert ib.covered == ib.total_cells and ib.missing() == "nothing"
    assert not ib.ready  # no first token yet, and still PENDING
    assert ib.end(TransferState.FAILED, "x") and not ib.end(TransferState.DONE)  # ends exactly once
    assert ib.status().state == TransferState.FAILED and ib.status().reason == "x"
