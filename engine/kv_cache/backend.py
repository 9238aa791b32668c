"""The attention backend: KV storage behind `write(layer, slots, k, v)` and `attend(layer, q, ctx)`.

The model never indexes cache tensors; it hands the backend the keys (after RoPE) and values of the new
tokens and asks for attention outputs. Formats, by name in `BACKENDS`: "raw" (`raw.py`: pages in the
compute dtype, the base class of the others), "int8" and "fp8" (`quantized.py`), "kivi4" (`kivi.py`, which
also keeps a full-precision staging copy of pages being filled and wants `release_pages` when a page is let
go), so the model and the transfer layer stay unchanged.

Who calls it: `LLM` and the parallel rank/stage workers build their pool's backend with `make_backend`.
Why the table is written here rather than filled by each format's module when imported: the formats
import `raw.py`, this module imports the formats, and nothing imports back (no import cycle; a format is
present exactly when this module is). A new format: its module, a row here, its name in
`spec.STORAGE_FORMATS`.
"""
from __future__ import annotations

from engine.kv_cache.kivi import KIVIBackend
from engine.kv_cache.quantized import QUANTIZED_FORMATS, QuantizedKVBackend
from engine.kv_cache.raw import RawKVBackend, torch_dtype
from engine.kv_cache.spec import STORAGE_FORMATS, KVPageSpec

__all__ = ["BACKENDS", "RawKVBackend", "make_backend", "torch_dtype"]

BACKENDS = {
    "raw": RawKVBackend,
    **{fmt: QuantizedKVBackend for fmt in QUANTIZED_FORMATS},
    "kivi4": KIVIBackend,
}
assert set(BACKENDS) == set(STORAGE_FORMATS), (sorted(BACKENDS), STORAGE_FORMATS)


def make_backend(spec: KVPageSpec, num_pages: int, device="cpu"):
    return BACKENDS[spec.storage_format](spec, num_pages, device)
