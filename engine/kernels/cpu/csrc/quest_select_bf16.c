/* Sparse attention's page choice (Quest) for one layer over bf16 page summaries, with AVX512-BF16 dot
 * products: per row, the bounds of its scored pages, the best of them, and the paged decode kernel's
 * tables (engine/kernels/cpu/csrc/decode_attention_bf16.c reads them in place).
 *
 * Built and loaded by engine/kernels/cpu/native.py; called by engine/kernels/cpu/quest_select.py's select_pages
 * where the CPU has AVX512-BF16 and head_dim is 64 (its numba kernel otherwise, with the same contract;
 * both are tested against the torch path of engine/kv_cache/sparse.py).
 * Why C: in numba the 128-value dot products (one horizontal sum each) cost more than the paged attention
 * itself; here 16 pages' sums come out of one shuffle tree (sum_lanes16), and the choice that follows
 * runs on the row's scores while they are still in L1 (as a separate numba call it was ~3x slower).
 * Per row b (n_pages[b] pages, per-row numbers from quest_select.row_numbers):
 *   bounds  for each KV head h and page j in [first[b], stop[b]): over the KV head's query heads, the max
 *           (or, where gqa_sum[b], the sum) of q+ . max + q- . min (q+ / q-: the query's positive and
 *           negative parts, exact in bf16); where row_mode[b], summed over KV heads (one choice per row)
 *   choice  pages [0, first) and [stop, n) always (sinks, recent window; every page where first == stop);
 *           of [first, stop) the by_score[b] best: those above the k-th best score, then ties at it in
 *           page order (a quickselect finds it)
 *   out     pages [rows][kv_heads][width] in page order, padded with page 0; slots (page_size, tail[b]
 *           for the row's last page, 0 for padding); lens [rows][kv_heads] their sums
 * Layouts (uint16 = bf16 bits): q [rows][heads][64]; lo, hi [num_pages][kv_heads][64] (one layer's
 * summaries); page_index [rows][page_cols]; work: pd_quest_select_work_bytes(page_cols, kv_heads) bytes,
 * 64-byte aligned. Query heads per KV head: at most 16.
 */
#include "bf16_common.h"

#define DIM 64
#define PAGES_AHEAD 16  /* summaries prefetched this many pages on (scattered pages: see the decode kernel) */

int64_t pd_quest_select_work_bytes(int64_t page_cols, int64_t kv_heads) {
    return round_up((kv_heads + 2) * page_cols * 4, 64) + (page_cols + 1) * 8;
}

static inline void prefetch_l2(const uint16_t *row) {
    _mm_prefetch((const char *)row, _MM_HINT_T1);
    _mm_prefetch((const char *)(row + 32), _MM_HINT_T1);
}

/* score[h][j] for j in [a, z) of one row (pages[]), KV head h's query heads qh [group][64] */
static void bounds(const uint16_t *qh, int64_t group, const uint16_t *lo, const uint16_t *hi, int64_t kv_heads,
                   int64_t h, const int64_t *pages, int64_t a, int64_t z, int use_sum, float *score) {
    uint16_t qp[16][DIM] __attribute__((aligned(64))), qn[16][DIM] __attribute__((aligned(64)));
    for (int64_t g = 0; g < group; g++)
        for (int d = 0; d < DIM; d++) {
            uint16_t x = qh[g * DIM + d];
            qp[g][d] = (x & 0x8000) ? 0 : x;
            qn[g][d] = (x & 0x8000) ? x : 0;
        }
    for (int64_t j0 = a; j0 < z; j0 += 16) {
        int cnt = z - j0 < 16 ? (int)(z - j0) : 16;
        for (int64_t j = j0 + PAGES_AHEAD; j < j0 + PAGES_AHEAD + 16 && j < z; j++) {
            prefetch_l2(lo + (pages[j] * kv_heads + h) * DIM);
            prefetch_l2(hi + (pages[j] * kv_heads + h) * DIM);
        }
        __m512 best = _mm512_setzero_ps();
        for (int64_t g = 0; g < group; g++) {
            __m512bh p0 = (__m512bh)_mm512_load_si512((const void *)qp[g]);
            __m512bh p1 = (__m512bh)_mm512_load_si512((const void *)(qp[g] + 32));
            __m512bh n0 = (__m512bh)_mm512_load_si512((const void *)qn[g]);
            __m512bh n1 = (__m512bh)_mm512_load_si512((const void *)(qn[g] + 32));
            __m512 acc[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++) {  /* past the range: the last page again (not stored) */
                int64_t off = (pages[j0 + (i < cnt ? i : cnt - 1)] * kv_heads + h) * DIM;
                __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), p0, (__m512bh)_mm512_loadu_si512((const void *)(hi + off)));
                s = _mm512_dpbf16_ps(s, p1, (__m512bh)_mm512_loadu_si512((const void *)(hi + off + 32)));
                s = _mm512_dpbf16_ps(s, n0, (__m512bh)_mm512_loadu_si512((const void *)(lo + off)));
                acc[i] = _mm512_dpbf16_ps(s, n1, (__m512bh)_mm512_loadu_si512((const void *)(lo + off + 32)));
            }
            __m512 v = sum_lanes16(acc);
            best = g == 0 ? v : use_sum ? _mm512_add_ps(best, v) : _mm512_max_ps(best, v);
        }
        _mm512_mask_storeu_ps(score + j0, (__mmask16)((1u << cnt) - 1), best);
    }
}

