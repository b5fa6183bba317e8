// The fused decode step: every layer of the runner's one-token step and the LM head for B requests
// in one call (RMSNorm, q/k/v projection, RoPE, K/V row writes, the decode kernel's split-K
// attention, output projection, gate/up, SiLU x up, down, residuals); float32, bfloat16 and int8
// weight-only projections, packed in tiles of 32 rows where asked, and int4 ones in their tiles of 16
// rows (int4_decode.cpp). Python side:
// cachedrag/model/fused_decode.py (FusedDecode).
#include "native.h"

namespace fused {

enum Kind { F32 = 0, BF16 = 1, INT8 = 2, INT4 = 3 };

struct Proj {
  int kind = F32;
  int64_t rows = 0, cols = 0;
  torch::Tensor w;           // [rows, cols] float32 / bfloat16 / int8, contiguous (held: no copy); int4: the
                             // tiles [ceil(rows / 16), cols / 32, I4_TILE_BYTES] uint8 (int4_decode.cpp)
  std::vector<float> scale;  // int8: per row
  std::vector<float> bias;   // empty: none
  torch::Tensor packed;      // when packed: tiles of TILE rows, [cols / P][TILE][P] each, the weights' dtype (undefined: none)
  bool gate_up_tiles = false;  // packed gate/up: tile t holds gate rows 16t.. then up rows 16t.. (``GATE_UP`` epilogue)
  bool shared = false;  // int8: `packed` is the caller's tiles (the weight's only copy, int8_tiles.cpp), not a copy
};

// The packed layout: TILE (32) consecutive rows interleaved by groups of P columns (bf16: P = 2, the
// pair one vdpbf16ps multiplies; float32 and int8: P = 1), so one load holds one group of 16 rows
// (64 bytes; int8: 16, widened to float32) and one vdpbf16ps / FMA adds that group's products for
// 16 rows at once against the input's group broadcast (``tile_dot``). Rows past the end are zeros.
constexpr int64_t TILE = 32;

torch::Tensor pack_tiles(const torch::Tensor& w, int64_t P) {  // w [N, K] (K % P == 0) -> [tiles * TILE * K]
  const int64_t N = w.size(0), K = w.size(1), tiles = (N + TILE - 1) / TILE;
  auto padded = torch::zeros({tiles * TILE, K}, w.options());  // [tiles * TILE, K]
  padded.narrow(0, 0, N).copy_(w);
  // [tiles, TILE, K / P, P] -> [tiles, K / P, TILE, P]
  return padded.view({tiles, TILE, K / P, P}).permute({0, 2, 1, 3}).contiguous().view({-1});
}

// gate/up [2 * FF, K] -> rows reordered so each TILE of the packed copy holds 16 gate rows and the
// 16 up rows of the same units (units past FF: zero rows): the tile's epilogue then has both
// halves of SiLU(gate) * up for 16 units.
torch::Tensor gate_up_rows(const torch::Tensor& w) {
  const int64_t FF = w.size(0) / 2, K = w.size(1), half = TILE / 2, tiles = (FF + half - 1) / half;
  auto g = torch::zeros({tiles * half, K}, w.options()), u = torch::zeros({tiles * half, K}, w.options());
  g.narrow(0, 0, FF).copy_(w.narrow(0, 0, FF));
  u.narrow(0, 0, FF).copy_(w.narrow(0, FF, FF));
  return torch::cat({g.view({tiles, half, K}), u.view({tiles, half, K})}, 1).view({tiles * TILE, K});
}

// int4 tiles [T, G, I4_TILE_BYTES] uint8 for `rows` output rows (16 (T - 1) < rows <= 16 T)
void int4_proj(Proj& p, const torch::Tensor& w, int64_t rows) {
  TORCH_CHECK(CAN_INT4, "fused decode: int4 weights need AVX512-BF16");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == I4_TILE_BYTES && w.is_contiguous() && w.device().is_cpu(),
              "fused decode: int4 tiles [T, G, 320] uint8, contiguous, CPU");
  TORCH_CHECK(rows > I4_ROWS * (w.size(0) - 1) && rows <= I4_ROWS * w.size(0), "fused decode: int4 rows");
  p.kind = INT4;
  p.rows = rows;
  p.cols = w.size(1) * I4_GROUP;
  p.w = w;
}

// int8 tiles [T, cols, 32] (gate/up ones [T, cols, 2, 16]) the caller already holds (int8_tiles.cpp): read as they are
void int8_tiles_proj(Proj& p, const torch::Tensor& tiles, int64_t rows);

Proj make_proj(const torch::Tensor& w, const torch::Tensor& scale, const torch::Tensor& bias, bool pack_any,
               bool pack_bf16, bool gate_up, int64_t rows) {
  Proj p;
  if (w.scalar_type() == torch::kUInt8) {  // int4 tiles: never packed again
    int4_proj(p, w, rows);
    pack_any = pack_bf16 = false;
  } else if (w.scalar_type() == torch::kInt8 && w.dim() >= 3) {  // int8 tiles: shared, never packed again
    int8_tiles_proj(p, w, rows);
    pack_any = pack_bf16 = false;
  } else {
    TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.device().is_cpu(), "fused decode: weights [O, I], contiguous, CPU");
    TORCH_CHECK(rows == w.size(0), "fused decode: rows");
    p.rows = w.size(0);
    p.cols = w.size(1);
    p.w = w;
    if (w.scalar_type() == torch::kFloat32) p.kind = F32;
    else if (w.scalar_type() == torch::kBFloat16) p.kind = BF16;
    else if (w.scalar_type() == torch::kInt8) p.kind = INT8;
    else TORCH_CHECK(false, "fused decode: weights must be float32, bfloat16, int8 or int4 tiles (uint8)");
  }
  if (p.kind == INT8) {
    TORCH_CHECK(scale.numel() == p.rows, "fused decode: int8 weights need one scale per row");
    auto s = scale.to(torch::kFloat32).contiguous();
    p.scale.assign(s.data_ptr<float>(), s.data_ptr<float>() + p.rows);
  }
  const bool pack = (pack_bf16 && p.kind == BF16 && p.cols % 2 == 0) || (pack_any && p.kind != BF16);
  if (!p.shared) p.gate_up_tiles = pack && gate_up && bias.numel() == 0 && p.rows % 2 == 0;
  TORCH_CHECK(!p.gate_up_tiles || bias.numel() == 0, "fused decode: gate/up tiles have no bias");
  if (pack) p.packed = pack_tiles(p.gate_up_tiles ? gate_up_rows(w) : w, p.kind == BF16 ? 2 : 1);
  if (bias.numel()) {
    TORCH_CHECK(bias.numel() == p.rows, "fused decode: one bias per row");
    auto b = bias.to(torch::kFloat32).contiguous();
    p.bias.assign(b.data_ptr<float>(), b.data_ptr<float>() + p.rows);
  }
  return p;
}

