/* Paged multi-query attention over bfloat16 KV pages with AVX512-BF16 dot products (prefill chunks and
 * verify steps: q_len > 1 queries per sequence, causal from each sequence's cached slots).
 *
 * Built and loaded by engine/kernels/cpu/native.py (gcc, ctypes); called through engine/kernels/cpu/prefill_attention.py.
 * Why: torch's CPU flash attention runs a 512-token SmolLM2 prompt's attention at ~35 GFLOP/s on a core
 * without AMX (~30% of the prefill step); vdpbf16ps does 32 bf16 products with float32 sums per
 * instruction. Per sequence and KV head the K/V pages are repacked once into the pair-interleaved
 * layouts the instruction wants, then for each query head and block of 16 query rows:
 *   scores  S[16][keys] = (q . k) * scale    16 accumulators (one per row), lanes = 16 keys
 *   softmax P = exp(S - rowmax) (float32 sums, P rounded to bf16 as torch's flash kernel does)
 *   output  O[r][d] = sum_k P[r][k] V[k][d] / sum_k P[r][k]   lanes = 16 head dims, 4 rows at a time
 * Row i of a sequence with n = ctx_len slots and q_len queries sees slots [0, n - q_len + i] (the same
 * rule as engine/attention_context.py's masks). Keys and values past a row's limit never contribute.
 *
 * Layouts (uint16 = bf16 bits):
 *   q     [tokens][heads][dim], token stride q_stride elements (heads and dims contiguous)
 *   pools [num_pages][page_size][kv_heads][dim]; page_index [rows][page_cols]; ctx_lens [rows]
 *   out   [tokens][heads][dim] contiguous; tokens = rows * q_len, packed row by row
 *   work  scratch of pd_prefill_work_bytes(max ctx_len, kv_heads, dim) bytes, 64-byte aligned
 * dim must be a multiple of 64.
 */
#include "bf16_common.h"

#define ROWS 16 /* query rows per block */
#define PV_ROWS 4 /* rows whose output accumulators are live at once in the weighted sum */

int64_t pd_prefill_work_bytes(int64_t max_ctx, int64_t kv_heads, int64_t dim) {
    int64_t keys = round_up(max_ctx, 16);
    int64_t kv = 2 * keys * kv_heads * dim * 2; /* repacked K and V */
    int64_t s = ROWS * keys * 4 + ROWS * keys * 2; /* scores (float32) and probabilities (bf16) */
    int64_t q = ROWS * dim * 2;
    return kv + s + q + 4 * 64;
}

/* K of every KV head of one sequence -> kt[g][tile][pair p][lane][2]: one zmm = pair p of 16 keys.
 * V -> vt[g][key pair m][d][2]: one zmm = 16 head dims of two consecutive keys. Padding keys are 0. */
static void repack(const uint16_t *k_pool, const uint16_t *v_pool, const int64_t *pages, int64_t page_size,
                   int64_t kv_heads, int64_t dim, int64_t n, uint32_t *kt, uint16_t *vt) {
    int64_t keys = round_up(n, 16), half = dim / 2;
    for (int64_t j = 0; j < keys; j++) {
        int64_t tile = j / 16, lane = j % 16;
        const uint16_t *ks = NULL, *vs = NULL;
        if (j < n) {
            int64_t slot = pages[j / page_size] * page_size + j % page_size;
            ks = k_pool + slot * kv_heads * dim;
            vs = v_pool + slot * kv_heads * dim;
        }
        for (int64_t g = 0; g < kv_heads; g++) {
            uint32_t *kd = kt + g * keys * half + tile * half * 16 + lane;
            uint16_t *vd = vt + (g * keys + (j & ~(int64_t)1)) * dim + (j & 1);
            if (ks) {
                const uint32_t *k32 = (const uint32_t *)(ks + g * dim);
                const uint16_t *v16 = vs + g * dim;
                for (int64_t p = 0; p < half; p++) kd[p * 16] = k32[p];
                for (int64_t d = 0; d < dim; d++) vd[2 * d] = v16[d];
            } else {
                for (int64_t p = 0; p < half; p++) kd[p * 16] = 0;
                for (int64_t d = 0; d < dim; d++) vd[2 * d] = 0;
            }
        }
    }
}

/* S[r][0, keys) = scale * q_r . k for 16 query rows (qb: [ROWS][dim] bf16, padding rows zero). */
static void scores16(const uint16_t *qb, const uint32_t *kt, int64_t dim, int64_t keys, float scale,
                     float *s, int64_t s_stride) {
    const int32_t *q32 = (const int32_t *)qb;
    int64_t half = dim / 2;
    __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t tile = 0; tile < keys / 16; tile++) {
        __m512 acc[ROWS];
#pragma GCC unroll 16
        for (int r = 0; r < ROWS; r++) acc[r] = _mm512_setzero_ps();
        const uint32_t *kp = kt + tile * half * 16;
        for (int64_t p = 0; p < half; p++) {
            __m512bh kv = (__m512bh)_mm512_load_si512((const void *)(kp + p * 16));
#pragma GCC unroll 16
            for (int r = 0; r < ROWS; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(q32[r * half + p]), kv);
        }
#pragma GCC unroll 16
        for (int r = 0; r < ROWS; r++) _mm512_store_ps(s + r * s_stride + tile * 16, _mm512_mul_ps(acc[r], vscale));
    }
}

