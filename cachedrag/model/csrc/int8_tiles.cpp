// int8 weight-only projections stored ONLY in the fused decode step's packed tile layout
// (``weights.PackedLinear``, kind "int8", where ``int8_tiles_available``): the step reads those tiles
// as they are (``int8_tiles_proj``: no second copy), and the rest of the runner reads them through
// the entry points here. Python side: cachedrag/model/weights.py (``PackedLinear``).
//
// Layout (fused_decode.cpp's ``pack_tiles`` with P = 1): int8 [T, I, TILE], T = ceil(O / TILE);
// element [t, k, r] = q[TILE t + r, k] (rows past O are zeros). A fused gate/up weight (``gate_up``:
// O = 2 FF rows, gate then up, no bias) is stored as fused_decode.cpp's ``gate_up_rows`` orders it,
// [T, I, 2, 16] with T = ceil(FF / 16): element [t, k, h, r] = q[h FF + 16 t + r, k] (units past FF
// zero), so the fused step's tiles hold both halves of 16 units (its SiLU(gate) * up epilogue).
//
// Entry points:
// - ``int8_tiles_pack(q [O, I] int8, gate_up) -> [T, I, 32]`` or ``[T, I, 2, 16]``;
// - ``int8_tiles_linear(x [N, I], tiles, scale [O], bias [O] or empty, rows O) -> [N, O]`` in x's dtype:
//   ``project_packed<int8_t, float>``'s arithmetic (the fused step's: per row a float32 sum over the
//   columns in order, times the row's scale, plus the bias in float32), rounded once to x's dtype;
// - ``int8_tiles_dequantize(tiles, scale, rows) -> [O, I]`` in scale's dtype, bit for bit
//   ``q.to(scale.dtype) * scale[:, None]`` (int8 -> bfloat16 / float32 is exact, the product of an
//   int8 and a bf16 value is exact in float32, then one round to nearest even);
// All need AVX-512 (``int8_tiles_available``); without it the runner keeps row-major int8 and torch.
#include "native.h"

namespace fused {

// Whether tiles are a gate/up weight's ([T, I, 2, 16]) and checks of their shape against `rows` (O)
inline bool check_int8_tiles(const torch::Tensor& tiles, int64_t rows) {
  TORCH_CHECK(CAN_PACK, "int8 tiles need AVX-512");
  const bool gate_up = tiles.dim() == 4;
  TORCH_CHECK(tiles.scalar_type() == torch::kInt8 && tiles.is_contiguous() && tiles.device().is_cpu() &&
              ((tiles.dim() == 3 && tiles.size(2) == TILE) || (gate_up && tiles.size(2) == 2 && tiles.size(3) == TILE / 2)),
              "int8 tiles: [T, I, 32] or gate/up [T, I, 2, 16] int8, contiguous, CPU");
  const int64_t per = gate_up ? TILE / 2 : TILE, units = gate_up ? rows / 2 : rows;
  TORCH_CHECK((!gate_up || rows % 2 == 0) && units > per * (tiles.size(0) - 1) && units <= per * tiles.size(0),
              "int8 tiles: rows");
  return gate_up;
}

// The weight row that row r of tile t holds (O rows; gate/up: FF = O / 2 units), or -1 (a zero row)
inline int64_t tile_row(int64_t t, int64_t r, int64_t O, bool gate_up) {
  if (!gate_up) return t * TILE + r < O ? t * TILE + r : -1;
  const int64_t half = TILE / 2, unit = t * half + r % half, FF = O / 2;
  return unit < FF ? (r < half ? unit : FF + unit) : -1;
}

// The fused step's projection over shared tiles (make_proj): packed, the scale and bias set by make_proj.
void int8_tiles_proj(Proj& p, const torch::Tensor& tiles, int64_t rows) {
  p.gate_up_tiles = check_int8_tiles(tiles, rows);
  p.kind = INT8;
  p.rows = rows;
  p.cols = tiles.size(1);
  p.w = tiles;
  p.packed = tiles;
  p.shared = true;
}

torch::Tensor tiles_pack(torch::Tensor q, bool gate_up) {
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.dim() == 2 && q.device().is_cpu(), "int8_tiles_pack: q [O, I] int8");
  TORCH_CHECK(!gate_up || q.size(0) % 2 == 0, "int8_tiles_pack: gate/up rows come in pairs");
  q = q.contiguous();
  const int64_t O = q.size(0), K = q.size(1), T = gate_up ? (O / 2 + TILE / 2 - 1) / (TILE / 2) : (O + TILE - 1) / TILE;
  auto out = gate_up ? torch::empty({T, K, 2, TILE / 2}, q.options()) : torch::empty({T, K, TILE}, q.options());
  const int8_t* src = q.data_ptr<int8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      int8_t* tile = dst + t * K * TILE;
      for (int64_t r = 0; r < TILE; ++r) {
        const int64_t n = tile_row(t, r, O, gate_up);
        if (n < 0) {
          for (int64_t k = 0; k < K; ++k) tile[k * TILE + r] = 0;
          continue;
        }
        const int8_t* row = src + n * K;
        for (int64_t k = 0; k < K; ++k) tile[k * TILE + r] = row[k];
      }
    }
  });
  return out;
}

#if defined(__AVX512F__)
// 16 bf16 bits of 16 float32 lanes, round to nearest even, NaN kept quiet (native.h's bf16_of)
inline __m256i bf16_16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                   _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, nan));
}