// The three weight formats as one dot-product kernel's "block" operations (AVX-512): a block is
// BLK columns; `w` loads a weight block (widened where needed), `madd` adds the block's products
// with one input row to a float32 accumulator. Inputs: float32 rows, or for bf16 weights on
// AVX512-BF16 the rows' bf16 bits (vdpbf16ps multiplies bf16 pairs).
#if defined(__AVX512F__)
struct FloatInput {  // float32 input rows against weights widened to float32 blocks of 16: FMA
  using X = float;
  using WV = __m512;
  static constexpr int BLK = 16;
  static __m512 madd(__m512 acc, WV wv, const float* x) { return _mm512_fmadd_ps(wv, _mm512_loadu_ps(x), acc); }
};
struct F32Block : FloatInput {
  using W = float;
  static WV w(const float* p) { return _mm512_loadu_ps(p); }
};
struct Int8Block : FloatInput {  // int8 rows widened to float32 (the per-row scale is applied to the sum)
  using W = int8_t;
  static WV w(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};
#if defined(__AVX512BF16__)
struct BF16Block {
  using W = uint16_t;
  using X = uint16_t;
  using WV = __m512bh;
  static constexpr int BLK = 32;
  static WV w(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static __m512 madd(__m512 acc, WV wv, const uint16_t* x) { return _mm512_dpbf16_ps(acc, wv, (__m512bh)_mm512_loadu_si512(x)); }
};
#else
struct BF16Block : FloatInput {  // no AVX512-BF16: bf16 weights widened to float32, float32 inputs
  using W = uint16_t;
  static WV w(const uint16_t* p) { return load16(p); }
};
#endif

// One weight row dotted with NB input rows (stride S apart): out[b]. Per input row, two float32
// accumulators take alternate blocks (even blocks a0, odd a1; a ragged tail is one more block,
// zero-padded), summed at the end, then one horizontal sum: a (row, input) result depends on
// nothing but the two, whatever NB (so a batched row is bit for bit the single step); NB > 1 loads
// each weight block once for all inputs and gives the core NB x 2 independent chains. The two
// accumulators are named, not indexed by a running parity: indexed, the compiler kept them on the
// stack and every block paid a store-to-load round trip (what bounded int8 and batched steps).
// Rows are visited one after another (one sequential stream per thread): interleaving 4 rows, as
// a first version did, halved the bandwidth the hardware prefetcher gave a core on the AMD EPYC
// this was measured on (docs/speed.md round 8). PF > 0: each pair of blocks also prefetches the
// same columns PF rows ahead (software prefetch; nothing computed changes). With 4 input rows per
// weight row a core spends long enough on each row that the hardware prefetcher alone fell behind
// (docs/speed.md round 10: -17/-20% at B = 4/8); with 1-2 inputs the stream is bandwidth-bound and
// the extra instructions cost, so the caller asks for it only with NB = 4.
template <class T, int NB, int PF = 0>
inline void dot(const typename T::W* w, int64_t K, const typename T::X* x, int64_t S, float* out) {
  constexpr int BLK = T::BLK;
  __m512 a0[NB], a1[NB];
  for (int b = 0; b < NB; ++b) a0[b] = a1[b] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 2 * BLK <= K; k += 2 * BLK) {
    const typename T::WV w0 = T::w(w + k), w1 = T::w(w + k + BLK);
    if constexpr (PF > 0) {
      _mm_prefetch(reinterpret_cast<const char*>(w + PF * K + k), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + PF * K + k + BLK), _MM_HINT_T0);
    }
    for (int b = 0; b < NB; ++b) {
      a0[b] = T::madd(a0[b], w0, x + b * S + k);
      a1[b] = T::madd(a1[b], w1, x + b * S + k + BLK);
    }
  }
  bool odd = false;  // the next block goes to a1
  if (k + BLK <= K) {
    const typename T::WV w0 = T::w(w + k);
    for (int b = 0; b < NB; ++b) a0[b] = T::madd(a0[b], w0, x + b * S + k);
    k += BLK;
    odd = true;
  }
  if (k < K) {  // a ragged tail (none on the supported models): the block padded with zeros
    typename T::W wp[BLK] = {};
    std::memcpy(wp, w + k, sizeof(typename T::W) * (K - k));
    const typename T::WV wv = T::w(wp);
    for (int b = 0; b < NB; ++b) {
      typename T::X xp[BLK] = {};
      std::memcpy(xp, x + b * S + k, sizeof(typename T::X) * (K - k));
      if (odd) a1[b] = T::madd(a1[b], wv, xp);
      else a0[b] = T::madd(a0[b], wv, xp);
    }
  }
  for (int b = 0; b < NB; ++b) out[b] = _mm512_reduce_add_ps(_mm512_add_ps(a0[b], a1[b]));
}
// 16 rows' weights of one column as float32: float32 as they are, int8 widened (the per-row scale is
// applied to the sums after, in ``project_packed``, as ``dot``'s int8 rows are)
inline __m512 tile16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 tile16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// One tile of TILE packed rows (``pack_tiles``) against NB input rows (stride S apart): out[b * TILE
// + r]. Per column group: two 64-byte loads hold it for all 32 rows, the input's group is
// broadcast, and one vdpbf16ps (bf16: a column pair, both products) or FMA (float32, int8: one
// column) per 16 rows: each (row, input) sum is one float32 lane accumulating the groups in column order,
// whatever NB (a batched row is bit for bit the single step), with no horizontal sums. Against
// ``dot`` (weights row-major: a weight block load and an input block load per vdpbf16ps / FMA, so
// 4-8 inputs were bounded by the load ports) a weight load serves NB inputs and an input load (a
// 4-byte broadcast) 32 rows (docs/speed.md round 12, the default model's projections: bf16 for 8
// inputs 13.9 -> 8.6 ms, for one 9.2 -> 8.3; float32 33.0 -> 16.3 and 17.6 -> 16.6). Blocking 2
// rows x 4 inputs of the row-major layout instead was slower (two weight streams per thread).
template <int NB, class W>
inline void tile_dot(const W* t, int64_t K, const float* x, int64_t S, float* out) {
  __m512 a0[NB], a1[NB];  // rows 0-15, 16-31
  for (int b = 0; b < NB; ++b) a0[b] = a1[b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k, t += TILE) {
    const __m512 w0 = tile16(t), w1 = tile16(t + 16);  // widened once for the NB inputs
    for (int b = 0; b < NB; ++b) {
      const __m512 xv = _mm512_set1_ps(x[b * S + k]);
      a0[b] = _mm512_fmadd_ps(w0, xv, a0[b]);
      a1[b] = _mm512_fmadd_ps(w1, xv, a1[b]);
    }
  }
  for (int b = 0; b < NB; ++b) {
    _mm512_storeu_ps(out + b * TILE, a0[b]);
    _mm512_storeu_ps(out + b * TILE + 16, a1[b]);
  }
}
#if defined(__AVX512BF16__)
constexpr bool CAN_PACK_BF16 = true;
template <int NB>
inline void tile_dot(const uint16_t* t, int64_t K, const uint16_t* x, int64_t S, float* out) {
  __m512 a0[NB], a1[NB];  // rows 0-15, 16-31
  for (int b = 0; b < NB; ++b) a0[b] = a1[b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2, t += 2 * TILE) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(t), w1 = (__m512bh)_mm512_loadu_si512(t + TILE);
    for (int b = 0; b < NB; ++b) {
      int32_t pair;
      std::memcpy(&pair, x + b * S + k, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      a0[b] = _mm512_dpbf16_ps(a0[b], w0, xv);
      a1[b] = _mm512_dpbf16_ps(a1[b], w1, xv);
    }
  }
  for (int b = 0; b < NB; ++b) {
    _mm512_storeu_ps(out + b * TILE, a0[b]);
    _mm512_storeu_ps(out + b * TILE + 16, a1[b]);
  }
}
#else
constexpr bool CAN_PACK_BF16 = false;
#endif
constexpr bool CAN_PACK = true;
#else  // no AVX-512: plain loops (the compiler vectorises what it can), float32 inputs
constexpr bool CAN_PACK = false, CAN_PACK_BF16 = false;
struct F32Block { using W = float; using X = float; };
struct Int8Block { using W = int8_t; using X = float; };
struct BF16Block { using W = uint16_t; using X = float; };

