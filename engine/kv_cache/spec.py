"""`KVPageSpec`: the shape and format of one KV page pool, and the layout signature.

Both ends of a KV transfer compare `signature()` before a byte moves. The page size is left out of the
signature on purpose: transfers are addressed by token range, so a prefill worker with 16-token pages can
ship into a decode worker with 32-token pages. Everything else (layers, heads, head dim, dtype, storage
format, sharding) must agree for the bytes to mean the same thing. Exception: "kivi4" cells carry a share of
their page's per-channel key scales (`kivi.py`), so for it the page size is part of the signature and a
transfer between pools of different page sizes is refused as a layout mismatch.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

# Storage formats a page pool may hold: "raw" (the compute dtype), "int8" and "fp8" (e4m3) with a float16
# scale per (token, head) (`quantized.py`); "kivi4" (4-bit KIVI: keys per channel over a page, values per
# token, the unsealed last page in full precision; `kivi.py`). The transfer layer ships each unchanged.
STORAGE_FORMATS = ("raw", "int8", "fp8", "kivi4")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class KVPageSpec:
    num_layers: int  # global layer count of the model
    num_kv_heads: int  # KV heads held by this shard
    head_dim: int
    page_size: int  # tokens per page
    dtype: str  # compute dtype of K/V, one of DTYPES
    storage_format: str = "raw"
    tp_rank: int = 0
    tp_size: int = 1
    layer_start: int = 0  # this shard holds layers [layer_start, layer_end)
    layer_end: int | None = None
    cell_align: int = 1  # int8/fp8 cells padded to a multiple of this many bytes (16: the Triton kernel's loads)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"KVPageSpec.dtype {self.dtype!r} not in {DTYPES}")
        if self.storage_format not in STORAGE_FORMATS:
            raise ValueError(f"KVPageSpec.storage_format {self.storage_format!r} not in {STORAGE_FORMATS}")
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.page_size) < 1:
            raise ValueError(f"KVPageSpec sizes must be >= 1: {self}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"KVPageSpec tp_rank {self.tp_rank} outside [0, {self.tp_size})")
        if not 0 <= self.layer_start < self.layers_end <= self.num_layers:
            raise ValueError(f"KVPageSpec layer range [{self.layer_start}, {self.layers_end}) invalid")
        if self.storage_format == "kivi4" and (self.head_dim % 2 or (4 * self.head_dim) % self.page_size
                                               or self.head_dim % min(self.head_dim, KIVI_VALUE_GROUP)):
            raise ValueError(f"KVPageSpec kivi4 needs an even head_dim divisible by its value group, and a "
                             f"page_size dividing 4 * head_dim (the page's per-channel key scales are spread "
                             f"over its token rows): {self}")

    @property
    def layers_end(self) -> int:
        return self.num_layers if self.layer_end is None else self.layer_end

    @property
    def local_layers(self) -> range:
        return range(self.layer_start, self.layers_end)

    @property
    def itemsize(self) -> int:
        return {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]

    def token_head_bytes(self) -> int:
        """Stored bytes of one token of one KV head, for K (V is the same size)."""
        if self.storage_format == "raw":
            return self.head_dim * self.itemsize
        if self.storage_format == "kivi4":
            return kivi_cell_bytes(self.head_dim, self.page_size)
        cell = self.head_dim + 2  # one byte per value + a float16 scale (engine/kv_cache/quantized.py)
        return -(-cell // self.cell_align) * self.cell_align

    def bytes_per_token_layer(self) -> int:
        """Stored bytes of K plus V for one token in one layer."""
        return 2 * self.num_kv_heads * self.token_head_bytes()

    def bytes_per_page(self, summaries: bool = False) -> int:
        """Stored K + V of one page over this shard's layers; summaries=True adds sparse attention's page
        summaries (kept beside the pages while it is on; never shipped, so not part of the signature)."""
        extra = self.summary_bytes_per_page() if summaries else 0
        return self.page_size * self.bytes_per_token_layer() * len(self.local_layers) + extra

    def summary_bytes_per_page(self) -> int:
        """Channel-wise key min and max per KV head and layer, in the compute dtype (`summaries.py`)."""
        return 2 * self.num_kv_heads * self.head_dim * self.itemsize * len(self.local_layers)

    def signature(self) -> str:
        fields = asdict(self)
        if self.storage_format != "kivi4":  # kivi4 cells carry a share of their page's key scales: a token
            fields.pop("page_size")  # range means the same bytes only between pools of one page size

        fields["layer_end"] = self.layers_end
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


KIVI_VALUE_GROUP = 32  # kivi4 values: one scale/zero per token, head and group of this many channels


def kivi_layout(head_dim: int, page_size: int) -> tuple[int, int, int, int]:
    """kivi4 cell layout (`kivi.py`): (cell bytes, K cell key-metadata bytes, V cell key-metadata bytes,
    value-metadata bytes). A cell is head_dim / 2 packed nibbles plus an equal share of the token's
    metadata: its value scales/zeros (4 bytes per value group) and its 1/page_size of the page's
    per-channel key scale/zero (4 * head_dim / page_size bytes); the V cell holds all its value metadata."""
    kmeta, vmeta = 4 * head_dim // page_size, 4 * -(-head_dim // KIVI_VALUE_GROUP)
    c = max(-(-(kmeta + vmeta) // 2), vmeta)
    a = min(c, kmeta)
    return head_dim // 2 + c, a, kmeta - a, vmeta


def kivi_cell_bytes(head_dim: int, page_size: int) -> int:
    return kivi_layout(head_dim, page_size)[0]
