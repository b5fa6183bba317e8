// The partial prefill's attention: query rows at sorted absolute positions over a request's KV rows,
// causal by position, optional hidden keys; tiles of 32 keys for 12 query vectors, bf16 pairs
// (vdpbf16ps) on AVX512-BF16. AVX-512 only: elsewhere prefill_attention_available() is false and
// the runner keeps SDPA. Python side: cachedrag/model/attention.py (prefill_attention).
#include "native.h"

#if defined(__AVX512F__)
namespace prefill {

constexpr int KT = 32;    // keys per tile: two 16-lane vectors
constexpr int RB = 16;    // query rows (positions) per task
constexpr int QG = 12;    // query vectors per score micro-kernel: 24 accumulators
constexpr int MAX_QG = 8; // query heads per KV head
constexpr int NQ_MAX = RB * MAX_QG + QG;  // query vectors of one task, padded

// Scores of QG query vectors (rows of qs, scaled, [QG][D]) against keys t0..t0+31 of the head's
// transposed K (kt [D][ld]): s [QG][KT]. One FMA with a broadcast query element per key vector.
template <int D>
inline void scores(const float* qs, const float* kt, int64_t ld, float* s) {
  __m512 a0[QG], a1[QG];
  for (int q = 0; q < QG; ++q) { a0[q] = _mm512_setzero_ps(); a1[q] = _mm512_setzero_ps(); }
  for (int d = 0; d < D; ++d) {
    const __m512 k0 = _mm512_loadu_ps(kt + d * ld), k1 = _mm512_loadu_ps(kt + d * ld + 16);
    for (int q = 0; q < QG; ++q) {
      const __m512 b = _mm512_set1_ps(qs[q * D + d]);
      a0[q] = _mm512_fmadd_ps(b, k0, a0[q]);
      a1[q] = _mm512_fmadd_ps(b, k1, a1[q]);
    }
  }
  for (int q = 0; q < QG; ++q) { _mm512_storeu_ps(s + q * KT, a0[q]); _mm512_storeu_ps(s + q * KT + 16, a1[q]); }
}

// o[q] += sum_j p[q][j] v[j] for QP query vectors over n value rows (v [n][D], D = 16 NV).
template <typename KV, int NV, int QP>
inline void values(const float* p, const KV* v, int n, float* o) {
  constexpr int D = 16 * NV;
  __m512 acc[QP][NV];
  for (int q = 0; q < QP; ++q) for (int c = 0; c < NV; ++c) acc[q][c] = _mm512_loadu_ps(o + q * D + 16 * c);
  for (int j = 0; j < n; ++j) {
    __m512 vx[NV];
    for (int c = 0; c < NV; ++c) vx[c] = load16(v + int64_t(j) * D + 16 * c);
    for (int q = 0; q < QP; ++q) {
      const __m512 b = _mm512_set1_ps(p[q * KT + j]);
      for (int c = 0; c < NV; ++c) acc[q][c] = _mm512_fmadd_ps(b, vx[c], acc[q][c]);
    }
  }
  for (int q = 0; q < QP; ++q) for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + q * D + 16 * c, acc[q][c]);
}

#if defined(__AVX512BF16__)
constexpr bool PAIRS = true;  // bf16 queries and K/V: products on bf16 pairs (vdpbf16ps: two a lane)

// scores<D> on bf16 pairs: QG query vectors as 32-bit words of two dims (qp [QG][D/2], unscaled)
// against keys t0..t0+31 of the head's K in pairs of dims by key (kp [D/2][ld] words): one
// vdpbf16ps per key vector and pair of dims (bf16 products are exact in float32), scaled once.
template <int D>
inline void scores_pairs(const uint32_t* qp, const uint32_t* kp, int64_t ld, float scale, float* s) {
  __m512 a0[QG], a1[QG];
  for (int q = 0; q < QG; ++q) { a0[q] = _mm512_setzero_ps(); a1[q] = _mm512_setzero_ps(); }
  for (int i = 0; i < D / 2; ++i) {
    const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + i * ld), k1 = (__m512bh)_mm512_loadu_si512(kp + i * ld + 16);
    for (int q = 0; q < QG; ++q) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[q * (D / 2) + i]));
      a0[q] = _mm512_dpbf16_ps(a0[q], b, k0);
      a1[q] = _mm512_dpbf16_ps(a1[q], b, k1);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int q = 0; q < QG; ++q) {
    _mm512_storeu_ps(s + q * KT, _mm512_mul_ps(a0[q], sc));
    _mm512_storeu_ps(s + q * KT + 16, _mm512_mul_ps(a1[q], sc));
  }
}