inline float widen(float v) { return v; }
inline float widen(int8_t v) { return static_cast<float>(v); }
inline float widen(uint16_t v) { return float_of(v); }

template <class T, int NB, int PF = 0>
inline void dot(const typename T::W* w, int64_t K, const float* x, int64_t S, float* out) {
  for (int b = 0; b < NB; ++b) {
    float s = 0.f;
    for (int64_t k = 0; k < K; ++k) s += widen(w[k]) * x[b * S + k];
    out[b] = s;
  }
}
#endif

// What a projection does with each output value (after the int8 scale and the bias), inside its
// parallel region instead of a serial pass over the batch afterwards (each value the same either
// way: the same per-element arithmetic): STORE y = v; ROUND y = v rounded to bf16 (a bf16 stream);
// RESIDUAL y += v, y the residual stream [B, N] (a bf16 stream: y = bf16(y + bf16(v)), the torch
// step's two roundings); GATE_UP (packed gate/up tiles only) y [B, N / 2] = SiLU(gate) * up as
// ``silu_mul``, and its bf16 bits into ``bits``.
struct Epilogue {
  enum Kind { STORE, ROUND, RESIDUAL, GATE_UP };
  Kind kind = STORE;
  bool bf16 = false;        // the stream rounds to bf16
  uint16_t* bits = nullptr; // GATE_UP: the outputs' bf16 bits (null: not needed)
};

template <bool R>
inline float rdv(float v) {
  if constexpr (R) return bf16r(v);
  else return v;
}
// SiLU(g) * u for one unit, rounded where the torch step rounds: SiLU(g) = g / (1 + e^-g), e^-|g| by
// native.h's exp_neg
template <bool R>
inline float silu_times(float g, float u) {
  const float gj = rdv<R>(g), uj = rdv<R>(u);
  const float t = exp_neg(-std::fabs(gj));
  const float silu = gj >= 0.f ? gj / (1.f + t) : gj * t / (1.f + t);
  return rdv<R>(rdv<R>(silu) * uj);
}

