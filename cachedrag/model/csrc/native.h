// The native CPU library's shared code: what two or more of its sources use.
//
// The library is ONE translation unit: cachedrag/model/native.py hands torch's load_inline the
// sources decode_attention.cpp, prefill_attention.cpp, int4_decode.cpp, fused_decode.cpp, int4_linear.cpp,
// int8_tiles.cpp and bindings.cpp in that order (one main.cpp), so the fused decode step calls the very
// machine code of the decode kernel (``scaled_query``, ``attend_batch``: a batched row is bit for bit the single call). Internal
// helpers live in an anonymous namespace (internal linkage, as one translation unit allows).
//
// Owns: the includes; the kernels' limits (query heads per KV head, head dim); bfloat16 <-> float32
// (round to nearest even, NaN stays NaN); exp of non-positive values as straight-line arithmetic
// (scalar and 16 AVX-512 lanes); the K/V buffer checks; and the declarations each source needs
// from another (the decode kernel's shared functions, the bound entry points).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int MAX_G = 16;      // query heads per KV head
constexpr int MAX_D = 256;     // head dim

// float32 -> bfloat16 bits, round to nearest even (at::BFloat16's rounding; NaN stays NaN), inline
// and branch-free so loops vectorise
inline uint16_t bf16_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t nan = (u >> 16) | 0x40u, rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}
inline float float_of(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float bf16r(float f) { return float_of(bf16_of(f)); }  // the nearest bfloat16 value

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return float_of(p[i]); }

// exp(x) for x <= 0 (scores minus their running max) as straight-line arithmetic the compiler
// vectorises (libm's expf is a scalar call: most of the kernel's time before). Cephes' expf
// polynomial after x = n ln2 + r, |r| <= ln2/2; relative error ~2 ulp; x < -87 gives 0.
__attribute__((always_inline)) inline float exp_neg(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return p * scale;
}
#if defined(__AVX512F__)
// 16 float32 lanes from float32 or bfloat16 values
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline __m512 exp16_neg(__m512 x) {  // exp_neg on 16 lanes; 2^n applied by scalef
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}
#endif

inline void check_kv(const torch::Tensor& k, const torch::Tensor& v, int D, int H_kv) {
  TORCH_CHECK(k.size(-1) == D && v.size(-1) == D && v.size(-3) == H_kv && k.size(-3) == H_kv, "decode_attention: k/v shape");
  TORCH_CHECK(k.stride(-1) == 1 && k.stride(-2) == D && v.stride(-1) == 1 && v.stride(-2) == D, "decode_attention: k/v rows must be contiguous");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "decode_attention: k/v dtypes differ");
  TORCH_CHECK(k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kBFloat16, "decode_attention: k/v must be float32 or bfloat16");
}

// The query rows of one request, scaled, as float32 [H_q, D] (decode_attention.cpp).
void scaled_query(const void* q, bool q_bf16, int64_t s0, int64_t s1, int H_q, int D, float scale, float* qs);

}  // namespace

// The decode attention of B requests in one parallel loop (decode_attention.cpp).
void attend_batch(const float* qs, const std::vector<torch::Tensor>& ks, const std::vector<torch::Tensor>& vs,
                  int64_t layer, const int64_t* starts, const int64_t* ends, int H_q, int H_kv, int D, void* out,
                  bool out_bf16, int64_t splits_given = 0);

// The entry points bindings.cpp binds.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t start, int64_t end,
                               double scale, int64_t splits);
torch::Tensor decode_attention_batch(torch::Tensor q, std::vector<torch::Tensor> ks, std::vector<torch::Tensor> vs,
                                     int64_t layer, std::vector<int64_t> starts, std::vector<int64_t> ends,
                                     double scale);
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor positions,
                                int64_t kv_len, double scale, torch::Tensor hidden, int64_t pairs);
bool prefill_attention_available();
void register_fused_decode(pybind11::module_& m);
void register_int8_tiles(pybind11::module_& m);
bool int8_tiles_available();
bool int4_available();
torch::Tensor int4_dequantize(torch::Tensor tiles, int64_t rows, std::optional<torch::Tensor> out);
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor tiles, int64_t rows, torch::Tensor bias);