// values<> on bf16 pairs: o[q] += sum_j p[q][j] v[j] with p rounded to bf16 in pairs of keys
// (pp [QP][KT/2] words) and the tile's V in pairs of keys by dim (vp [KT/2][D] words), np pairs.
template <int NV, int QP>
inline void values_pairs(const uint32_t* pp, const uint32_t* vp, int np, float* o) {
  constexpr int D = 16 * NV;
  __m512 acc[QP][NV];
  for (int q = 0; q < QP; ++q) for (int c = 0; c < NV; ++c) acc[q][c] = _mm512_loadu_ps(o + q * D + 16 * c);
  for (int j = 0; j < np; ++j) {
    __m512bh vx[NV];
    for (int c = 0; c < NV; ++c) vx[c] = (__m512bh)_mm512_loadu_si512(vp + int64_t(j) * D + 16 * c);
    for (int q = 0; q < QP; ++q) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[q * (KT / 2) + j]));
      for (int c = 0; c < NV; ++c) acc[q][c] = _mm512_dpbf16_ps(acc[q][c], b, vx[c]);
    }
  }
  for (int q = 0; q < QP; ++q) for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + q * D + 16 * c, acc[q][c]);
}
#else
constexpr bool PAIRS = false;
#endif

template <bool PR> using Word = std::conditional_t<PR, uint32_t, float>;  // queries' and K's element
template <typename KV, bool PR> using VWord = std::conditional_t<PR, uint32_t, KV>;  // V's

// One task: the nq = rows x G query vectors of a block of rows (vector r*G+g: row r, query head g of
// this KV head) over keys 0..pos[last]; online softmax per key tile. Writes o (unnormalised), l.
// PR = false: qs scaled float32 [nq][D], kt K transposed to float32 [D][ld], v the head's V rows;
// PR = true (bf16 pairs): qs unscaled [nq][D/2] words, kt [D/2][ld] words, v [ld/2][D] words, and
// each tile's probabilities rounded to bf16 for the value products (float32 sums and softmax).
template <typename KV, int NV, bool PR, bool PV = PR>
void attend_block(const Word<PR>* qs, int nq, int G, const int64_t* pos, const Word<PR>* kt, int64_t ld,
                  const VWord<KV, PV>* v, const uint8_t* hidden, float scale, float* o, float* m, float* l) {
  constexpr int D = 16 * NV;
  constexpr int QP = NV == 4 ? 6 : 3;  // 24 value accumulators
  const int nqs = (nq + QG - 1) / QG * QG, nqv = (nq + QP - 1) / QP * QP;
  alignas(64) float s[NQ_MAX * KT];
  alignas(64) uint32_t pp[PV ? NQ_MAX * KT / 2 : 1];  // PR: the tile's probabilities, bf16 pairs of keys
  const int rows = nq / G;
  const int64_t kend = pos[rows - 1] + 1, kopen = hidden ? 0 : pos[0] + 1;  // keys < kopen: every row sees them
  for (int q = 0; q < nqv; ++q) { m[q] = -std::numeric_limits<float>::infinity(); l[q] = 0.f; }
  std::memset(o, 0, sizeof(float) * nqv * D);
  int first = 0;  // rows before it end before this tile: they see none of its keys and are skipped
  for (int64_t t0 = 0; t0 < kend; t0 += KT) {
    const int n = static_cast<int>(std::min<int64_t>(KT, kend - t0));
    while (pos[first] < t0) ++first;  // rows ascend; the last one reaches kend - 1 >= t0
    const int qa = first * G;  // the first query vector that sees a key here
    for (int q0 = qa / QG * QG; q0 < nqs; q0 += QG) {
      if constexpr (PR) {
#if defined(__AVX512BF16__)
        scores_pairs<D>(qs + q0 * (D / 2), kt + t0, ld, scale, s + q0 * KT);
#endif
      } else {
        scores<D>(qs + q0 * D, kt + t0, ld, s + q0 * KT);
      }
    }
    const bool masked = t0 + KT > kopen;
    for (int q = qa; q < nq; ++q) {
      float* sq = s + q * KT;
      if (masked) {  // keys past the row's position, past the tile, or hidden
        const int64_t lim = std::min<int64_t>(n, pos[q / G] + 1 - t0);
        for (int j = 0; j < KT; ++j)
          if (j >= lim || (hidden && hidden[t0 + j])) sq[j] = -std::numeric_limits<float>::infinity();
      }
      const float tmax = std::max(m[q], _mm512_reduce_max_ps(_mm512_max_ps(_mm512_loadu_ps(sq), _mm512_loadu_ps(sq + 16))));
      if (tmax == -std::numeric_limits<float>::infinity()) {  // nothing visible to this row yet
        std::memset(sq, 0, sizeof(float) * KT);
        continue;
      }
      const __m512 tm = _mm512_set1_ps(tmax);
      const __m512 e0 = exp16_neg(_mm512_sub_ps(_mm512_loadu_ps(sq), tm));
      const __m512 e1 = exp16_neg(_mm512_sub_ps(_mm512_loadu_ps(sq + 16), tm));
      _mm512_storeu_ps(sq, e0);
      _mm512_storeu_ps(sq + 16, e1);
      const float corr = m[q] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m[q] - tmax);
      l[q] = l[q] * corr + _mm512_reduce_add_ps(_mm512_add_ps(e0, e1));
      m[q] = tmax;
      if (corr != 1.f) {
        const __m512 cv = _mm512_set1_ps(corr);
        for (int c = 0; c < NV; ++c) _mm512_storeu_ps(o + q * D + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(o + q * D + 16 * c), cv));
      }
    }
    const int qv = qa / QP * QP;  // value groups from the one holding qa; vectors outside [qa, nq) add zeros
    for (int q = qv; q < qa; ++q) std::memset(s + q * KT, 0, sizeof(float) * KT);
    for (int q = nq; q < nqv; ++q) std::memset(s + q * KT, 0, sizeof(float) * KT);
    if constexpr (PV) {
#if defined(__AVX512BF16__)
      for (int q = qv; q < nqv; ++q)  // round to nearest even; word j holds keys 2j, 2j + 1
        _mm512_storeu_si512(pp + q * (KT / 2), (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + q * KT + 16), _mm512_loadu_ps(s + q * KT)));
      for (int q0 = qv; q0 < nqv; q0 += QP) values_pairs<NV, QP>(pp + q0 * (KT / 2), v + t0 / 2 * D, (n + 1) / 2, o + q0 * D);