// `ep` (STORE, ROUND, RESIDUAL) on n consecutive output rows of one input (dst = y + b * N + n0, v
// their values): the kind and the stream tested once, each loop vectorised
inline void finish_range(const Epilogue& ep, float* dst, const float* v, int64_t n) {
  if (ep.kind == Epilogue::RESIDUAL && ep.bf16) {
#pragma omp simd
    for (int64_t r = 0; r < n; ++r) dst[r] = bf16r(dst[r] + bf16r(v[r]));
  } else if (ep.kind == Epilogue::RESIDUAL) {
#pragma omp simd
    for (int64_t r = 0; r < n; ++r) dst[r] += v[r];
  } else if (ep.kind == Epilogue::ROUND && ep.bf16) {
#pragma omp simd
    for (int64_t r = 0; r < n; ++r) dst[r] = bf16r(v[r]);
  } else {
    std::memcpy(dst, v, sizeof(float) * n);
  }
}

template <class T>
inline const typename T::X* input(const float* x, const uint16_t* xb) {
  if constexpr (std::is_same_v<typename T::X, float>) return x;
  else return xb;
}

// y [B, rows] = x [B, cols] @ W^T (* scale) (+ bias), float32; x given as float32 and, for bf16
// weights, as bf16 bits (the same values). Rows split over torch's intra-op threads: `dynamic`, in
// chunks of about 1/8 of a thread's share that each thread takes from a shared counter as it
// finishes one (a thread the OS preempts, on a 2-core machine shared with the server's other
// threads, no longer holds up the whole region with its half; 0-9% faster steps, docs/speed.md
// round 10); else one contiguous range per thread (at::parallel_for, the reference). A row's value
// does not depend on the thread. Each weight row is read once for up to 4 input rows at a time
// (from L1 after the first 4).
// PF: the rows-ahead prefetch distance of the 4-input dot products (0: none; see ``dot``).
template <class T, int PF>
void project_rows(const Proj& p, int64_t B, const float* x, const uint16_t* xb, float* y, bool dynamic,
                  const Epilogue& ep) {
  const typename T::W* w = static_cast<const typename T::W*>(p.w.data_ptr());
  const typename T::X* in = input<T>(x, xb);
  const int64_t K = p.cols, N = p.rows;
  auto rows = [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      for (int64_t b = 0; b < B;) {
        float out[4];
        const int nb = B - b >= 4 ? 4 : (B - b >= 2 ? 2 : 1);
        if (nb == 4) dot<T, 4, PF>(w + n * K, K, in + b * K, K, out);
        else if (nb == 2) dot<T, 2>(w + n * K, K, in + b * K, K, out);
        else dot<T, 1>(w + n * K, K, in + b * K, K, out);
        for (int j = 0; j < nb; ++j) {
          float v = out[j];
          if (p.kind == INT8) v *= p.scale[n];
          if (!p.bias.empty()) v += p.bias[n];
          finish_range(ep, y + (b + j) * N + n, &v, 1);
        }
        b += nb;
      }
    }
  };
  const int threads = at::get_num_threads();
  if (!dynamic || threads == 1) {
    at::parallel_for(0, N, 16, rows);
    return;
  }
  const int64_t chunk = std::max<int64_t>(16, (N / (8 * threads) + 15) / 16 * 16);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t n0; (n0 = next.fetch_add(chunk)) < N;) rows(n0, std::min(N, n0 + chunk));
  });
}

#if defined(__AVX512F__)
// y [B, rows] = x [B, cols] @ W^T (* scale) (+ bias) from the packed tiles (``tile_dot``; W / X:
// float / float for float32 weights, int8_t / float for int8 ones, uint16_t / uint16_t for bf16
// weights and bits): tiles split over the threads as ``project_rows`` splits rows (chunks from a
// shared counter, or one static range each), inputs 8, 4, 2, 1 at a time. A row's value depends
// on neither.
template <class W, class X>
void project_packed(const Proj& p, int64_t B, const X* in, float* y, bool dynamic, const Epilogue& ep) {
  const W* packed = static_cast<const W*>(p.packed.data_ptr());
  const int64_t K = p.cols, N = p.rows, tiles = p.packed.numel() / (TILE * K), FF = N / 2, half = TILE / 2;
  auto run = [&](int64_t t0, int64_t t1) {
    alignas(64) float out[8 * TILE];
    for (int64_t t = t0; t < t1; ++t) {
      const W* tp = packed + t * TILE * K;
      const int64_t n0 = t * TILE, rows = std::min(TILE, N - n0);
      for (int64_t b = 0; b < B;) {
        const int nb = B - b >= 8 ? 8 : (B - b >= 4 ? 4 : (B - b >= 2 ? 2 : 1));
        if (nb == 8) tile_dot<8>(tp, K, in + b * K, K, out);
        else if (nb == 4) tile_dot<4>(tp, K, in + b * K, K, out);
        else if (nb == 2) tile_dot<2>(tp, K, in + b * K, K, out);
        else tile_dot<1>(tp, K, in + b * K, K, out);
        for (int j = 0; j < nb; ++j) {
          const float* o = out + j * TILE;
          alignas(64) float scaled[TILE];
          if (p.gate_up_tiles) {  // tile t: units t * 16.. (gate rows, then up rows; no bias)
            const int64_t u0 = t * half, units = std::min(half, FF - u0);
            if (p.kind == INT8) {
              for (int64_t r = 0; r < units; ++r) {
                scaled[r] = o[r] * p.scale[u0 + r];
                scaled[half + r] = o[half + r] * p.scale[FF + u0 + r];
              }
              o = scaled;
            }
            if (ep.kind == Epilogue::GATE_UP) {
              float* yr = y + (b + j) * FF + u0;
              if (ep.bf16) for (int64_t r = 0; r < units; ++r) yr[r] = silu_times<true>(o[r], o[half + r]);
              else for (int64_t r = 0; r < units; ++r) yr[r] = silu_times<false>(o[r], o[half + r]);
              if (ep.bits) for (int64_t r = 0; r < units; ++r) ep.bits[(b + j) * FF + u0 + r] = bf16_of(yr[r]);
            } else {  // the rows back in their order: gate units, then up units
              finish_range(ep, y + (b + j) * N + u0, o, units);
              finish_range(ep, y + (b + j) * N + FF + u0, o + half, units);
            }
            continue;
          }
          if (p.kind == INT8 || !p.bias.empty()) {  // dot * scale + bias, as ``project_rows``
            for (int64_t r = 0; r < rows; ++r) {
              float v = o[r];
              if (p.kind == INT8) v *= p.scale[n0 + r];
              if (!p.bias.empty()) v += p.bias[n0 + r];
              scaled[r] = v;
            }
            o = scaled;
          }
          finish_range(ep, y + (b + j) * N + n0, o, rows);
        }
        b += nb;
      }
    }
  };
  const int threads = at::get_num_threads();
  if (!dynamic || threads == 1) {
    at::parallel_for(0, tiles, 1, run);
    return;
  }
  const int64_t chunk = std::max<int64_t>(1, tiles / (8 * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t t0; (t0 = next.fetch_add(chunk)) < tiles;) run(t0, std::min(tiles, t0 + chunk));
  });
}
#endif

