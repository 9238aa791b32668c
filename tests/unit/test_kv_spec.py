"""KVPageSpec: validation at construction, and the layout signature both ends of a transfer compare."""
from __future__ import annotations

import dataclasses

import pytest

import engine.kv_cache.spec as spec_mod
from engine.kv_cache.spec import KVPageSpec

BASE = dict(num_layers=4, num_kv_heads=2, head_dim=16, page_size=16, dtype="float32")


def make(**kw) -> KVPageSpec:
    return KVPageSpec(**{**BASE, **kw})


@pytest.mark.parametrize("kw, what", [
    (dict(dtype="float64"), "dtype"),
    (dict(dtype="int8"), "dtype"),
    (dict(storage_format="int4"), "storage_format"),
    (dict(num_layers=0), "sizes"),
    (dict(num_kv_heads=0), "sizes"),
    (dict(head_dim=-1), "sizes"),
    (dict(page_size=0), "sizes"),
    (dict(tp_rank=1, tp_size=1), "tp_rank"),
    (dict(tp_rank=-1, tp_size=2), "tp_rank"),
    (dict(tp_size=0), "tp_rank"),
    (dict(layer_start=2, layer_end=2), "layer range"),
    (dict(layer_start=3, layer_end=1), "layer range"),
    (dict(layer_end=5), "layer range"),
    (dict(layer_start=-1), "layer range"),
    (dict(layer_start=4), "layer range"),
])
def test_invalid_specs_raise_value_error_naming_the_problem(kw, what):
    with pytest.raises(ValueError, match=what):
        make(**kw)


def test_valid_shard_and_sizes():
    s = make(tp_rank=1, tp_size=2, layer_start=1, layer_end=3, dtype="bfloat16")
    assert list(s.local_layers) == [1, 2]
    assert s.bytes_per_token_layer() == 2 * 2 * 16 * 2  # K and V, 2 heads, 16 dims, 2 bytes
    assert s.bytes_per_page() == 16 * 2 * 2 * 16 * 2 * 2  # page_size * per-token-layer * 2 local layers
    assert make().layers_end == 4 and list(make().local_layers) == [0, 1, 2, 3]


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        make().page_size = 32


def test_signature_ignores_page_size():
    sigs = {make(page_size=ps).signature() for ps in (1, 3, 16, 32)}
    assert len(sigs) == 1
    assert isinstance(next(iter(sigs)), str) and len(next(iter(sigs))) >= 8


def test_signature_is_deterministic_and_normalizes_layer_end():
    assert make().signature() == make().signature()
    assert make().signature() == make(layer_end=4).signature()  # None means "to the last layer"


@pytest.mark.parametrize("kw", [
    dict(dtype="bfloat16"),
    dict(dtype="float16"),
    dict(num_kv_heads=4),
    dict(head_dim=32),
    dict(num_layers=5),
    dict(tp_size=2),
    dict(tp_rank=1, tp_size=2),
    dict(layer_start=1),
    dict(layer_end=3),
    dict(layer_start=1, layer_end=3),
])
def test_signature_differs_when_layout_differs(kw):
    assert make(**kw).signature() != make().signature()


def test_signature_differs_between_tp_ranks_and_layer_ranges():
    a = make(tp_rank=0, tp_size=2).signature()
    b = make(tp_rank=1, tp_size=2).signature()
    c = make(layer_start=0, layer_end=2).signature()
    d = make(layer_start=2, layer_end=4).signature()
    assert len({a, b, c, d}) == 4


def test_signature_differs_by_storage_format(monkeypatch):
    # Only "raw" is registered today; register a second format the way a quantized backend would.
    monkeypatch.setattr(spec_mod, "STORAGE_FORMATS", ("raw", "int8"))
    assert make(storage_format="int8").signature() != make(storage_format="raw").signature()
    assert make(storage_format="int8", page_size=4).signature() == make(storage_format="int8").signature()
