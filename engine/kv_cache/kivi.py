"""KIVI-style 4-bit KV pages ("kivi4"): keys per channel over a page, values per token, the unsealed
page of a sequence in full precision.

Who uses it: `backend.make_backend` picks `KIVIBackend` for a `KVPageSpec` with storage_format "kivi4";
the model sees the usual `write` / `attend`. `page_io` ships its cells unchanged (wire = storage), and
the engine's page allocator tells it when a page stops being held (`release_pages`).

Groups are pages. KIVI quantizes keys per channel over a group of tokens (keys have outlier channels)
and values per token (here per token, head and group of 32 channels); the key group is one page
(page_size tokens), so a page is quantized ("sealed") exactly when its last slot is written. Until then
its tokens live in a full-precision *staging* copy.
Read rule (what makes output a function of the tokens, not of batching): a query at position i reads
every slot of the pages before its own page from the quantized cells and the slots of its own page
(page i // page_size, up to i) from staging. Prefill in one step or in chunks, decode, and a 1 + k
verify step therefore see the same numbers: speculative output equals non-speculative output. The
full-precision tail is at most page_size - 1 tokens (15 at the default 16; the issue's gate allows 128).
A sliding window (Mistral, Gemma 3's local layers: a group marked `windowed`) applies to both parts
through the group's mask, by each column's position.

Cell layout (one (token, head) cell, K and V the same size: `spec.kivi_cell_bytes`), so pages stay
fixed-size and token-addressed and the wire format is the storage format:
    K cell: [head_dim/2 packed nibbles | a bytes of the page's key metadata | pad]
    V cell: [head_dim/2 packed nibbles | value scale, zero per 32-channel group (float16) | b bytes of
             key metadata | pad]
The page's key metadata (per head: scale and zero, float16, per channel = 4 * head_dim bytes) is cut
into page_size rows of m = 4 * head_dim / page_size bytes, row t stored in token t's cells (a in K,
b = m - a in V). Why spread it rather than keep a per-page side tensor: page_io, prefix sharing and
the transfer layer all move token rows of `backend.k/v` (and size them by `token_head_bytes`); a side
tensor would need every one of them taught about it, and a page would no longer be one fixed block. The price: a token range only means the same bytes
between pools of one page size, so kivi4 puts page_size into the layout signature (a transfer
between different page sizes is refused as a layout mismatch).

Staging: per layer `[n_staged, page_size, kv_heads, head_dim]` in the compute dtype, unrotated (what a
raw page would hold), indexed through `stage_of[page]`. A page gets a staging row on its first write;
the row is kept after sealing while the page can still be rewritten (draft-verify rolls back into
pages it filled in the same step: a rewrite unseals the page, and its last slot reseals it from the
exact staging content) and released when it cannot: (a) at attend, for pages wholly below a
sequence's cached slots (a rollback never goes below the slots present before the step), (b) when the
allocator reports the page no longer held (finished, aborted, freed, or left to the prefix cache), (c)
a write at offset 0 reuses the page's row. Rows are keyed by page, so there are never more than
num_pages; the tensors grow on demand (doubling), so memory is the high-water mark of live pages.

Rotation and value groups, measured (SmolLM2 bf16, 2,048 prefill + 512 scored, chunks of 128, change vs
raw pages on four held-out windows of the bench text -- offsets 0/3000/6000/9000 -- as mean / worst):
    value group 64, no rotation      +0.46% / +0.94%      group 64, keys rotated    +0.85% / +1.12%
    value group 32, no rotation      +0.39% / +0.72%      group 32, keys rotated    +0.48% / +0.80%
    value group 64, values rotated   +0.37% / +0.98%      group 16, no rotation     +0.28% / +1.05%
One window alone moves by several tenths of a percent between neighbouring settings (the error is small
and its effect on one text's perplexity is not monotone), so the choice rests on the four together:
value groups of 32 channels (`spec.KIVI_VALUE_GROUP`, as in KIVI), no Hadamard rotation (the knobs stay
for measuring: with ROTATE_K/V on, attention runs in the rotated space as in `quantized.py`). Keys
quantized per channel already give each outlier channel its own grid, which is what rotation buys int8.

Quantize (4 bits, asymmetric): zero = min, scale = (max - min) / 15, both rounded to float16 first;
q = round((x - zero) / scale) clamped to [0, 15]; dequantize q * scale + zero in float32.
Transfer (prefill -> decode): sealed pages travel as stored and the decode side marks them sealed
(`page_io.import_kv`), so shipped KV equals local KV bit for bit; the sender publishes only up to the last
sealed page (a chunk ending inside a page leaves that page for a later step). A prompt ending inside a
page leaves its tail (< page_size tokens, `shipped_tokens`) behind: the decode side recomputes it over
the received pages, in its first step, together with the first token (`LLM.add_prefilled_request(...,
num_computed=)`; the receiver expects only the sealed tokens). Why recompute rather than ship the tail's
full-precision staging: the wire carries one fixed-size cell per (token, head) (`token_head_bytes`), and a
staging row (head_dim values in the compute dtype) is ~3x a kivi4 cell -- shipping it would need a second
chunk kind in the codec and receiver; recomputing needs no wire change, is at most page_size - 1 tokens
of work folded into a step the decode worker runs anyway, and is exact by the read rule above: the tail's
queries read the pages before theirs from the same (shipped, bit-equal) cells and their own page from
staging, whether computed on the prefill side or here. `page_io.export_kv` of an unsealed page still
raises KVFormatError. Not supported: eviction (compaction would move cells across key groups; LLM and the
YAML refuse it) and tensor/pipeline parallelism (rank processes have no allocator hook).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention_context import AttentionContext, AttnGroup
from engine.kv_cache.quantized import hadamard
from engine.kv_cache.raw import RawKVBackend, torch_dtype
from engine.kv_cache import spec as spec_mod
from engine.kv_cache.spec import KVPageSpec

_TINY = 2.0 ** -14  # smallest normal float16 step: constant rows keep a usable scale
ROTATE_K, ROTATE_V = False, False  # see the module map (measured there)


class KVFormatError(ValueError):
    """KV cannot move in this storage format as asked (e.g. an unsealed kivi4 page)."""


def shipped_tokens(spec: KVPageSpec, num_tokens: int) -> int:
    """Prompt tokens whose KV crosses the wire: all of them, or for kivi4 the sealed (whole) pages only;
    the decode side recomputes the rest (module map, "Transfer")."""
    return num_tokens - num_tokens % spec.page_size if spec.storage_format == "kivi4" else num_tokens


def _layout(hd: int, ps: int) -> tuple[int, int, int, int]:
    """(cell bytes, key-metadata bytes in the K cell, in the V cell, value-metadata bytes): `spec.kivi_layout`."""
    return spec_mod.kivi_layout(hd, ps)


def _value_group(hd: int) -> int:
    return min(hd, spec_mod.KIVI_VALUE_GROUP)


def _pack(q: torch.Tensor) -> torch.Tensor:
    """q uint8 in [0, 15], [..., hd] -> [..., hd / 2] (even channel low nibble, odd channel high)."""
    return q[..., 0::2] | (q[..., 1::2] << 4)


def _unpack(b: torch.Tensor) -> torch.Tensor:
    """[..., hd / 2] uint8 -> [..., hd] float32 in [0, 15]."""
    return torch.stack([b & 15, b >> 4], dim=-1).flatten(-2).float()


def _quant(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit along `dim`: (q uint8 like x, scale, zero float16 with `dim` kept as size 1)."""
    mn, mx = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = ((mx - mn) / 15).clamp_min(_TINY).half()
    zero = mn.half()
    q = ((x - zero.float()) / scale.float()).round_().clamp_(0, 15).to(torch.uint8)
    return q, scale, zero