// Hands [0, n) to the intra-op threads as project_packed does (chunks from a shared counter when
// `dynamic`, else one static range each): run(i0, i1).
template <class F>
void for_tiles(int64_t n, bool dynamic, const F& run) {
  const int threads = at::get_num_threads();
  if (!dynamic || threads == 1) {
    at::parallel_for(0, n, 1, run);
    return;
  }
  const int64_t chunk = std::max<int64_t>(1, n / (8 * threads));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i0; (i0 = next.fetch_add(chunk)) < n;) run(i0, std::min(n, i0 + chunk));
  });
}

// y [B, rows] = x [B, cols] @ W^T (+ bias) from int4 tiles (``int4_tile_dot``: inputs as bf16 bits xb,
// their group sums from x, the same values), inputs 4, 2, 1 at a time; a row's value depends on
// neither the batch nor the thread.
void project_int4(const Proj& p, int64_t B, const float* x, const uint16_t* xb, float* y, bool dynamic,
                  const Epilogue& ep) {
  const uint8_t* base = p.w.data_ptr<uint8_t>();
  const int64_t K = p.cols, N = p.rows, G = K / I4_GROUP, tiles = p.w.size(0);
  std::vector<float> xs(B * G);  // [B, G]
  int4_group_sums(x, B, K, xs.data());
  for_tiles(tiles, dynamic, [&](int64_t t0, int64_t t1) {
    alignas(64) float out[4 * I4_ROWS], biased[I4_ROWS];
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* tp = base + t * G * I4_TILE_BYTES;
      const int64_t n0 = t * I4_ROWS, rows = std::min(I4_ROWS, N - n0);
      for (int64_t b = 0; b < B;) {
        const int nb = B - b >= 4 ? 4 : (B - b >= 2 ? 2 : 1);
        if (nb == 4) int4_tile_dot<4>(tp, G, xb + b * K, K, xs.data() + b * G, out);
        else if (nb == 2) int4_tile_dot<2>(tp, G, xb + b * K, K, xs.data() + b * G, out);
        else int4_tile_dot<1>(tp, G, xb + b * K, K, xs.data() + b * G, out);
        for (int j = 0; j < nb; ++j) {
          const float* o = out + j * I4_ROWS;
          if (!p.bias.empty()) {
            for (int64_t r = 0; r < rows; ++r) biased[r] = o[r] + p.bias[n0 + r];
            o = biased;
          }
          finish_range(ep, y + (b + j) * N + n0, o, rows);
        }
        b += nb;
      }
    }
  });
}

template <int PF>
void project_as(const Proj& p, int64_t B, const float* x, const uint16_t* xb, float* y, bool dynamic,
                const Epilogue& ep) {
  TORCH_CHECK(ep.kind != Epilogue::GATE_UP || p.gate_up_tiles, "fused decode: the gate/up epilogue needs gate/up tiles");
  if (p.kind == INT4) return project_int4(p, B, x, xb, y, dynamic, ep);
#if defined(__AVX512F__)
  if (p.packed.defined() && p.kind == F32) return project_packed<float, float>(p, B, x, y, dynamic, ep);
  if (p.packed.defined() && p.kind == INT8) return project_packed<int8_t, float>(p, B, x, y, dynamic, ep);
#if defined(__AVX512BF16__)
  if (p.packed.defined()) return project_packed<uint16_t, uint16_t>(p, B, xb, y, dynamic, ep);
#endif
#endif
  if (p.kind == F32) project_rows<F32Block, PF>(p, B, x, xb, y, dynamic, ep);
  else if (p.kind == BF16) project_rows<BF16Block, PF>(p, B, x, xb, y, dynamic, ep);
  else project_rows<Int8Block, PF>(p, B, x, xb, y, dynamic, ep);
}

constexpr int PREFETCH_ROWS = 2;  // the prefetch distance (rows) when on: measured best of 1-4 (round 10)

void project(const Proj& p, int64_t B, const float* x, const uint16_t* xb, float* y, bool prefetch, bool dynamic,
             const Epilogue& ep = Epilogue()) {
  if (prefetch) project_as<PREFETCH_ROWS>(p, B, x, xb, y, dynamic, ep);
  else project_as<0>(p, B, x, xb, y, dynamic, ep);
}

