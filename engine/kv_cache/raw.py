"""The "raw" KV storage format: pages hold K and V in the compute dtype (`RawKVBackend`), the base class
of the other formats (`quantized.py`, `kivi.py`). `backend.py` names every format and builds one
(`make_backend`); this module knows none of them, so imports run one way: backend -> formats -> raw.

Storage per layer is `[num_pages, page_size, num_kv_heads, head_dim]`, addressed by flat slot id
(page * page_size + offset).

Masks come from slot counts in the `AttentionContext` (built by `engine.attention_context`), never from
positions, so a cache whose evicted tokens were compacted away still attends correctly. `attend` runs one
SDPA per attention group (a group is a contiguous token range, or a length bucket of decode rows picked by
`token_rows`); a group's pages are gathered into a workspace kept across layers and steps, except decode
groups of raw pages large enough to spill the caches that continue from the previous step: those read a
dense copy that grows by one slot per row and step (`dense_decode.py`). bfloat16 pages on CPU: decode
groups run the numba paged kernel of `engine/kernels/cpu/decode_attention.py` instead (no gather, no dense copy), and
groups of several queries per row (prefill chunks, verify steps) the AVX512-BF16 kernel of
`engine/kernels/cpu/prefill_attention.py` where the CPU has it. Sparse attention on (`enable_sparse`): every write
also updates the page summaries (`summaries.py`) and decode groups read the pages `sparse.py` chooses.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from engine.attention_context import AttentionContext, AttnGroup
from engine.kernels.cpu import prefill_attention as cpu_prefill_attention
from engine.kernels.cpu.decode_attention import attend_decode_bf16, native_library as native_decode_library
from engine.kernels.cpu.numba_kernels import bits, from_bits
from engine import kernels
from engine.kv_cache.dense_decode import DenseDecode
from engine.kv_cache.spec import KVPageSpec
from engine.kv_cache import sparse as sparse_attention
from engine.kv_cache.sparse import SparseAttentionConfig
from engine.kv_cache.summaries import PageSummaries

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


class RawKVBackend:
    """Pages hold K and V in the compute dtype, unchanged."""

    storage_format = "raw"
    _ws: dict[int, torch.Tensor] | None = None  # gather workspaces (K, V), made on first use
    dense_decode = True  # keep decode groups' K/V dense across steps (raw pages only: see `_dense_for`)
    _dense: DenseDecode | None = None
    _written: tuple | None = None  # (layer, slots, k, v) of the last `write`
    paged_kernel = True  # bf16 on CPU: decode groups by the numba paged kernel (see `_takes_kernel`)
    prefill_kernel = True  # bf16 on CPU: multi-query groups by the native kernel (see `_takes_prefill_kernel`)
    _kernel_dtype = False  # bf16 pools on CPU (set in __init__; formats with their own init keep False)
    summaries: PageSummaries | None = None  # per-page key bounds, only while sparse attention is on
    sparse: SparseAttentionConfig | None = None  # decode groups read the pages `sparse.select` picks
    triton_paged = False  # decode/verify groups by the Triton paged kernel (set in __init__: engine/kernels)
    _sm_count = 4
    scratch_slot: int | None = None

    def __init__(self, spec: KVPageSpec, num_pages: int, device: str | torch.device = "cpu"):
        self.spec = spec
        self.num_pages = num_pages
        dt = torch_dtype(spec.dtype)
        # decode and verify groups read pages in place through the Triton kernel (CUDA; engine/kernels)
        self.triton_paged = kernels.triton_paged_attention(device)
        self._sm_count = kernels.sm_count(torch.device(device))
        # Triton path: one page past the pool, owned by no request: padding rows of a graph step write there
        self.scratch_slot = num_pages * spec.page_size if self.triton_paged else None
        shape = (num_pages + int(self.triton_paged), spec.page_size, spec.num_kv_heads, spec.head_dim)
        # Index by global layer id; layers outside this shard hold None.
        self.k: list[torch.Tensor | None] = [None] * spec.num_layers
        self.v: list[torch.Tensor | None] = [None] * spec.num_layers
        for layer in spec.local_layers:
            self.k[layer] = torch.zeros(shape, dtype=dt, device=device)
            self.v[layer] = torch.zeros(shape, dtype=dt, device=device)
        self._kernel_dtype = dt == torch.bfloat16 and torch.device(device).type == "cpu"
        if self._kernel_dtype:  # build/load the native kernels now, not inside a served request's first step
            cpu_prefill_attention.available()
            native_decode_library()
        self._pool_bits: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # layer -> K, V bits (kernel's views)

    def _flat(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, self.spec.num_kv_heads, self.spec.head_dim)  # [num_slots, kv_heads, head_dim]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_tokens, kv_heads, head_dim]; slots: [num_tokens] flat slot ids."""
        k, v = k.to(self.k[layer].dtype), v.to(self.v[layer].dtype)
        self._flat(self.k[layer]).index_copy_(0, slots, k)
        self._flat(self.v[layer]).index_copy_(0, slots, v)
        self._written = (layer, slots, k, v)  # dense decode copies append these rows (see `attend`)
        if self.summaries is not None:
            self.summaries.update(layer, slots)

    def enable_summaries(self) -> PageSummaries:
        """Keep per-page key bounds from now on (pages written before are not summarised: call first)."""
        if self.summaries is None:
            lay = self.spec.local_layers[0]
            dev = self.k[lay].device
            pages = self.k[lay].shape[0]  # (with the Triton path's scratch page: static steps summarise it too)
            self.summaries = PageSummaries(self.spec, pages, self._summary_dtype(), self._summary_keys, dev)
        return self.summaries

    def _summary_dtype(self) -> torch.dtype:
        return self.k[self.spec.local_layers[0]].dtype

    def _summary_keys(self, layer: int, pages: torch.Tensor) -> torch.Tensor:
        """The keys attention reads of whole pages: [P, page_size, kv_heads, head_dim]."""
        return self.k[layer].index_select(0, pages)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at the given flat slots: each [*slots.shape, kv_heads, head_dim]."""
        flat = slots.reshape(-1)
        k = self._flat(self.k[layer]).index_select(0, flat)
        v = self._flat(self.v[layer]).index_select(0, flat)
        tail = (self.spec.num_kv_heads, self.spec.head_dim)
        return k.view(*slots.shape, *tail), v.view(*slots.shape, *tail)

    def read_pages(self, layer: int, page_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole pages as stored, concatenated per row: page_index [B, P] -> K, V [B, P * page_size,
        kv_heads, cell] (cell = head_dim values for raw pages, the stored bytes for quantized ones)."""
        b, p = page_index.shape
        flat = page_index.reshape(-1)
        shape = (b, p * self.spec.page_size, self.spec.num_kv_heads, self.k[layer].shape[-1])
        return self.k[layer].index_select(0, flat).view(shape), self.v[layer].index_select(0, flat).view(shape)

    def attend(self, layer: int, q: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """q: [num_tokens, q_heads, head_dim] (packed, RoPE applied) -> same shape."""
        dense = self._dense_for()
        if dense is not None and ctx.base is None:  # (a local layers' view keeps no dense copies: it gathers)
            dense.plan(ctx)  # once per step: which decode groups continue their dense copy
        if len(ctx.groups) == 1 and ctx.groups[0].token_rows is None:
            return self._attend_group(layer, q, ctx.groups[0], ctx)
        out = torch.empty_like(q)
        for g in ctx.groups:
            if g.token_rows is None:
                out[g.token_start:g.token_end] = self._attend_group(layer, q[g.token_start:g.token_end], g, ctx)
            else:  # a length bucket of decode rows (attention_context._decode_buckets)
                out.index_copy_(0, g.token_rows, self._attend_group(layer, q.index_select(0, g.token_rows), g, ctx))
        return out

    def _dense_for(self) -> DenseDecode | None:
        """The dense decode copies, for raw pages only: a subclass that overrides `_load` decodes stored
        cells (int8, fp8) and one that overrides `_attend_group` never asks (KIVI seals pages later)."""
        if not self.dense_decode or type(self)._load is not RawKVBackend._load:
            return None
        if (self.paged_kernel and self._kernel_dtype) or self.triton_paged:  # decode reads the pages in place
            self._dense = None  # copies kept while the kernel was switched off would go stale
            return None
        if self._dense is None:
            kt = self.k[self.spec.local_layers[0]]
            cell = (self.spec.num_kv_heads, kt.shape[-1])
            per_slot = 2 * len(self.spec.local_layers) * cell[0] * cell[1] * kt.element_size()
            self._dense = DenseDecode(self.spec.page_size, cell, per_slot, len(self.spec.local_layers))
        return self._dense

    def _load(self, layer: int, g: AttnGroup) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V a group attends to, as stored: [B, ctx, kv_heads, cell] (subclasses decode them). The
        gathered copy lives in a workspace reused by every layer and step: valid until the next `_load`."""
        n = max(g.ctx_lens)
        if g.contiguous_from is not None:  # one sequence on consecutive pages: a view, no gather
            lo = g.contiguous_from
            return self._flat(self.k[layer])[lo:lo + n].unsqueeze(0), self._flat(self.v[layer])[lo:lo + n].unsqueeze(0)
        b, p = g.page_index.shape
        flat = g.page_index.view(-1)
        kt, vt = self.k[layer], self.v[layer]
        shape = (b, p * self.spec.page_size, self.spec.num_kv_heads, kt.shape[-1])
        k = torch.index_select(kt, 0, flat, out=self._workspace(0, flat.numel(), kt)).view(shape)
        v = torch.index_select(vt, 0, flat, out=self._workspace(1, flat.numel(), vt)).view(shape)
        return k[:, :n], v[:, :n]  # [B, ctx, kv_heads, cell]

    def _workspace(self, slot: int, pages: int, like: torch.Tensor) -> torch.Tensor:
        """A [pages, *page shape] buffer for gathered pages, grown as needed and kept. Why: a fresh
        multi-MB tensor per gather is fresh memory from the OS each time (page faults); gathering into a
        kept, cache-warm buffer took ~0.65x the time in an isolated test (batch 16, context 300, bf16)."""
        if self._ws is None:
            self._ws = {}
        per_page = like[0].numel()
        buf = self._ws.get(slot)
        if buf is None or buf.dtype != like.dtype or buf.numel() < pages * per_page:
            buf = self._ws[slot] = torch.empty(pages * per_page, dtype=like.dtype, device=like.device)
        return buf[:pages * per_page].view(pages, *like.shape[1:])

    @property
    def ragged_decode(self) -> bool:
        """Decode groups go to a paged kernel (numba for bf16 CPU pages, Triton on CUDA), which reads the
        cells exactly as stored (formats that store or load otherwise never qualify). Such groups cost no
        padding, so the context builder need not split them into length buckets."""
        cpu = (self.paged_kernel and self._kernel_dtype and self.storage_format == "raw"
               and type(self)._load is RawKVBackend._load and type(self)._attend_group is RawKVBackend._attend_group)
        return cpu or (self.triton_paged and self._triton_cells())

    def _triton_cells(self) -> bool:
        """Whether the Triton kernel reads this pool's cells as stored (raw pages of this class's layout;
        `QuantizedKVBackend` answers for int8)."""
        return self.storage_format == "raw" and type(self)._load is RawKVBackend._load

    def _takes_kernel(self, g: AttnGroup) -> bool:
        """A decode group of a kernel backend, unless observed (eviction statistics come from the SDPA
        path's probabilities) or windowed (the kernel attends every slot below the row's count)."""
        return g.q_len == 1 and g.observe is None and not g.windowed and self.ragged_decode and not self.triton_paged

    def _takes_triton(self, g: AttnGroup, q: torch.Tensor) -> bool:
        """A decode or verify group (q_len x group <= 64 query rows per KV head) of raw or int8 pages on the
        Triton path, neither observed nor windowed (as `_takes_kernel`)."""
        return (self.triton_paged and g.observe is None and not g.windowed and self._triton_cells()
                and g.q_len * (q.shape[1] // self.spec.num_kv_heads) <= 64)

    def _attend_triton(self, layer: int, q: torch.Tensor, g: AttnGroup, scale: float) -> torch.Tensor:
        from engine.kernels.cuda.paged_attention import num_splits, paged_attention

        if not g.splits:
            g.splits = num_splits(g.batch, self.spec.num_kv_heads, max(g.ctx_lens), self._sm_count)
        return paged_attention(q, self.k[layer], self.v[layer], g.page_index, g.device_lens(), scale, g.q_len,
                               g.splits)

    def _takes_prefill_kernel(self, g: AttnGroup, q: torch.Tensor) -> bool:
        """A group of several queries per row (prefill chunk, verify step) of raw bf16 CPU pages, neither
        observed nor windowed (as `_takes_kernel`), where the native kernel runs and takes the shapes."""
        return (g.q_len > 1 and g.observe is None and not g.windowed and self.prefill_kernel
                and self._kernel_dtype and self.storage_format == "raw" and type(self)._load is RawKVBackend._load
                and cpu_prefill_attention.supports(q.shape[-1], q.shape[-2], self.spec.num_kv_heads)
                and cpu_prefill_attention.available())

    def _attend_kernel(self, layer: int, q: torch.Tensor, g: AttnGroup, scale: float, rows=None) -> torch.Tensor:
        """rows: (page table, slot counts) to read instead of the group's (sparse attention's choice)."""
        pools = self._pool_bits.get(layer)
        if pools is None:  # views of the pool tensors, which live as long as the backend
            pools = self._pool_bits[layer] = (bits(self.k[layer]), bits(self.v[layer]))
        return from_bits(attend_decode_bf16(bits(q), *pools, *(rows or g.host_rows()), scale))

    def enable_sparse(self, cfg: SparseAttentionConfig) -> None:
        """Decode groups read only the pages Quest picks from now on (`sparse.py`); call before any write."""
        self.enable_summaries()
        self.sparse = cfg
        self.dense_decode = False  # dense copies hold every slot; a sparse step reads a few pages instead

    def _attend_sparse(self, layer: int, q: torch.Tensor, g: AttnGroup, scale: float) -> torch.Tensor | None:
        """A decode group through the pages sparse attention chooses, or None if it chooses them all."""
        s, plan = self.summaries, g.sparse_plan
        if g.static and g.sparse_rows is None:  # a CUDA-graph step: the choice on the device, fixed shapes
            from engine.kernels.cuda.paged_attention import num_splits, paged_attention
            from engine.kernels.cuda.quest import choose_static

            chosen = choose_static(self.sparse, s.lo[layer], s.hi[layer], q, g.page_index, g.lens,
                                   self.spec.page_size, plan, layer)
            if chosen is None:
                return None
            pages, lens = chosen
            splits = num_splits(g.batch, self.spec.num_kv_heads, pages.shape[-1] * self.spec.page_size,
                                self._sm_count)
            return paged_attention(q, self.k[layer], self.v[layer], pages, lens, scale, 1, splits)
        sel = sparse_attention.choose(self.sparse, g.sparse_rows, s.lo[layer], s.hi[layer], q, g.page_index,
                                      g.ctx_lens, self.spec.page_size, plan, layer)
        if sel is None:
            return None
        if self._takes_kernel(g):  # the chosen pages read in place: a table per row, or per (row, KV head)
            return self._attend_kernel(layer, q, g, scale, sparse_attention.kernel_rows(sel, plan["all_row"]))
        if self.triton_paged and self._triton_cells():  # CUDA: the Triton kernel reads each KV head's pages
            from engine.kernels.cuda.paged_attention import num_splits, paged_attention

            lens = sel.slots.sum(-1).to(torch.int32)  # [B, kv_heads]
            splits = num_splits(g.batch, self.spec.num_kv_heads, sel.pages.shape[-1] * self.spec.page_size,
                                self._sm_count)
            return paged_attention(q, self.k[layer], self.v[layer], sel.pages, lens, scale, 1, splits)
        k, v = self._page_heads(layer, sel.pages)  # [B, kv_heads, S, page_size, head_dim] each
        return sparse_attention.attend_torch(k, v, q, sel, scale)

    def _page_heads(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of page pages[b, h, i] for KV head h: [B, kv_heads, S, page_size, head_dim]."""
        heads = torch.arange(self.spec.num_kv_heads).view(1, -1, 1)
        return self.k[layer][pages, :, heads], self.v[layer][pages, :, heads]

    def _attend_group(self, layer: int, q: torch.Tensor, g: AttnGroup, ctx: AttentionContext) -> torch.Tensor:
        b, ql = g.batch, g.q_len
        if self.sparse is not None and ql == 1 and g.observe is None and not g.windowed:
            out = self._attend_sparse(layer, q, g, ctx.scale)
            if out is not None:
                return out
        if self._takes_kernel(g):
            return self._attend_kernel(layer, q, g, ctx.scale)
        if self._takes_triton(g, q):
            return self._attend_triton(layer, q, g, ctx.scale)
        if self._takes_prefill_kernel(g, q):
            page_index, ctx_lens = g.host_rows()
            out = cpu_prefill_attention.prefill_attention_bf16(q, self.k[layer], self.v[layer], page_index,
                                                               ctx_lens, ql, ctx.scale)
            return out.view(b * ql, *q.shape[1:])
        kv = None
        if self._dense is not None:
            w = self._written  # this layer's new rows, when they are this step's (same slots tensor)
            new = w[2:] if w is not None and w[0] == layer and w[1] is ctx.write_slots else None
            kv = self._dense.load(layer, g, self.k[layer], self.v[layer], new)
        k, v = self._load(layer, g) if kv is None else kv  # [B, ctx, kv_heads, head_dim]
        qh = q.view(b, ql, *q.shape[1:]).transpose(1, 2)  # [B, q_heads, q_len, head_dim]
        kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # [B, kv_heads, ctx, head_dim]
        if g.observe is not None:
            ctx.observe_attention(layer, g, qh, kh)
        heads, kv_heads = q.shape[1], kh.shape[1]
        if ql == 1 and heads != kv_heads and q.device.type == "cuda":
            # Decode under GQA on CUDA: a KV head's query heads become its queries ([B, kv_heads, group,
            # head_dim]; head h reads KV head h // group, as enable_gqa does), the mask broadcasting over
            # them, so masked decode groups run memory-efficient attention (it has no enable_gqa) instead
            # of math (engine/sdpa_backends.py). CPU keeps the enable_gqa call transformers makes.
            o = F.scaled_dot_product_attention(
                q.view(b, kv_heads, heads // kv_heads, q.shape[-1]), kh, vh, attn_mask=g.mask_bias(qh.dtype),
                scale=ctx.scale)
            return o.reshape(b, heads, q.shape[-1])
        o = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=g.mask_bias(qh.dtype), is_causal=g.is_causal, scale=ctx.scale,
            enable_gqa=qh.shape[1] != kh.shape[1],
        )
        return o.transpose(1, 2).reshape(b * ql, *q.shape[1:])

    def copy_tokens_out(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous K and V of the given slots, for shipping: [n, kv_heads, head_dim] each."""
        return self.read(layer, slots)

