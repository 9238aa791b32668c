/* Paged decode attention over bfloat16 KV pages with AVX512-BF16 dot products: one query per sequence,
 * K/V read in place from the pages through the page table (no gather, no repacking).
 *
 * Built and loaded by engine/kernels/cpu/native.py; called by engine/kernels/cpu/decode_attention.py's attend_decode_bf16 where
 * the CPU has AVX512-BF16 and head_dim is 64 (the numba kernel there otherwise).
 * Why: the numba kernel spends most of its time on one horizontal sum per (slot, head) and on output
 * accumulators that do not fit in registers. Here, per sequence and KV head:
 *   scores  for 16 slots at a time: one vdpbf16ps pair per slot and head leaves 16 partial-sum vectors,
 *           summed across lanes together by a shuffle tree (~3 instructions per score instead of ~8)
 *   softmax float32; each probability split into two bf16 parts, hi = bf16(p) and lo = bf16(p - hi), so
 *           the weighted sum sees p to ~16 bits (the numba kernel's float32 precision, finer than torch's
 *           flash kernel, which rounds p to bf16) at two vdpbf16ps per product pair
 *   output  two slots' V rows interleaved into bf16 pairs (unpacklo/hi), vdpbf16ps into accumulators
 *           that stay in registers for up to 4 query heads of the KV head; lanes come out in a permuted
 *           dim order, put back by one permute per 16 dims before the bf16 store
 * Layouts (uint16 = bf16 bits): q [rows][heads][64] contiguous; pools [num_pages][page_size][kv_heads][64];
 * page tables: `tables` per row, 1 (shared by the row's KV heads) or kv_heads (one per KV head: sparse
 * attention's per-KV-head page choice, engine/kv_cache/sparse.py, read in place like the shared one):
 * page_index [rows][tables][page_cols]; ctx_lens [rows][tables] (slots [0, n) of a table attended);
 * out [rows][heads][64]; work: pd_decode_work_bytes(max ctx_len, heads) bytes, 64-byte aligned.
 * Each KV head is read on its own anyway (its 128 bytes of a slot), so a table per KV head costs only
 * the slot offsets, recomputed per KV head instead of per row.
 */
#include "bf16_common.h"

#define DIM 64

static const uint16_t ZERO_ROW[DIM] __attribute__((aligned(64))) = {0};

/* Software prefetch (into L2) of the K / V rows AHEAD slots on. Why: a slot's row of one KV head is 128
 * bytes, and a sparse choice (most of all one per KV head) jumps between scattered pages every 16 slots,
 * too often for the hardware prefetcher to ramp up; the loads then wait on memory one page at a time.
 * Measured (AMD EPYC Zen 4, 8 rows x 74 chosen pages of 16 slots per KV head, 30 layers, shared machine,
 * medians of 7): none 47.0 ms, 16 slots ahead into L1 43.8, 48 into L2 36.5, 96 into L2 36.3. */
#define AHEAD 48
/* The K pass (its first query head of each KV head) prefetches the V rows too, so the K and V misses overlap
 * and the V pass mostly reads L2. Measured (30 layers, 8 rows; AMD EPYC Zen 4, shared machine, medians of 5):
 * per-KV-head sparse tables of 71 pages 43.1 -> 24.9 ms, full tables of 508 scattered pages 223.8 -> 164.7;
 * in the engine at 8k x 8 the default sparse step 85.4 -> 79.1 ms, full (consecutive pages) 202.5 -> 199.6. */
static inline void prefetch_row(const uint16_t *row) {
    _mm_prefetch((const char *)row, _MM_HINT_T1);
    _mm_prefetch((const char *)(row + 32), _MM_HINT_T1);
}

int64_t pd_decode_work_bytes(int64_t max_ctx, int64_t heads) {
    int64_t keys = round_up(max_ctx, 16);
    return keys * 8 + heads * keys * 4 + 2 * heads * keys * 2 + 4 * 64;
}

