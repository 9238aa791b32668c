/* Helpers shared by the bf16 kernels (attention_bf16.c, decode_attention_bf16.c, quest_select_bf16.c): the
 * CPU check that engine/kernels/cpu/native.py calls before using a library, a vectorized exp, and a sum of 16
 * vectors' lanes at once. */
#ifndef PD_BF16_COMMON_H
#define PD_BF16_COMMON_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

int pd_cpu_supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512bf16");
}

/* e**x for float32 lanes (softmax arguments, x <= 0): 2**(x log2 e) split into 2**n * 2**f, f in
 * [-0.5, 0.5], 2**f by its Taylor series to degree 7 (relative error < 1e-7 before rounding). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f)); /* below: 0 after scalef (flushes) */
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f)); /* f ln 2 */
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Row softmax over keys [0, lim): P (bf16) = exp(S - max), zero on [lim, width); returns the sum. */
static inline float softmax_row(const float *s, int64_t lim, int64_t width, uint16_t *prob) {
    __m512 m = _mm512_set1_ps(-__builtin_inff());
    int64_t j = 0;
    for (; j + 16 <= lim; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
    if (j < lim) m = _mm512_mask_max_ps(m, (__mmask16)((1u << (lim - j)) - 1), m, _mm512_loadu_ps(s + j));
    __m512 vmax = _mm512_set1_ps(_mm512_reduce_max_ps(m));
    __m512 sum = _mm512_setzero_ps();
    for (j = 0; j < width; j += 16) {
        __mmask16 live = j + 16 <= lim ? 0xFFFF : (j < lim ? (__mmask16)((1u << (lim - j)) - 1) : 0);
        __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), vmax)));
        sum = _mm512_add_ps(sum, e);
        _mm256_storeu_si256((__m256i *)(prob + j), (__m256i)_mm512_cvtneps_pbh(e));
    }
    return _mm512_reduce_add_ps(sum);
}

/* lane j of the result = the sum of a[j]'s 16 lanes */
static inline __m512 sum_lanes16(const __m512 *a) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)  /* per vector: 128-bit lanes 0+2 and 1+3 */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)  /* lane L of c[i]: 4 partial sums of a[4i + L] */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    __m512 d0 = _mm512_add_ps(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
    __m512 d1 = _mm512_add_ps(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
    __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d0, d1, 0x44), _mm512_shuffle_ps(d0, d1, 0xEE));
    /* e[4L + p] = sum of a[4p + L] */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(order, e);
}

#endif