class Step {
 public:
  // weights / scales / biases: 4 per layer (qkv, o, gate_up, down) and the LM head last (empty
  // tensors where none); rows: each projection's output rows (int4 tiles are padded to 16); norms: 2
  // per layer (input, post-attention) and the final one, float32 [Dm];
  // windows: per layer, 0 = none.
  Step(std::vector<torch::Tensor> weights, std::vector<torch::Tensor> scales, std::vector<torch::Tensor> biases,
       std::vector<torch::Tensor> norms, std::vector<double> eps, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
       int64_t ff, std::vector<int64_t> windows, double scaling, bool bf16_stream, bool pack, std::vector<int64_t> rows)
      : H_q(n_heads), H_kv(n_kv_heads), D(head_dim), FF(ff), windows_(windows), scaling_(scaling), bf16_(bf16_stream) {
    L = static_cast<int64_t>(windows.size());
    TORCH_CHECK(L > 0 && static_cast<int64_t>(weights.size()) == 4 * L + 1 && scales.size() == weights.size() &&
                biases.size() == weights.size() && rows.size() == weights.size(),
                "fused decode: 4 projections per layer and the head");
    TORCH_CHECK(static_cast<int64_t>(norms.size()) == 2 * L + 1 && eps.size() == norms.size(), "fused decode: norms");
    TORCH_CHECK(H_kv > 0 && H_q % H_kv == 0 && H_q / H_kv <= MAX_G && D <= MAX_D && D % 2 == 0, "fused decode: heads/dim");
    for (size_t j = 0; j < weights.size(); ++j) {
      const bool gate_up = j % 4 == 2 && static_cast<int64_t>(j) < 4 * L;
      proj_.push_back(make_proj(weights[j], scales[j], biases[j], pack && CAN_PACK, pack && CAN_PACK_BF16, gate_up,
                                rows[j]));
    }
    Dm = proj_[0].cols;
    for (const Proj& p : proj_) bf16_weights_ = bf16_weights_ || p.kind == BF16 || p.kind == INT4;
    for (int64_t i = 0; i < L; ++i) {
      TORCH_CHECK(proj_[4 * i].rows == (H_q + 2 * H_kv) * D && proj_[4 * i].cols == Dm, "fused decode: qkv shape");
      TORCH_CHECK(proj_[4 * i + 1].rows == Dm && proj_[4 * i + 1].cols == H_q * D, "fused decode: o shape");
      TORCH_CHECK(proj_[4 * i + 2].rows == 2 * FF && proj_[4 * i + 2].cols == Dm, "fused decode: gate/up shape");
      TORCH_CHECK(proj_[4 * i + 3].rows == Dm && proj_[4 * i + 3].cols == FF, "fused decode: down shape");
    }
    TORCH_CHECK(proj_[4 * L].cols == Dm, "fused decode: head shape");
    for (size_t j = 0; j < norms.size(); ++j) {
      auto n = norms[j].to(torch::kFloat32).contiguous();
      TORCH_CHECK(n.numel() == Dm, "fused decode: norm weight size");
      norms_.emplace_back(n.data_ptr<float>(), n.data_ptr<float>() + Dm);
      eps_.push_back(static_cast<float>(eps[j]));
    }
  }

  int64_t vocab() const { return proj_[4 * L].rows; }
  // how many projections read packed tiles, and the bytes those copies hold (shared int8 tiles: none)
  int64_t packed_count() const {
    int64_t n = 0;
    for (const Proj& p : proj_) n += p.packed.defined();
    return n;
  }
  int64_t packed_bytes() const {
    int64_t n = 0;
    for (const Proj& p : proj_) n += p.packed.defined() && !p.shared ? p.packed.numel() * p.packed.element_size() : 0;
    return n;
  }
  // software prefetch in the projections of 4+ requests, rows handed out in chunks (both on by
  // default; off: the reference, one static range per thread; every value the same either way)
  void set_prefetch(bool on) { prefetch_ = on; }
  // the small ops after a projection inside its parallel region (``Epilogue``; on by default) or as
  // serial passes over the batch afterwards (off: the reference; every value the same either way)
  void set_epilogues(bool on) { epilogues_ = on; }
  void set_dynamic(bool on) { dynamic_ = on; }