/* s[t] = scale * q . K[t] for t in [0, keys) (keys a multiple of 16; slots >= n read a zero row) */
static void scores(const uint16_t *qh, const uint16_t *k_pool, const uint16_t *v_ahead, const int64_t *slot_off,
                   int64_t n, int64_t keys, int64_t g_off, float scale, float *s) {
    __m512bh q0 = (__m512bh)_mm512_loadu_si512((const void *)qh);
    __m512bh q1 = (__m512bh)_mm512_loadu_si512((const void *)(qh + 32));
    __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t t0 = 0; t0 < keys; t0 += 16) {
        __m512 a[16];
        for (int64_t t = t0 + AHEAD; t < t0 + AHEAD + 16 && t < n; t++) {
            prefetch_row(k_pool + slot_off[t] + g_off);
            if (v_ahead) prefetch_row(v_ahead + slot_off[t] + g_off);
        }
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++) {
            const uint16_t *k = t0 + j < n ? k_pool + slot_off[t0 + j] + g_off : ZERO_ROW;
            __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), q0, (__m512bh)_mm512_loadu_si512((const void *)k));
            a[j] = _mm512_dpbf16_ps(acc, q1, (__m512bh)_mm512_loadu_si512((const void *)(k + 32)));
        }
        _mm512_store_ps(s + t0, _mm512_mul_ps(sum_lanes16(a), vscale));
    }
}

/* Softmax over slots [0, n) of s (keys a multiple of 16): the float32 probabilities as hi + lo bf16 parts,
 * zero on [n, keys); returns 1 / their sum. */
static float softmax_split(const float *s, int64_t n, int64_t keys, uint16_t *hi, uint16_t *lo) {
    __m512 m = _mm512_set1_ps(-__builtin_inff());
    for (int64_t j = 0; j < keys; j += 16) {
        __mmask16 live = j + 16 <= n ? 0xFFFF : (j < n ? (__mmask16)((1u << (n - j)) - 1) : 0);
        m = _mm512_mask_max_ps(m, live, m, _mm512_load_ps(s + j));
    }
    __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(m)), sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys; j += 16) {
        __mmask16 live = j + 16 <= n ? 0xFFFF : (j < n ? (__mmask16)((1u << (n - j)) - 1) : 0);
        __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_load_ps(s + j), vmax)));
        sum = _mm512_add_ps(sum, e);
        __m256i h = (__m256i)_mm512_cvtneps_pbh(e);
        __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        _mm256_storeu_si256((__m256i *)(hi + j), h);
        _mm256_storeu_si256((__m256i *)(lo + j), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(e, back)));
    }
    return 1.0f / _mm512_reduce_add_ps(sum);
}

/* out[h] for NH query heads of one KV head: sum over slot pairs of P[h] * V, times inv[h] */
static inline __attribute__((always_inline)) void weighted_sum(
        int NH, const uint16_t *const *prob, const uint16_t *const *prob_lo, const uint16_t *v_pool, const int64_t *slot_off, int64_t n,
        int64_t g_off, const float *inv, uint16_t *const *out) {
    __m512 acc[4][4];
    for (int h = 0; h < NH; h++)
        for (int k = 0; k < 4; k++) acc[h][k] = _mm512_setzero_ps();
    for (int64_t m = 0; 2 * m < n; m++) {
        if (2 * m + AHEAD + 1 < n) {
            prefetch_row(v_pool + slot_off[2 * m + AHEAD] + g_off);
            prefetch_row(v_pool + slot_off[2 * m + AHEAD + 1] + g_off);
        }
        const uint16_t *va = v_pool + slot_off[2 * m] + g_off;
        const uint16_t *vb = 2 * m + 1 < n ? v_pool + slot_off[2 * m + 1] + g_off : ZERO_ROW;
        __m512i a0 = _mm512_loadu_si512((const void *)va), a1 = _mm512_loadu_si512((const void *)(va + 32));
        __m512i b0 = _mm512_loadu_si512((const void *)vb), b1 = _mm512_loadu_si512((const void *)(vb + 32));
        __m512bh x[4] = {(__m512bh)_mm512_unpacklo_epi16(a0, b0), (__m512bh)_mm512_unpackhi_epi16(a0, b0),
                         (__m512bh)_mm512_unpacklo_epi16(a1, b1), (__m512bh)_mm512_unpackhi_epi16(a1, b1)};
        for (int h = 0; h < NH; h++) {
            __m512bh pp = (__m512bh)_mm512_set1_epi32(((const int32_t *)prob[h])[m]);
            __m512bh pl = (__m512bh)_mm512_set1_epi32(((const int32_t *)prob_lo[h])[m]);
            for (int k = 0; k < 4; k++) acc[h][k] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[h][k], pp, x[k]), pl, x[k]);
        }
    }
    /* acc[.][0] lane 4L+i holds dim 8L+i, acc[.][1] dim 8L+4+i (i < 4); [2], [3] the same for dims 32.. */
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int h = 0; h < NH; h++) {
        __m512 w = _mm512_set1_ps(inv[h]);
        for (int k = 0; k < 4; k += 2) {
            __m512 d0 = _mm512_permutex2var_ps(acc[h][k], lo, acc[h][k + 1]);
            __m512 d1 = _mm512_permutex2var_ps(acc[h][k], hi, acc[h][k + 1]);
            _mm256_storeu_si256((__m256i *)(out[h] + k * 16), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(d0, w)));
            _mm256_storeu_si256((__m256i *)(out[h] + k * 16 + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(d1, w)));
        }
    }
}

