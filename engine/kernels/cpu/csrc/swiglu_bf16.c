/* SwiGLU's activation for bfloat16 rows on CPU: out = silu(gate) * up from one fused gate/up projection,
 * in one pass instead of torch's silu, mul and the chunk views between them.
 *
 * Built and loaded by engine/kernels/cpu/native.py; called through engine/kernels/cpu/activations.py.
 * Rounding as Hugging Face's bf16 LlamaMLP does it (two torch ops): s = bf16(silu(gate)) computed in
 * float32, then bf16(s * up) in float32. silu(x) = x * sigmoid(x), sigmoid from e**-|x| (exp512 takes
 * arguments <= 0); NaN and infinities come out as torch's: silu(-inf) = NaN, silu(inf) = inf.
 * Layout (uint16 = bf16 bits): gate_up [rows][2 * inter] (gate then up), out [rows][inter], contiguous.
 */
#include "bf16_common.h"

static inline __m512 widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

void pd_swiglu_bf16(const uint16_t *gate_up, int64_t rows, int64_t inter, uint16_t *out) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
        for (int64_t j = 0; j < inter; j += 16) {
            __mmask16 live = j + 16 <= inter ? 0xFFFF : (__mmask16)((1u << (inter - j)) - 1);
            __m512 x = widen(_mm256_maskz_loadu_epi16(live, g + j));
            __m512 z = exp512(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), sign)));  /* e**-|x| */
            __m512 pos = _mm512_div_ps(one, _mm512_add_ps(one, z));
            __m512 neg = _mm512_div_ps(z, _mm512_add_ps(one, z));
            __m512 sig = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), neg, pos);
            __m512 s = widen((__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(x, sig)));  /* silu, rounded to bf16 */
            __m512 y = _mm512_mul_ps(s, widen(_mm256_maskz_loadu_epi16(live, u + j)));
            _mm256_mask_storeu_epi16(o + j, live, (__m256i)_mm512_cvtneps_pbh(y));
        }
    }
}
