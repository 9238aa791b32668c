"""The committed gRPC stubs are exactly what `kv_transfer.stubs.generate` makes from proto/kv_transfer.proto,
and they import as `kv_transfer.kv_transfer_pb2*` (package layout, no post-processing)."""
from __future__ import annotations

from kv_transfer import stubs


def test_regenerating_stubs_gives_the_committed_bytes(tmp_path):
    for path in stubs.generate(tmp_path):
        committed = stubs.ROOT / "kv_transfer" / path.name
        assert path.read_bytes() == committed.read_bytes(), (
            f"{committed.name} is stale: run `.venv/bin/python -m kv_transfer.stubs` and commit")


def test_stubs_import_by_package_and_round_trip_a_frame():
    from kv_transfer import kv_transfer_pb2 as pb

    frame = pb.Frame(chunk=pb.Chunk(layer=3, token_start=0, token_end=2, payload=b"\x00\x01"))
    again = pb.Frame.FromString(frame.SerializeToString())
    assert again.WhichOneof("kind") == "chunk" and again.chunk.layer == 3 and again.chunk.payload == b"\x00\x01"
    src = (stubs.ROOT / "kv_transfer" / "kv_transfer_pb2_grpc.py").read_text()
    assert "from kv_transfer import kv_transfer_pb2" in src


def test_proto_dir_holds_only_proto_files():
    assert sorted(p.name for p in (stubs.ROOT / "proto").iterdir()) == ["kv_transfer.proto"]