void pd_decode_attention_bf16(const uint16_t *q, const uint16_t *k_pool, const uint16_t *v_pool,
                              int64_t page_size, const int64_t *page_index, int64_t page_cols,
                              const int64_t *ctx_lens, int64_t tables, int64_t rows, int64_t heads,
                              int64_t kv_heads, float scale, uint16_t *out, void *work) {
    int64_t group = heads / kv_heads, max_ctx = 1;
    for (int64_t i = 0; i < rows * tables; i++) max_ctx = ctx_lens[i] > max_ctx ? ctx_lens[i] : max_ctx;
    int64_t stride = round_up(max_ctx, 16);
    uint8_t *w = (uint8_t *)work;
    int64_t *slot_off = (int64_t *)w; w += round_up(stride * 8, 64);
    float *s = (float *)w; w += round_up(heads * stride * 4, 64);
    uint16_t *prob = (uint16_t *)w; w += round_up(heads * stride * 2, 64);
    uint16_t *prob_lo = (uint16_t *)w;
    for (int64_t b = 0; b < rows; b++) {
        int64_t n = 0, keys = 0;
        for (int64_t g = 0; g < kv_heads; g++) {
            if (g == 0 || tables > 1) {  /* this KV head's table: element offset of slot t's row in a pool */
                int64_t tab = b * tables + (tables > 1 ? g : 0);
                const int64_t *pages = page_index + tab * page_cols;
                n = ctx_lens[tab];
                keys = round_up(n, 16);
                for (int64_t t = 0; t < n; t++)
                    slot_off[t] = (pages[t / page_size] * page_size + t % page_size) * kv_heads * DIM;
            }
            for (int64_t t = 0; t < AHEAD && t < n; t++) {  /* the first rows, which the loops' prefetch skips */
                prefetch_row(k_pool + slot_off[t] + g * DIM);
                prefetch_row(v_pool + slot_off[t] + g * DIM);
            }
            float inv[4];
            for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += 4) {
                int nh = (int)((g + 1) * group - h0 < 4 ? (g + 1) * group - h0 : 4);
                const uint16_t *pr[4], *pl[4];
                uint16_t *dst[4];
                for (int i = 0; i < nh; i++) {
                    int64_t h = h0 + i;
                    scores(q + (b * heads + h) * DIM, k_pool, h == g * group ? v_pool : NULL, slot_off, n, keys, g * DIM,
                           scale, s + h * stride);
                    pr[i] = prob + h * stride;
                    pl[i] = prob_lo + h * stride;
                    inv[i] = softmax_split(s + h * stride, n, keys, (uint16_t *)pr[i], (uint16_t *)pl[i]);
                    dst[i] = out + (b * heads + h) * DIM;
                }
                switch (nh) {  /* a constant head count per call: the accumulators stay in registers */
                    case 1: weighted_sum(1, pr, pl, v_pool, slot_off, n, g * DIM, inv, dst); break;
                    case 2: weighted_sum(2, pr, pl, v_pool, slot_off, n, g * DIM, inv, dst); break;
                    case 3: weighted_sum(3, pr, pl, v_pool, slot_off, n, g * DIM, inv, dst); break;
                    default: weighted_sum(4, pr, pl, v_pool, slot_off, n, g * DIM, inv, dst); break;
                }
            }
        }
    }
}