  // hidden [B, Dm] (the embedded tokens, the stream's dtype), positions[b], cos/sin [B, D] (the
  // stream's dtype), ks[b]/vs[b] [L, H_kv, C, D] (float32 or bfloat16, rows contiguous). Writes each
  // request's K/V rows at its position; returns logits [B, V] float32.
  torch::Tensor forward(torch::Tensor hidden, std::vector<int64_t> positions, torch::Tensor cos, torch::Tensor sin,
                        std::vector<torch::Tensor> ks, std::vector<torch::Tensor> vs) const {
    const int64_t B = hidden.size(0);
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == Dm && B > 0, "fused decode: hidden [B, Dm]");
    TORCH_CHECK(static_cast<int64_t>(positions.size()) == B && static_cast<int64_t>(ks.size()) == B &&
                static_cast<int64_t>(vs.size()) == B, "fused decode: one position and K/V buffer per request");
    TORCH_CHECK(cos.dim() == 2 && cos.size(0) == B && cos.size(1) == D && sin.sizes() == cos.sizes(), "fused decode: cos/sin [B, D]");
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(ks[b].dim() == 4 && vs[b].dim() == 4 && ks[b].size(0) == L && vs[b].size(0) == L, "fused decode: k/v [L, H_kv, C, D]");
      check_kv(ks[b], vs[b], static_cast<int>(D), static_cast<int>(H_kv));
      TORCH_CHECK(ks[b].scalar_type() == ks[0].scalar_type(), "fused decode: one K/V dtype for the batch");
      TORCH_CHECK(0 <= positions[b] && positions[b] < ks[b].size(2) && positions[b] < vs[b].size(2), "fused decode: position");
    }
    std::vector<float> h = floats(hidden), cs = floats(cos), sn = floats(sin);  // [B, Dm], [B, D], [B, D]
    const int64_t n_qkv = (H_q + 2 * H_kv) * D, width = std::max(Dm, std::max(FF, H_q * D));
    std::vector<float> x(B * width), qkv(B * n_qkv), gu(B * 2 * FF);  // [B, .] each
    std::vector<uint16_t> xb(B * width), gub(B * FF);  // bf16 bits of x, of the MLP's activations
    std::vector<int64_t> starts(B), ends(B);  // each request's keys in the layer (its sliding window)
    Epilogue round, residual, gate_up;  // inside the projections' parallel regions (``Epilogue``)
    round.kind = Epilogue::ROUND;
    residual.kind = Epilogue::RESIDUAL;
    gate_up.kind = Epilogue::GATE_UP;
    round.bf16 = residual.bf16 = gate_up.bf16 = bf16_;
    gate_up.bits = bf16_weights_ ? gub.data() : nullptr;
    const Epilogue store;
    std::vector<float> tmp(epilogues_ ? 0 : B * Dm);  // [B, Dm] the reference path's projection outputs
    auto add_residual = [&]() {  // the reference path: h += tmp as a serial pass
      if (bf16_) residual_pass<true>(h.data(), tmp.data(), B * Dm);
      else residual_pass<false>(h.data(), tmp.data(), B * Dm);
    };
    for (int64_t i = 0; i < L; ++i) {
      norm(h.data(), B, 2 * i, x.data(), xb.data());
      project(proj_[4 * i], B, x.data(), xb.data(), qkv.data(), prefetch_, dynamic_, epilogues_ ? round : store);
      if (!epilogues_) round_all(qkv);
      for (int64_t b = 0; b < B; ++b) {
        float* row = qkv.data() + b * n_qkv;
        rope(row, H_q + H_kv, cs.data() + b * D, sn.data() + b * D);
        const int64_t p = positions[b];
        write_kv(ks[b], i, p, row + H_q * D);
        write_kv(vs[b], i, p, row + (H_q + H_kv) * D);
        const int64_t w = windows_[i];
        starts[b] = w > 0 ? std::max<int64_t>(0, p + 1 - w) : 0;
        ends[b] = p + 1;
      }
      attend(qkv.data(), n_qkv, ks, vs, i, starts, ends, x.data());
      round_all(x, B * H_q * D);
      bits(x.data(), B * H_q * D, xb.data());
      if (epilogues_) {
        project(proj_[4 * i + 1], B, x.data(), xb.data(), h.data(), prefetch_, dynamic_, residual);
      } else {
        project(proj_[4 * i + 1], B, x.data(), xb.data(), tmp.data(), prefetch_, dynamic_, store);
        add_residual();
      }
      norm(h.data(), B, 2 * i + 1, x.data(), xb.data());
      if (epilogues_ && proj_[4 * i + 2].gate_up_tiles) {  // SiLU(gate) * up in the projection: gu [B, FF], bits gub
        project(proj_[4 * i + 2], B, x.data(), xb.data(), gu.data(), prefetch_, dynamic_, gate_up);
        project(proj_[4 * i + 3], B, gu.data(), gub.data(), h.data(), prefetch_, dynamic_, residual);
        continue;
      }
      project(proj_[4 * i + 2], B, x.data(), xb.data(), gu.data(), prefetch_, dynamic_, store);
      for (int64_t b = 0; b < B; ++b) {
        if (bf16_) silu_mul<true>(gu.data() + b * 2 * FF, FF, x.data() + b * FF);
        else silu_mul<false>(gu.data() + b * 2 * FF, FF, x.data() + b * FF);
      }
      bits(x.data(), B * FF, xb.data());
      if (epilogues_) {
        project(proj_[4 * i + 3], B, x.data(), xb.data(), h.data(), prefetch_, dynamic_, residual);
      } else {
        project(proj_[4 * i + 3], B, x.data(), xb.data(), tmp.data(), prefetch_, dynamic_, store);
        add_residual();
      }
    }
    norm(h.data(), B, 2 * L, x.data(), xb.data());
    auto logits = torch::empty({B, vocab()}, torch::kFloat32);  // [B, V]
    float* lg = logits.data_ptr<float>();
    project(proj_[4 * L], B, x.data(), xb.data(), lg, prefetch_, dynamic_);
    if (bf16_) at::parallel_for(0, B * vocab(), 4096, [&](int64_t a, int64_t e) { round_range(lg + a, e - a); });
    return logits;
  }

 private:
  int64_t L = 0, Dm = 0, H_q, H_kv, D, FF;
  std::vector<int64_t> windows_;
  double scaling_;
  bool bf16_;
  bool prefetch_ = true;
  bool dynamic_ = true;
  bool epilogues_ = true;
  bool bf16_weights_ = false;  // some projection reads bf16 input bits (bf16, int4; int8 and float32 ones read floats)
  std::vector<Proj> proj_;
  std::vector<std::vector<float>> norms_;
  std::vector<float> eps_;

  // The small ops' loops come in two forms, a bf16 stream's (R: every value rounded where the torch
  // step rounds it, ``rdv``) and a float32 one, so no loop tests the stream per element and each
  // vectorises.
  static void round_range(float* v, int64_t n) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) v[j] = bf16r(v[j]);
  }
  void round_all(std::vector<float>& v, int64_t n = -1) const {
    if (bf16_) round_range(v.data(), n < 0 ? static_cast<int64_t>(v.size()) : n);
  }
  static void bits_of(const float* x, int64_t n, uint16_t* xb) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) xb[j] = bf16_of(x[j]);
  }
  void bits(const float* x, int64_t n, uint16_t* xb) const {  // the bf16 weights' input (values bf16 already)
    if (bf16_weights_) bits_of(x, n, xb);
  }
  // a [FF] = SiLU(g) * u for one row g|u [2 * FF]: SiLU(g) = g / (1 + e^-g), e^-|g| by native.h's exp_neg
  template <bool R>
  static void residual_pass(float* h, const float* t, int64_t n) {  // h = h + t, rounded as the torch step rounds
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) h[j] = rdv<R>(h[j] + rdv<R>(t[j]));
  }
  template <bool R>
  static void silu_mul(const float* gu, int64_t FF, float* a) {
#pragma omp simd
    for (int64_t j = 0; j < FF; ++j) a[j] = silu_times<R>(gu[j], gu[FF + j]);
  }
  static std::vector<float> floats(const torch::Tensor& t) {
    auto f = t.to(torch::kFloat32).contiguous();
    return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
  }

  // RMSNorm of each row into x (and its bf16 bits): float32 x * rsqrt(mean(x^2) + eps) * w; in a
  // bf16 stream HF's order: the normalised row rounded to bf16, then times w, rounded.
  void norm(const float* h, int64_t B, int64_t which, float* x, uint16_t* xb) const {
    const float* w = norms_[which].data();
    for (int64_t b = 0; b < B; ++b) {
      const float* hr = h + b * Dm;
      float ss = 0.f;
      for (int64_t j = 0; j < Dm; ++j) ss += hr[j] * hr[j];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(Dm) + eps_[which]);
      float* xr = x + b * Dm;
      if (bf16_) {
#pragma omp simd
        for (int64_t j = 0; j < Dm; ++j) xr[j] = bf16r(w[j] * bf16r(hr[j] * inv));
      } else {
#pragma omp simd
        for (int64_t j = 0; j < Dm; ++j) xr[j] = hr[j] * inv * w[j];
      }
    }
    bits(x, B * Dm, xb);
  }

  // The first n_heads heads of a row [heads, D], rotated in place: x * cos + rotate_half(x) * sin.
  void rope(float* row, int64_t heads, const float* c, const float* s) const {
    if (bf16_) rope_heads<true>(row, heads, D, c, s);
    else rope_heads<false>(row, heads, D, c, s);
  }
  template <bool R>
  static void rope_heads(float* row, int64_t heads, int64_t D, const float* c, const float* s) {
    const int64_t half = D / 2;
    alignas(64) float tmp[MAX_D];
    for (int64_t hh = 0; hh < heads; ++hh) {
      float* x = row + hh * D;
#pragma omp simd
      for (int64_t d = 0; d < half; ++d) tmp[d] = rdv<R>(rdv<R>(x[d] * c[d]) + rdv<R>(-x[d + half] * s[d]));
#pragma omp simd
      for (int64_t d = half; d < D; ++d) tmp[d] = rdv<R>(rdv<R>(x[d] * c[d]) + rdv<R>(x[d - half] * s[d]));
      std::memcpy(x, tmp, sizeof(float) * D);
    }
  }

  void write_kv(const torch::Tensor& buf, int64_t layer, int64_t p, const float* rows /* [H_kv, D] */) const {
    const int64_t s0 = buf.stride(0), s1 = buf.stride(1), s2 = buf.stride(2);
    if (buf.scalar_type() == torch::kFloat32) {
      float* base = buf.data_ptr<float>() + layer * s0 + p * s2;
      for (int64_t hh = 0; hh < H_kv; ++hh) std::memcpy(base + hh * s1, rows + hh * D, sizeof(float) * D);
    } else {
      uint16_t* base = reinterpret_cast<uint16_t*>(buf.data_ptr<at::BFloat16>()) + layer * s0 + p * s2;
      for (int64_t hh = 0; hh < H_kv; ++hh) bits_of(rows + hh * D, D, base + hh * s1);
    }
  }

  // decode_attention's arithmetic (attend_batch: every request's splits, tasks and merge those of
  // the single call alone, all the batch's tasks in one parallel loop) on layer `layer` of each
  // request's buffers; q = the first H_q heads of each qkv row (rows `stride` apart); out [B, H_q * D].
  void attend(const float* qkv, int64_t stride, const std::vector<torch::Tensor>& ks, const std::vector<torch::Tensor>& vs,
              int64_t layer, const std::vector<int64_t>& starts, const std::vector<int64_t>& ends, float* out) const {
    const int64_t B = static_cast<int64_t>(ks.size());
    std::vector<float> qs(B * H_q * D);  // [B, H_q, D] scaled
    for (int64_t b = 0; b < B; ++b)
      scaled_query(qkv + b * stride, false, D, 1, static_cast<int>(H_q), static_cast<int>(D), static_cast<float>(scaling_),
                   qs.data() + b * H_q * D);
    attend_batch(qs.data(), ks, vs, layer, starts.data(), ends.data(), static_cast<int>(H_q), static_cast<int>(H_kv),
                 static_cast<int>(D), out, false);
  }
};

}  // namespace fused

void register_fused_decode(pybind11::module_& m) {
  pybind11::class_<fused::Step>(m, "FusedStep")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<torch::Tensor>, std::vector<torch::Tensor>,
                          std::vector<torch::Tensor>, std::vector<double>, int64_t, int64_t, int64_t, int64_t,
                          std::vector<int64_t>, double, bool, bool, std::vector<int64_t>>())
      .def("packed_count", &fused::Step::packed_count)
      .def("packed_bytes", &fused::Step::packed_bytes)
      .def("set_prefetch", &fused::Step::set_prefetch)
      .def("set_dynamic", &fused::Step::set_dynamic)
      .def("set_epilogues", &fused::Step::set_epilogues)
      .def("forward", &fused::Step::forward, pybind11::call_guard<pybind11::gil_scoped_release>());
}