// Tile rows r0..r0+nr-1 (nr <= 4, weight rows consecutive, scales s[0..nr)), columns [0, K): each dword
// gathered at column k + j holds the four tile rows' bytes, so one gather serves 16 columns of 4
// rows. out: the first row's first element, rows ld apart.
template <bool BF16>
inline void dequantize_rows4(const int8_t* tile, int64_t K, int64_t r0, int64_t nr, const float* s, void* out,
                             int64_t ld) {
  const __m512i offsets = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(TILE));
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512i v = _mm512_i32gather_epi32(offsets, tile + k * TILE + r0, 1);
    for (int64_t i = 0; i < nr; ++i) {
      const __m512i q = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * static_cast<int>(i)), 24);
      const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(s[i]));
      if constexpr (BF16) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i * ld + k), bf16_16(w));
      } else {
        _mm512_storeu_ps(static_cast<float*>(out) + i * ld + k, w);
      }
    }
  }
  for (; k < K; ++k)
    for (int64_t i = 0; i < nr; ++i) {
      const float w = static_cast<float>(tile[k * TILE + r0 + i]) * s[i];
      if constexpr (BF16) static_cast<uint16_t*>(out)[i * ld + k] = bf16_of(w);
      else static_cast<float*>(out)[i * ld + k] = w;
    }
}
#endif

torch::Tensor tiles_dequantize(const torch::Tensor& tiles, torch::Tensor scale, int64_t rows,
                               std::optional<torch::Tensor> given) {
  const bool gate_up = check_int8_tiles(tiles, rows);
  TORCH_CHECK(scale.numel() == rows && (scale.scalar_type() == torch::kBFloat16 || scale.scalar_type() == torch::kFloat32),
              "int8_tiles_dequantize: scale [O] bfloat16 or float32");
  const bool bf16 = scale.scalar_type() == torch::kBFloat16;
  const auto s = scale.to(torch::kFloat32).contiguous();  // exact: the scale's values
  const int64_t K = tiles.size(1), T = tiles.size(0);
  // [O, I]; `given`: a buffer the caller reuses (its pages not faulted in again on every call)
  auto out = given.has_value() ? *given : torch::empty({rows, K}, scale.options());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == K && out.is_contiguous() &&
              out.scalar_type() == scale.scalar_type(), "int8_tiles_dequantize: out [O, I] contiguous, scale's dtype");
#if defined(__AVX512F__)
  const int8_t* base = tiles.data_ptr<int8_t>();
  const float* sp = s.data_ptr<float>();
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t esize = out.element_size();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t r = 0; r < TILE; r += 4) {  // 4 tile rows: consecutive weight rows (a half is 16 rows)
        const int64_t n = tile_row(t, r, rows, gate_up);
        if (n < 0) continue;
        int64_t nr = 1;
        while (nr < 4 && tile_row(t, r + nr, rows, gate_up) == n + nr) ++nr;
        void* o = dst + n * K * esize;
        if (bf16) dequantize_rows4<true>(base + t * K * TILE, K, r, nr, sp + n, o, K);
        else dequantize_rows4<false>(base + t * K * TILE, K, r, nr, sp + n, o, K);
      }
    }
  });
#endif
  return out;
}

torch::Tensor tiles_linear(torch::Tensor x, const torch::Tensor& tiles, const torch::Tensor& scale,
                           const torch::Tensor& bias, int64_t rows) {
  const bool gate_up = check_int8_tiles(tiles, rows);
  TORCH_CHECK(!gate_up || bias.numel() == 0, "int8_tiles_linear: gate/up tiles have no bias");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == tiles.size(1), "int8_tiles_linear: x [N, I]");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32, "int8_tiles_linear: x bfloat16 or float32");
  Proj p;
  p.kind = INT8;
  p.rows = rows;
  p.cols = tiles.size(1);
  p.packed = tiles;
  p.gate_up_tiles = gate_up;  // project_packed writes the rows back in their order (gate units, then up units)
  auto s = scale.to(torch::kFloat32).contiguous();
  TORCH_CHECK(s.numel() == rows, "int8_tiles_linear: one scale per row");
  p.scale.assign(s.data_ptr<float>(), s.data_ptr<float>() + rows);
  if (bias.numel()) {
    auto b = bias.to(torch::kFloat32).contiguous();
    TORCH_CHECK(b.numel() == rows, "int8_tiles_linear: one bias per row");
    p.bias.assign(b.data_ptr<float>(), b.data_ptr<float>() + rows);
  }
  const int64_t N = x.size(0);
  auto xf = x.to(torch::kFloat32).contiguous();  // [N, I]
  auto y = torch::empty({N, rows}, xf.options());  // [N, O]
#if defined(__AVX512F__)
  if (N > 0) project_packed<int8_t, float>(p, N, xf.data_ptr<float>(), y.data_ptr<float>(), true, Epilogue());
#endif
  return y.to(x.scalar_type());
}

}  // namespace fused

bool int8_tiles_available() { return fused::CAN_PACK; }

void register_int8_tiles(pybind11::module_& m) {
  m.def("int8_tiles_available", &int8_tiles_available, "whether int8 weights are stored as the fused step's tiles (AVX-512)");
  m.def("int8_tiles_pack", &fused::tiles_pack, "int8 [O, I] -> tiles [ceil(O / 32), I, 32] or gate/up ones (cachedrag)",
        pybind11::arg("q"), pybind11::arg("gate_up") = false);
  m.def("int8_tiles_dequantize", &fused::tiles_dequantize, "int8 tiles * per-row scale -> [O, I] (cachedrag)",
        pybind11::arg("tiles"), pybind11::arg("scale"), pybind11::arg("rows"), pybind11::arg("out") = pybind11::none(),
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("int8_tiles_linear", &fused::tiles_linear, "x [N, I] @ (int8 tiles * scale)^T + bias (cachedrag)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