def quantize_pages(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full pages k, v float [P, ps, H, hd] -> K, V cells uint8 [P, ps, H, cell] (layout: module map)."""
    p, ps, h, hd = k.shape
    cell, a, b, vm = _layout(hd, ps)
    g = _value_group(hd)
    qk, ks, kz = _quant(k.float(), 1)  # per channel over the page's tokens: ks, kz [P, 1, H, hd]
    kmeta = torch.stack([ks, kz], 2).view(torch.uint8)  # [P, 1, 2, H, hd] float16 -> bytes [P, 1, 2, H, 2hd]
    kmeta = kmeta.permute(0, 3, 1, 2, 4).reshape(p, h, ps, -1).transpose(1, 2)  # [P, ps, H, m]: row t's share
    qv, vs, vz = _quant(v.float().view(p, ps, h, hd // g, g), 4)  # per token, head, group: vs, vz [P, ps, H, G, 1]
    qv = qv.view(p, ps, h, hd)
    vmeta = torch.cat([vs, vz], -1).view(p, ps, h, 2 * hd // g).view(torch.uint8)  # [P, ps, H, vm]
    kc = torch.zeros(p, ps, h, cell, dtype=torch.uint8, device=k.device)
    vc = torch.zeros_like(kc)
    kc[..., :hd // 2], kc[..., hd // 2:hd // 2 + a] = _pack(qk), kmeta[..., :a]
    vc[..., :hd // 2], vc[..., hd // 2:hd // 2 + vm] = _pack(qv), vmeta
    vc[..., hd // 2 + vm:hd // 2 + vm + b] = kmeta[..., a:]
    return kc, vc


def dequantize_pages(kc: torch.Tensor, vc: torch.Tensor, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V cells uint8 [P, ps, H, cell] -> k, v float32 [P, ps, H, hd] (in the stored, rotated space)."""
    p, ps, h, _ = kc.shape
    _, a, b, vm = _layout(hd, ps)
    half, g = hd // 2, _value_group(hd)
    kmeta = torch.cat([kc[..., half:half + a], vc[..., half + vm:half + vm + b]], -1)  # [P, ps, H, m]
    kmeta = kmeta.transpose(1, 2).reshape(p, h, 2, 2 * hd).contiguous().view(torch.float16)  # [P, H, 2, hd]
    ks, kz = kmeta[:, :, 0].float().unsqueeze(1), kmeta[:, :, 1].float().unsqueeze(1)  # [P, 1, H, hd]
    vmeta = vc[..., half:half + vm].contiguous().view(torch.float16).float().view(p, ps, h, hd // g, 2)
    k = _unpack(kc[..., :half]) * ks + kz
    v = _unpack(vc[..., :half]).view(p, ps, h, hd // g, g) * vmeta[..., :1] + vmeta[..., 1:]  # [P, ps, H, G, g]
    return k, v.view(p, ps, h, hd)


class KIVIBackend(RawKVBackend):
    """Sealed pages hold 4-bit cells; pages being filled live in a full-precision staging copy."""

    storage_format = "kivi4"

    def __init__(self, spec: KVPageSpec, num_pages: int, device: str | torch.device = "cpu"):
        assert spec.storage_format == "kivi4", spec.storage_format
        self.spec, self.num_pages, self.device = spec, num_pages, torch.device(device)
        self.compute_dtype = torch_dtype(spec.dtype)
        self.h = hadamard(spec.head_dim).to(device)
        cell = _layout(spec.head_dim, spec.page_size)[0]
        shape = (num_pages, spec.page_size, spec.num_kv_heads, cell)
        self.k: list[torch.Tensor | None] = [None] * spec.num_layers
        self.v: list[torch.Tensor | None] = [None] * spec.num_layers
        self.sk: list[torch.Tensor | None] = [None] * spec.num_layers  # staging [rows, ps, H, hd]
        self.sv: list[torch.Tensor | None] = [None] * spec.num_layers
        for layer in spec.local_layers:
            self.k[layer] = torch.zeros(shape, dtype=torch.uint8, device=device)
            self.v[layer] = torch.zeros(shape, dtype=torch.uint8, device=device)
        self.stage_of = torch.full((num_pages,), -1, dtype=torch.long, device=device)  # page -> staging row
        self.sealed = torch.zeros(num_pages, dtype=torch.bool, device=device)  # quantized cells are current
        self._free_rows: list[int] = []
        self._rows = 0  # staging rows allocated so far (high-water mark)
        self.num_reopened = 0  # sealed pages rewritten from inside (draft-verify rollback), for tests
        self._grow(8)

    # ---- staging rows ------------------------------------------------------------------------
    @property
    def num_staged(self) -> int:
        """Pages holding a staging row now (0 when nothing is in flight: the leak check)."""
        return int((self.stage_of >= 0).sum())

    @property
    def staging_rows(self) -> int:
        return self._rows

    def _grow(self, rows: int) -> None:
        s = self.spec
        for layer in s.local_layers:
            for pool in (self.sk, self.sv):
                extra = torch.zeros(rows, s.page_size, s.num_kv_heads, s.head_dim, dtype=self.compute_dtype,
                                    device=self.device)
                pool[layer] = extra if pool[layer] is None else torch.cat([pool[layer], extra])
        self._free_rows.extend(range(self._rows + rows - 1, self._rows - 1, -1))
        self._rows += rows

    def _stage(self, pages: torch.Tensor, offs: torch.Tensor) -> None:
        """Give every page in `pages` without one a staging row (rows keyed by page: <= num_pages)."""
        new = pages[self.stage_of[pages] < 0].unique().tolist()
        # a page without a row must be filled from its first slot: its earlier tokens exist nowhere else
        assert set(new) <= set(pages[offs == 0].tolist()), f"kivi4: write inside unstaged pages {new}"
        need = len(new) - len(self._free_rows)
        if need > 0:  # double, but never past one row per page (live rows are keyed by page)
            self._grow(max(need, min(self._rows, self.num_pages - self._rows)))
        for page in new:
            self.stage_of[page] = self._free_rows.pop()

    def enable_summaries(self):
        raise KVFormatError("sparse attention needs page summaries, which kivi4 pages do not keep (a page's "
                            "keys live in full-precision staging until it seals); use raw, int8 or fp8 pages")

    def release_pages(self, pages) -> None:
        """Drop the staging rows of pages nobody can write any more (allocator hook, attend, tests)."""
        for page in pages:
            row = int(self.stage_of[page])
            if row >= 0:
                self.stage_of[page] = -1
                self._free_rows.append(row)

    def mark_imported(self, pages) -> None:
        """Pages whose sealed cells arrived over the wire (`page_io.import_kv`): read from cells."""
        self.release_pages(pages)
        self.sealed[torch.as_tensor(list(pages), dtype=torch.long)] = True

    # ---- write / read ------------------------------------------------------------------------
    def _rot(self, x: torch.Tensor, on: bool, inverse: bool = False) -> torch.Tensor:
        if not on:
            return x.float()
        return x.float() @ (self.h.T if inverse else self.h)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [num_tokens, kv_heads, head_dim] -> staging; pages whose last slot is written seal."""
        ps = self.spec.page_size
        pages, offs = slots // ps, slots % ps  # [num_tokens]
        if layer == self.spec.layer_start:  # once per step: rows and seal flags for every layer
            self._stage(pages, offs)
            reopened = pages[(offs != 0) & self.sealed[pages]].unique()  # a rollback rewriting a sealed page
            self.num_reopened += reopened.numel()
            self.sealed[pages] = False
        rows = self.stage_of[pages] * ps + offs  # [num_tokens] flat staging slot
        tail = (self.spec.num_kv_heads, self.spec.head_dim)
        self.sk[layer].view(-1, *tail).index_copy_(0, rows, k.to(self.compute_dtype))
        self.sv[layer].view(-1, *tail).index_copy_(0, rows, v.to(self.compute_dtype))
        full = pages[offs == ps - 1]  # [n_full] pages whose last slot this step wrote: now complete
        if full.numel():
            st = self.stage_of[full]
            kc, vc = quantize_pages(self._rot(self.sk[layer][st], ROTATE_K), self._rot(self.sv[layer][st], ROTATE_V))
            self.k[layer].index_copy_(0, full, kc)
            self.v[layer].index_copy_(0, full, vc)
            if layer == self.spec.layer_start:
                self.sealed[full] = True

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as attention reads them at the end of a sequence: sealed pages dequantized (unrotated),
        unsealed ones from staging. Each [*slots.shape, kv_heads, head_dim] in the compute dtype."""
        ps, flat = self.spec.page_size, slots.reshape(-1)
        pages = flat // ps
        k, v = dequantize_pages(self.k[layer][pages], self.v[layer][pages], self.spec.head_dim)  # [n, ps, H, hd]
        ar = torch.arange(len(flat))
        k = self._rot(k[ar, flat % ps], ROTATE_K, inverse=True)
        v = self._rot(v[ar, flat % ps], ROTATE_V, inverse=True)
        staged = ~self.sealed[pages]
        if staged.any():
            rows = self.stage_of[pages[staged]] * ps + flat[staged] % ps
            assert bool((self.stage_of[pages[staged]] >= 0).all()), "an unsealed page without staging"
            k[staged] = self.sk[layer].view(-1, *k.shape[1:])[rows].float()
            v[staged] = self.sv[layer].view(-1, *v.shape[1:])[rows].float()
        tail = (self.spec.num_kv_heads, self.spec.head_dim)
        dt = self.compute_dtype
        return k.to(dt).view(*slots.shape, *tail), v.to(dt).view(*slots.shape, *tail)

    def copy_tokens_out(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read(layer, slots)

    # ---- attention ---------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        if layer == self.spec.layer_start:
            self._release_final(ctx)
        return super().attend(layer, q, ctx)

    def _release_final(self, ctx: AttentionContext) -> None:
        """Pages wholly below a sequence's cached slots are final (rollback stops at the cached slots)."""
        ps = self.spec.page_size
        for g in ctx.groups:
            for row, n in enumerate(g.ctx_lens):
                done = g.page_index[row, :(n - g.q_len) // ps]
                done = done[self.stage_of[done] >= 0]
                if done.numel():
                    assert bool(self.sealed[done].all()), "a final page that never sealed"
                    self.release_pages(done.tolist())

    def _attend_group(self, layer: int, q: torch.Tensor, g: AttnGroup, ctx: AttentionContext) -> torch.Tensor:
        """Keys/values = dequantized pages (all context) ++ the staging copies of the pages the queries sit
        in; the mask lets query i see full pages before its own page and its own page's staging up to i."""
        assert g.observe is None, "kivi4 pages cannot be observed for eviction"
        s, ps, b, ql = self.spec, self.spec.page_size, g.batch, g.q_len
        n, np_ = max(g.ctx_lens), g.page_index.shape[1]
        kc = self.k[layer].index_select(0, g.page_index.reshape(-1))  # [B * pages, ps, H, cell]
        vc = self.v[layer].index_select(0, g.page_index.reshape(-1))
        k, v = dequantize_pages(kc, vc, s.head_dim)  # [B * pages, ps, H, hd], rotated space
        k, v = k.view(b, np_ * ps, *k.shape[2:])[:, :n], v.view(b, np_ * ps, *v.shape[2:])[:, :n]
        cached = torch.tensor([c - ql for c in g.ctx_lens], device=q.device)  # [B]
        first = cached // ps  # [B] page (within the sequence) of the step's first query
        ext = (torch.tensor(g.ctx_lens, device=q.device) - 1) // ps - first + 1  # [B] pages holding queries
        e = int(ext.max())
        col = (first.view(b, 1) + torch.arange(e, device=q.device).view(1, e)).clamp_max(np_ - 1)  # [B, E]
        rows = self.stage_of[g.page_index.gather(1, col)].clamp_min(0)  # [B, E] (padding rows: masked)
        ek = self._rot(self.sk[layer][rows.view(-1)], ROTATE_K).view(b, e * ps, *k.shape[2:])
        ev = self._rot(self.sv[layer][rows.view(-1)], ROTATE_V).view(b, e * ps, *v.shape[2:])
        kk = torch.cat([k, ek], 1).to(self.compute_dtype)  # [B, n + E * ps, H, hd]
        vv = torch.cat([v, ev], 1).to(self.compute_dtype)
        mask = self._mask(cached, first, ql, n, e, g)  # [B, 1, q_len, n + E * ps]
        qh = q.view(b, ql, *q.shape[1:])
        qh = (self._rot(qh, ROTATE_K).to(q.dtype) if ROTATE_K else qh).transpose(1, 2)  # [B, Hq, q_len, hd]
        o = F.scaled_dot_product_attention(qh, kk.transpose(1, 2), vv.transpose(1, 2), attn_mask=mask,
                                           scale=ctx.scale, enable_gqa=qh.shape[1] != kk.shape[2])
        o = o.transpose(1, 2).reshape(b * ql, *q.shape[1:])
        return self._rot(o, ROTATE_V, inverse=True).to(q.dtype) if ROTATE_V else o

    def _mask(self, cached: torch.Tensor, first: torch.Tensor, ql: int, n: int, e: int, g: AttnGroup
              ) -> torch.Tensor:
        ps, b, dev = self.spec.page_size, len(cached), cached.device
        pos = cached.view(b, 1) + torch.arange(ql, device=dev).view(1, ql)  # [B, q_len] query positions
        own = pos // ps  # [B, q_len] each query's own page
        main = torch.arange(n, device=dev).view(1, 1, n) < (own * ps).unsqueeze(-1)  # [B, q_len, n]
        j = torch.arange(e * ps, device=dev).view(1, 1, e * ps)
        ext = (j // ps == (own - first.view(b, 1)).unsqueeze(-1)) & (j % ps <= (pos % ps).unsqueeze(-1))
        if g.windowed:  # a sliding window (Mistral, Gemma 3's local layers): the group's mask says which
            # positions a query may still see; the staging columns stand for positions of the queries' pages
            t = (first.view(b, 1) * ps + j.view(1, -1)).clamp_max(n - 1)  # [B, E * ps] their positions
            seen = g.mask[:, 0]  # [B, q_len, n]
            main &= seen
            ext &= seen.gather(2, t.unsqueeze(1).expand(b, ql, e * ps))
        return torch.cat([main, ext], -1).unsqueeze(1)  # [B, 1, q_len, n + E * ps]

