// The fused decode step's int4 projections: group-wise asymmetric int4 weights (groups of 32 input
// columns, a bf16 scale and zero per row and group: ``weights.PackedLinear``'s int4 values, ``w = (q
// - 8) * scale + zero``, q in 0..15) read from tiles of 16 rows by AVX512-BF16 ``vdpbf16ps``. Python
// side: cachedrag/model/fused_decode.py (``int4_tiles`` makes the layout); fused_decode.cpp calls
// ``int4_tile_dot`` from its projections.
//
// Layout (``int4_tiles``): per tile of I4_ROWS (16) rows and per group of 32 columns, I4_TILE_BYTES
// (320) bytes: 4 blocks of 64 bytes, block c holding columns 8c..8c+7 of the group as 32 16-bit words
// (word 2i + e, nibble j (bits 4j..4j+3) = q[row i, column 8c + 2j + e]), then the 16 rows' scales and
// the 16 rows' zeros (bf16). One sequential stream per tile.
//
// Arithmetic: a nibble q becomes the bf16 number 128 + q by OR-ing 0x4300 into its 16-bit word
// (128's exponent; the 7 mantissa bits hold q exactly), so one vdpbf16ps multiplies a column pair of
// 16 rows by the input's pair, exact products summed in float32. Per row and group, with the
// input's group sum X (float32): sum_k w_k x_k = scale * sum_k (128 + q_k) x_k + (zero - 136 * scale) * X.
// Every (row, input) value is computed in the same order whatever the number of inputs (a batched
// row is bit for bit the single step). Needs AVX512-BF16 (``int4_available``).
#include "native.h"

namespace fused {

constexpr int64_t I4_ROWS = 16, I4_GROUP = 32, I4_TILE_BYTES = I4_ROWS * I4_GROUP / 2 + 2 * I4_ROWS * 2;

// the input rows' group sums: xs[b * G + g] = sum of x[b * K + 32 g .. + 31] (float32, in column order)
inline void int4_group_sums(const float* x, int64_t B, int64_t K, float* xs) {
  const int64_t G = K / I4_GROUP;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < G; ++g) {
      const float* r = x + b * K + g * I4_GROUP;
      float s = 0.f;
      for (int64_t k = 0; k < I4_GROUP; ++k) s += r[k];
      xs[b * G + g] = s;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
constexpr bool CAN_INT4 = true;

// One tile (16 rows, G groups) against NB input rows (bf16 bits, stride S; group sums xs, stride G):
// out[b * 16 + r]. Four accumulators per input (one per nibble position) keep the vdpbf16ps chains
// short; summed per group in a fixed order, then scaled.
template <int NB>
inline void int4_tile_dot(const uint8_t* t, int64_t G, const uint16_t* x, int64_t S, const float* xs, float* out) {
  const __m512i low4 = _mm512_set1_epi16(0x000F), bias = _mm512_set1_epi16(0x4300);
  const __m512 k136 = _mm512_set1_ps(136.f);
  __m512 acc[NB];
  for (int b = 0; b < NB; ++b) acc[b] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g, t += I4_TILE_BYTES) {
    __m512 a[NB][4];
    for (int b = 0; b < NB; ++b) a[b][0] = a[b][1] = a[b][2] = a[b][3] = _mm512_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(t + 64 * c);
      __m512bh w[4];
      w[0] = (__m512bh)_mm512_ternarylogic_epi32(v, low4, bias, 0xEA);  // (v & 15) | 0x4300
      w[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), low4, bias, 0xEA);
      w[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 8), low4, bias, 0xEA);
      w[3] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 12), bias);
      const int64_t k = g * I4_GROUP + 8 * c;
      for (int b = 0; b < NB; ++b) {
        const uint16_t* xr = x + b * S + k;
        for (int j = 0; j < 4; ++j) {
          int32_t pair;
          std::memcpy(&pair, xr + 2 * j, 4);
          a[b][j] = _mm512_dpbf16_ps(a[b][j], w[j], (__m512bh)_mm512_set1_epi32(pair));
        }
      }
    }
    const __m512 s = load16(reinterpret_cast<const uint16_t*>(t + 256));
    const __m512 cz = _mm512_fnmadd_ps(k136, s, load16(reinterpret_cast<const uint16_t*>(t + 288)));  // zero - 136 s
    for (int b = 0; b < NB; ++b) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(a[b][0], a[b][1]), _mm512_add_ps(a[b][2], a[b][3]));
      acc[b] = _mm512_fmadd_ps(sum, s, acc[b]);
      acc[b] = _mm512_fmadd_ps(cz, _mm512_set1_ps(xs[b * G + g]), acc[b]);
    }
  }
  for (int b = 0; b < NB; ++b) _mm512_storeu_ps(out + b * I4_ROWS, acc[b]);
}
#else
constexpr bool CAN_INT4 = false;
template <int NB>
inline void int4_tile_dot(const uint8_t*, int64_t, const uint16_t*, int64_t, const float*, float*) {
  TORCH_CHECK(false, "fused decode: int4 weights need AVX512-BF16");
}
#endif

}  // namespace fused

// whether this build reads int4 weights in the fused step (AVX512-BF16)
bool int4_available() { return fused::CAN_INT4; }
