// int4 tiles (int4_decode.cpp's layout) outside the fused step, for ``weights.PackedLinear`` when its
// int4 weight is held as tiles only (model/int4.py ``Int4Weight``, storage "tiles"): the dequantised
// weight a prefill's bf16 matmul reads (``int4_dequantize``), and a matmul of few input rows
// (``int4_linear``: the fused step's ``project_int4``, the same arithmetic). Python side:
// cachedrag/model/int4.py.
//
// Contract: ``int4_dequantize`` equals ``int4.reference_dequantized`` bit for bit: (q - 8) * scale is
// exact in float32 (a 4-bit integer times a bf16 scale), + zero rounds once, then round to nearest
// even to bf16 (denormals kept: integer rounding, not vcvtneps2bf16).
#include "native.h"

namespace fused {

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// 16 float32 lanes -> 16 bf16 bits, round to nearest even (bf16_of's rounding; the values are finite)
inline __m256i bf16x16(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
  return _mm512_cvtepi32_epi16(r);
}

// One tile's group (16 rows x 32 columns) into rows `rows` (<= 16) of out (row stride K, bf16 bits).
// Block c, nibble j of word 2i + e is row i, column 8c + 2j + e: each (c, j) gives 16 column pairs
// (one per row) as dwords, transposed through `pairs` [pair 4c + j][row].
inline void dequantize_group(const uint8_t* tp, int64_t rows, uint16_t* out, int64_t K) {
  const __m512 s = load16(reinterpret_cast<const uint16_t*>(tp + 256)), z = load16(reinterpret_cast<const uint16_t*>(tp + 288));
  const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  const __m512 s_lo = _mm512_permutexvar_ps(lo, s), s_hi = _mm512_permutexvar_ps(hi, s);  // lane w: row w / 2
  const __m512 z_lo = _mm512_permutexvar_ps(lo, z), z_hi = _mm512_permutexvar_ps(hi, z);
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  const __m512 eight = _mm512_set1_ps(8.f);
  alignas(64) uint32_t pairs[16][16];  // [column pair][row]
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_loadu_si512(tp + 64 * c);
    for (int j = 0; j < 4; ++j) {
      const __m512i n = _mm512_and_si512(_mm512_srli_epi16(v, 4 * j), low4);  // [32] u16: lane w = 2i + e
      const __m512 q_lo = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(n))), eight);
      const __m512 q_hi = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(n, 1))), eight);
      // (q - 8) * scale is exact, so the fused multiply-add rounds as mul-then-add does
      _mm256_store_si256(reinterpret_cast<__m256i*>(&pairs[4 * c + j][0]), bf16x16(_mm512_fmadd_ps(q_lo, s_lo, z_lo)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(&pairs[4 * c + j][8]), bf16x16(_mm512_fmadd_ps(q_hi, s_hi, z_hi)));
    }
  }
  const __m512i across = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
  for (int64_t i = 0; i < rows; ++i) {
    const __m512i row = _mm512_i32gather_epi32(_mm512_add_epi32(across, _mm512_set1_epi32(static_cast<int>(i))),
                                               &pairs[0][0], 4);  // the row's 16 pairs, in column order
    _mm512_storeu_si512(out + i * K, row);
  }
}
#else
inline void dequantize_group(const uint8_t*, int64_t, uint16_t*, int64_t) {
  TORCH_CHECK(false, "int4 tiles need AVX512-BF16");
}
#endif

void check_tiles(const torch::Tensor& tiles, int64_t rows) {
  TORCH_CHECK(tiles.dim() == 3 && tiles.size(2) == I4_TILE_BYTES && tiles.scalar_type() == torch::kUInt8 &&
              tiles.is_contiguous() && tiles.device().is_cpu(), "int4 tiles: [T, G, 320] uint8, contiguous, CPU");
  TORCH_CHECK(rows > I4_ROWS * (tiles.size(0) - 1) && rows <= I4_ROWS * tiles.size(0), "int4 tiles: rows");
}

}  // namespace fused

// tiles [T, G, 320] -> the weight [rows, 32 G] bf16 into `out` (given: a buffer the caller reuses, so its
// pages are not faulted in again on every call), in parallel over tiles
torch::Tensor int4_dequantize(torch::Tensor tiles, int64_t rows, std::optional<torch::Tensor> given) {
  using namespace fused;
  TORCH_CHECK(CAN_INT4, "int4 tiles need AVX512-BF16");
  check_tiles(tiles, rows);
  const int64_t T = tiles.size(0), G = tiles.size(1), K = G * I4_GROUP;
  auto out = given.has_value() ? *given : torch::empty({rows, K}, torch::kBFloat16);  // [O, I]
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 && out.is_contiguous() && out.dim() == 2 && out.size(0) == rows &&
              out.size(1) == K, "int4_dequantize: out [rows, I] bfloat16, contiguous");
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const uint8_t* base = tiles.data_ptr<uint8_t>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = std::min(I4_ROWS, rows - t * I4_ROWS);
      for (int64_t g = 0; g < G; ++g)
        dequantize_group(base + (t * G + g) * I4_TILE_BYTES, n, o + t * I4_ROWS * K + g * I4_GROUP, K);
    }
  });
  return out;
}

// y [N, rows] = x [N, 32 G] @ W^T (+ bias) from int4 tiles: float32 sums (``project_int4``), bias
// added in float32, rounded once to x's dtype (bfloat16)
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor tiles, int64_t rows, torch::Tensor bias) {
  using namespace fused;
  TORCH_CHECK(CAN_INT4, "int4 tiles need AVX512-BF16");
  check_tiles(tiles, rows);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == tiles.size(1) * I4_GROUP && x.scalar_type() == torch::kBFloat16 &&
              x.device().is_cpu(), "int4_linear: x [N, I] bfloat16, CPU");
  Proj p;
  int4_proj(p, tiles, rows);
  if (bias.numel()) {
    TORCH_CHECK(bias.numel() == rows, "int4_linear: one bias per row");
    auto b = bias.to(torch::kFloat32).contiguous();
    p.bias.assign(b.data_ptr<float>(), b.data_ptr<float>() + rows);
  }
  auto xb = x.contiguous();
  auto xf = xb.to(torch::kFloat32);  // [N, I] the same values, for the group sums
  auto y = torch::empty({x.size(0), rows}, torch::kFloat32);  // [N, O]
  project_int4(p, x.size(0), xf.data_ptr<float>(), reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()),
               y.data_ptr<float>(), true, Epilogue());
  return y.to(torch::kBFloat16);
}