/* the k-th largest of v[0, m) (1 <= k <= m), by quickselect; reorders v */
static float kth_largest(float *v, int64_t m, int64_t k) {
    int64_t lo = 0, hi = m - 1, target = k - 1;
    while (lo < hi) {
        float pivot = v[(lo + hi) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {  /* Hoare partition, larger values first */
            while (v[i] > pivot) i++;
            while (v[j] < pivot) j--;
            if (i <= j) {
                float t = v[i]; v[i] = v[j]; v[j] = t;
                i++; j--;
            }
        }
        if (target <= j) hi = j;
        else if (target >= i) lo = i;
        else break;
    }
    return v[target];
}

void pd_quest_select_bf16(const uint16_t *q, const uint16_t *lo, const uint16_t *hi, const int64_t *page_index,
                          int64_t page_cols, int64_t rows, int64_t heads, int64_t kv_heads, const int64_t *n_pages,
                          const int64_t *first, const int64_t *stop, const int64_t *by_score, const int64_t *tail,
                          const uint8_t *gqa_sum, const uint8_t *row_mode, int64_t page_size, int64_t width,
                          int64_t *out_pages, int64_t *out_slots, int64_t *out_lens, void *work) {
    int64_t group = heads / kv_heads;
    float *score = (float *)work;                    /* [kv_heads + 1][page_cols]: one row's */
    float *tmp = score + (kv_heads + 1) * page_cols;  /* [page_cols] */
    int64_t *chosen = (int64_t *)((uint8_t *)work + round_up((kv_heads + 2) * page_cols * 4, 64));
    for (int64_t b = 0; b < rows; b++) {
        int64_t n = n_pages[b], a = first[b], z = stop[b], k = by_score[b];
        const int64_t *pages = page_index + b * page_cols;
        float *sum = score + kv_heads * page_cols;
        for (int64_t h = 0; h < kv_heads && z > a; h++)
            bounds(q + (b * heads + h * group) * DIM, group, lo, hi, kv_heads, h, pages, a, z, gqa_sum[b],
                   score + h * page_cols);
        if (z > a && row_mode[b])
            for (int64_t j = a; j < z; j++) {
                float t = 0.0f;
                for (int64_t h = 0; h < kv_heads; h++) t += score[h * page_cols + j];
                sum[j] = t;
            }
        for (int64_t h = 0; h < kv_heads; h++) {
            const float *src = row_mode[b] ? sum : score + h * page_cols;
            int64_t m = 0;
            for (int64_t j = 0; j < a; j++) chosen[m++] = j;  /* sinks */
            if (z > a) {
                memcpy(tmp, src + a, (size_t)(z - a) * sizeof(float));
                float thr = kth_largest(tmp, z - a, k);
                int64_t ties = k;
                for (int64_t j = a; j < z; j++) ties -= src[j] > thr;
                for (int64_t j = a; j < z; j++) {
                    int take = src[j] > thr || (src[j] == thr && ties > 0);
                    ties -= take && src[j] == thr;
                    chosen[m] = j;
                    m += take;
                }
            }
            for (int64_t j = z > a ? z : a; j < n; j++) chosen[m++] = j;  /* recent window (or every page) */
            if (m > width) m = width;
            int64_t *op = out_pages + (b * kv_heads + h) * width, *os = out_slots + (b * kv_heads + h) * width;
            int64_t total = 0;
            for (int64_t i = 0; i < width; i++) {
                int64_t filled = i >= m ? 0 : chosen[i] == n - 1 ? tail[b] : page_size;
                op[i] = i < m ? pages[chosen[i]] : 0;
                os[i] = filled;
                total += filled;
            }
            out_lens[b * kv_heads + h] = total;
        }
    }
}