#endif
    } else {
      for (int q0 = qv; q0 < nqv; q0 += QP) values<KV, NV, QP>(s + q0 * KT, v + t0 * D, n, o + q0 * D);
    }
  }
}

}  // namespace prefill

// q [H_q, T, D] (float32 or bfloat16, last dim contiguous), k/v [H_kv, C, D] (float32 or bfloat16,
// rows contiguous), positions int64 [T] ascending and < kv_len, hidden uint8 [kv_len] (1: no query
// sees that key) or empty -> [T, H_q*D] in q's dtype. Query row t sees keys j <= positions[t].
// `pairs` (with bf16 q and K/V on an AVX512-BF16 build; otherwise everything widens to float32):
// 0 widens everything; 1 computes the scores on bf16 pairs (the products exact, only the order of
// the sums differs); 2 the value products too, the probabilities rounded to bf16 for them.
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor positions,
                                int64_t kv_len, double scale, torch::Tensor hidden, int64_t pairs) {
  using namespace prefill;
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_attention: q [H_q, T, D], k/v [H_kv, C, D]");
  const int H_q = q.size(0), D = q.size(2), H_kv = k.size(0);
  const int64_t T = q.size(1);
  TORCH_CHECK(D == 64 || D == 128, "prefill_attention: head dim 64 or 128");
  TORCH_CHECK(H_kv > 0 && H_q % H_kv == 0 && H_q / H_kv <= MAX_QG, "prefill_attention: at most 8 query heads per KV head");
  const int G = H_q / H_kv;
  TORCH_CHECK(q.stride(2) == 1, "prefill_attention: q's last dim must be contiguous");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16, "prefill_attention: q must be float32 or bfloat16");
  check_kv(k, v, D, H_kv);
  TORCH_CHECK(0 < kv_len && kv_len <= k.size(1) && kv_len <= v.size(1), "prefill_attention: kv_len");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.dim() == 1 && positions.size(0) == T,
              "prefill_attention: positions int64 [T]");
  auto pos_c = positions.contiguous();
  const int64_t* pos = pos_c.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < kv_len && (t == 0 || pos[t] > pos[t - 1]), "prefill_attention: positions must ascend within [0, kv_len)");
  TORCH_CHECK(hidden.numel() == 0 || (hidden.scalar_type() == torch::kUInt8 && hidden.dim() == 1 && hidden.size(0) >= kv_len && hidden.is_contiguous()),
              "prefill_attention: hidden uint8 [kv_len]");
  auto out = torch::empty({T, static_cast<int64_t>(H_q) * D}, q.options());  // [T, H_q*D]
  if (T == 0) return out;
  const uint8_t* hid = hidden.numel() ? hidden.data_ptr<uint8_t>() : nullptr;
  const bool kv_bf16 = k.scalar_type() == torch::kBFloat16, q_bf16 = q.scalar_type() == torch::kBFloat16;
  const int64_t kend = pos[T - 1] + 1;
  const int64_t ld = (kend + KT - 1) / KT * KT;  // transposed K row length, zero padded to whole tiles
  const bool pr = PAIRS && pairs > 0 && kv_bf16 && q_bf16, pv = pr && pairs > 1;
  // 1. each head's K transposed to float32 [D][ld], so a score tile is FMAs on whole key vectors;
  //    with pairs, K as [D/2][ld] words (dims 2i, 2i+1 of key j) and V as [ld/2][D] words (keys
  //    2j, 2j+1 of dim d), zero past kend
  std::vector<float> kt(pr ? 0 : static_cast<size_t>(H_kv) * D * ld);
  std::vector<uint32_t> kp(pr ? static_cast<size_t>(H_kv) * D / 2 * ld : 0), vp(pv ? static_cast<size_t>(H_kv) * ld / 2 * D : 0);
  const int64_t nb = (ld + 63) / 64;
  at::parallel_for(0, H_kv * nb, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t h = t / nb, j0 = (t % nb) * 64, j1 = std::min(ld, j0 + 64);
      if (pr) {
        const uint16_t* kh = reinterpret_cast<const uint16_t*>(k.data_ptr()) + h * k.stride(0);
        const uint16_t* vh = reinterpret_cast<const uint16_t*>(v.data_ptr()) + h * v.stride(0);
        uint32_t* kd = kp.data() + h * (D / 2) * ld;
        uint32_t* vd = vp.data() + h * (ld / 2) * D;
        for (int64_t j = j0; j < j1; ++j) {
          uint32_t word[MAX_D / 2];
          if (j < kend) std::memcpy(word, kh + j * D, sizeof(uint16_t) * D);
          else std::memset(word, 0, sizeof(uint16_t) * D);
          for (int i = 0; i < D / 2; ++i) kd[i * ld + j] = word[i];
        }
        for (int64_t j = j0; pv && j < j1; j += 2) {  // j0 and ld are even: word d = (v[j][d], v[j + 1][d])
          uint32_t* dst = vd + (j / 2) * D;
          const __m256i zero = _mm256_setzero_si256();
          for (int d = 0; d < D; d += 16) {
            const __m256i a = j < kend ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vh + j * D + d)) : zero;
            const __m256i b = j + 1 < kend ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vh + (j + 1) * D + d)) : zero;
            _mm512_storeu_si512(dst + d, _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
          }
        }
        continue;
      }
      float* dst = kt.data() + h * D * ld;
      for (int64_t j = j0; j < j1; ++j) {
        if (j >= kend) { for (int d = 0; d < D; ++d) dst[d * ld + j] = 0.f; continue; }
        if (kv_bf16) {
          const uint16_t* src = reinterpret_cast<const uint16_t*>(k.data_ptr()) + h * k.stride(0) + j * D;
          for (int d = 0; d < D; ++d) dst[d * ld + j] = load(src, d);
        } else {
          const float* src = k.data_ptr<float>() + h * k.stride(0) + j * D;
          for (int d = 0; d < D; ++d) dst[d * ld + j] = src[d];
        }
      }
    }
  });
  // 2. tasks (block of RB rows, KV head), the longest (last) blocks first, handed out by a counter
  const int64_t blocks = (T + RB - 1) / RB, tasks = blocks * H_kv;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max(1, at::get_num_threads());
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> qs(static_cast<size_t>(NQ_MAX) * D, 0.f), o(static_cast<size_t>(NQ_MAX) * D), m(NQ_MAX), l(NQ_MAX);
    std::vector<uint32_t> qp(pr ? static_cast<size_t>(NQ_MAX) * D / 2 : 0, 0u);  // pairs: bf16 rows as words, unscaled
    for (int64_t t = next++; t < tasks; t = next++) {
      const int64_t b = blocks - 1 - t / H_kv, r0 = b * RB, r1 = std::min(T, r0 + RB);
      const int h = static_cast<int>(t % H_kv);
      const int nq = static_cast<int>(r1 - r0) * G;
      for (int64_t r = r0; r < r1; ++r)
        for (int g = 0; g < G; ++g) {
          float* dst = qs.data() + ((r - r0) * G + g) * D;
          const int64_t row = (static_cast<int64_t>(h) * G + g) * q.stride(0) + r * q.stride(1);  // q's elements
          if (q_bf16) {
            const at::BFloat16* src = static_cast<const at::BFloat16*>(q.data_ptr()) + row;
            if (pr) std::memcpy(qp.data() + ((r - r0) * G + g) * (D / 2), src, sizeof(uint16_t) * D);
            else for (int d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * sc;
          } else {
            const float* src = q.data_ptr<float>() + row;
            for (int d = 0; d < D; ++d) dst[d] = src[d] * sc;
          }
        }
      if (pr) {
        std::memset(qp.data() + static_cast<size_t>(nq) * D / 2, 0, sizeof(uint32_t) * (NQ_MAX - nq) * D / 2);
        const uint32_t* kh = kp.data() + static_cast<int64_t>(h) * (D / 2) * ld;
        if (pv) {
          const uint32_t* vh = vp.data() + static_cast<int64_t>(h) * (ld / 2) * D;
          if (D == 64) attend_block<uint16_t, 4, true>(qp.data(), nq, G, pos + r0, kh, ld, vh, hid, sc, o.data(), m.data(), l.data());
          else attend_block<uint16_t, 8, true>(qp.data(), nq, G, pos + r0, kh, ld, vh, hid, sc, o.data(), m.data(), l.data());
        } else {
          const uint16_t* vh = reinterpret_cast<const uint16_t*>(v.data_ptr()) + h * v.stride(0);
          if (D == 64) attend_block<uint16_t, 4, true, false>(qp.data(), nq, G, pos + r0, kh, ld, vh, hid, sc, o.data(), m.data(), l.data());
          else attend_block<uint16_t, 8, true, false>(qp.data(), nq, G, pos + r0, kh, ld, vh, hid, sc, o.data(), m.data(), l.data());
        }
      } else {
        std::memset(qs.data() + static_cast<size_t>(nq) * D, 0, sizeof(float) * (NQ_MAX - nq) * D);
        const float* kh = kt.data() + static_cast<int64_t>(h) * D * ld;
        if (kv_bf16) {
          const uint16_t* vh = reinterpret_cast<const uint16_t*>(v.data_ptr()) + h * v.stride(0);
          if (D == 64) attend_block<uint16_t, 4, false>(qs.data(), nq, G, pos + r0, kh, ld, vh, hid, sc, o.data(), m.data(), l.data());
          else attend_block<uint16_t, 8, false>(qs.data(), nq, G, pos + r0, kh, ld, vh, hid, sc, o.data(), m.data(), l.data());
        } else {
          const float* vh = v.data_ptr<float>() + h * v.stride(0);
          if (D == 64) attend_block<float, 4, false>(qs.data(), nq, G, pos + r0, kh, ld, vh, hid, sc, o.data(), m.data(), l.data());
          else attend_block<float, 8, false>(qs.data(), nq, G, pos + r0, kh, ld, vh, hid, sc, o.data(), m.data(), l.data());
        }
      }
      for (int64_t r = r0; r < r1; ++r)
        for (int g = 0; g < G; ++g) {
          const int qq = static_cast<int>(r - r0) * G + g;
          const float inv = l[qq] > 0.f ? 1.f / l[qq] : 0.f;  // a row that sees no key: zeros
          const int64_t off = r * H_q * D + (static_cast<int64_t>(h) * G + g) * D;
          if (q_bf16) {
            at::BFloat16* dst = static_cast<at::BFloat16*>(out.data_ptr()) + off;
            for (int d = 0; d < D; ++d) dst[d] = at::BFloat16(o[qq * D + d] * inv);
          } else {
            float* dst = out.data_ptr<float>() + off;
            for (int d = 0; d < D; ++d) dst[d] = o[qq * D + d] * inv;
          }
        }
    }
  });
  return out;
}
bool prefill_attention_available() { return true; }
#else
torch::Tensor prefill_attention(torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, double, torch::Tensor, int64_t) {
  TORCH_CHECK(false, "prefill_attention: built without AVX-512");
  return {};
}
bool prefill_attention_available() { return false; }
#endif