/* out rows r0..r0+PV_ROWS of one head: sum over key pairs of P[r] * V, divided by the row sums. */
static void weighted_sum4(const uint16_t *prob, int64_t p_stride, const uint16_t *vt, int64_t dim,
                          int64_t pairs, const float *inv, uint16_t **out_rows) {
    for (int64_t c0 = 0; c0 < dim; c0 += 64) {
        __m512 acc[PV_ROWS][4];
#pragma GCC unroll 4
        for (int r = 0; r < PV_ROWS; r++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
        for (int64_t m = 0; m < pairs; m++) {
            const uint16_t *vp = vt + m * dim * 2 + c0 * 2;
            __m512bh v0 = (__m512bh)_mm512_load_si512((const void *)vp);
            __m512bh v1 = (__m512bh)_mm512_load_si512((const void *)(vp + 32));
            __m512bh v2 = (__m512bh)_mm512_load_si512((const void *)(vp + 64));
            __m512bh v3 = (__m512bh)_mm512_load_si512((const void *)(vp + 96));
#pragma GCC unroll 4
            for (int r = 0; r < PV_ROWS; r++) {
                __m512bh pp = (__m512bh)_mm512_set1_epi32(((const int32_t *)(prob + r * p_stride))[m]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pp, v0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pp, v1);
                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], pp, v2);
                acc[r][3] = _mm512_dpbf16_ps(acc[r][3], pp, v3);
            }
        }
        for (int r = 0; r < PV_ROWS; r++) {
            if (!out_rows[r]) continue;
            __m512 w = _mm512_set1_ps(inv[r]);
            for (int c = 0; c < 4; c++)
                _mm256_storeu_si256((__m256i *)(out_rows[r] + c0 + c * 16),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], w)));
        }
    }
}

void pd_prefill_attention_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_pool,
                               const uint16_t *v_pool, int64_t page_size, const int64_t *page_index,
                               int64_t page_cols, const int64_t *ctx_lens, int64_t rows, int64_t q_len,
                               int64_t heads, int64_t kv_heads, int64_t dim, float scale, uint16_t *out,
                               void *work) {
    int64_t group = heads / kv_heads, half = dim / 2, max_ctx = 1;
    for (int64_t b = 0; b < rows; b++) max_ctx = ctx_lens[b] > max_ctx ? ctx_lens[b] : max_ctx;
    int64_t max_keys = round_up(max_ctx, 16);
    uint8_t *w = (uint8_t *)work;
    uint32_t *kt = (uint32_t *)w; w += round_up(max_keys * kv_heads * dim * 2, 64);
    uint16_t *vt = (uint16_t *)w; w += round_up(max_keys * kv_heads * dim * 2, 64);
    float *s = (float *)w; w += round_up(ROWS * max_keys * 4, 64);
    uint16_t *prob = (uint16_t *)w; w += round_up(ROWS * max_keys * 2, 64);
    uint16_t *qb = (uint16_t *)w;
    for (int64_t b = 0; b < rows; b++) {
        int64_t n = ctx_lens[b], cached = n - q_len, keys = round_up(n, 16);
        repack(k_pool, v_pool, page_index + b * page_cols, page_size, kv_heads, dim, n, kt, vt);
        for (int64_t h = 0; h < heads; h++) {
            int64_t g = h / group;
            for (int64_t i0 = 0; i0 < q_len; i0 += ROWS) {
                int64_t live = q_len - i0 < ROWS ? q_len - i0 : ROWS;
                int64_t width = round_up(cached + i0 + live, 16); /* keys the block's last row sees, padded */
                memset(qb, 0, ROWS * dim * 2);
                for (int64_t r = 0; r < live; r++)
                    memcpy(qb + r * dim, q + (b * q_len + i0 + r) * q_stride + h * dim, dim * 2);
                scores16(qb, kt + g * keys * half, dim, width, scale, s, max_keys);
                float inv[ROWS];
                for (int64_t r = 0; r < ROWS; r++) {
                    uint16_t *pr = prob + r * max_keys;
                    if (r < live) inv[r] = 1.0f / softmax_row(s + r * max_keys, cached + i0 + r + 1, width, pr);
                    else memset(pr, 0, width * 2);
                }
                for (int64_t r0 = 0; r0 < live; r0 += PV_ROWS) {
                    uint16_t *dst[PV_ROWS];
                    for (int r = 0; r < PV_ROWS; r++)
                        dst[r] = r0 + r < live ? out + ((b * q_len + i0 + r0 + r) * heads + h) * dim : NULL;
                    int64_t lim = cached + i0 + (r0 + PV_ROWS < live ? r0 + PV_ROWS : live); /* keys seen */
                    weighted_sum4(prob + r0 * max_keys, max_keys, vt + g * keys * dim, dim, (lim + 1) / 2,
                                  inv + r0, dst);
                }
            }
        }
    }
}
