// Split-K decode attention: one query row per head over a request's KV rows (float32 or bfloat16),
// every thread a key range of every KV head (flash-decoding), partial max / sum / output merged
// after; B requests' tasks in one parallel loop, each request's rows bit for bit its single call.
// Python side: cachedrag/model/attention.py (decode_attention, decode_attention_batch).
#include "native.h"

namespace {

constexpr int TILE = 64;       // keys whose scores are held at once (per query head)

// One task: KV head `h`, keys [j0, j1). Writes per query head g: running max m, sum l, acc [D].
// DC: the head dim when known at compile time (64, 128: fully unrolled rows), 0 = runtime D.
template <typename KV, int DC>
void attend_range(const float* q /* [G, D] scaled */, const KV* k, const KV* v, int64_t j0, int64_t j1,
                  int G, int D_, float* m_out, float* l_out, float* acc_out /* [G, D] */) {
  const int D = DC ? DC : D_;
  float m[MAX_G], l[MAX_G];
  alignas(64) float acc[MAX_G * MAX_D];
  alignas(64) float s[MAX_G * TILE];
  for (int g = 0; g < G; ++g) { m[g] = -std::numeric_limits<float>::infinity(); l[g] = 0.f; }
  for (int i = 0; i < G * D; ++i) acc[i] = 0.f;
  for (int64_t t0 = j0; t0 < j1; t0 += TILE) {
    const int n = static_cast<int>(std::min<int64_t>(TILE, j1 - t0));
    for (int j = 0; j < n; ++j) {            // scores: each K row read once for the G query heads
      const KV* kr = k + (t0 + j) * D;
      alignas(64) float kf[MAX_D];
#pragma omp simd
      for (int d = 0; d < D; ++d) kf[d] = load(kr, d);
      for (int g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < D; ++d) dot += qg[d] * kf[d];
        s[g * TILE + j] = dot;
      }
    }
    for (int g = 0; g < G; ++g) {            // online softmax: rescale what came before
      float* sg = s + g * TILE;
      float tmax = m[g];
      for (int j = 0; j < n; ++j) tmax = std::max(tmax, sg[j]);
      const float corr = m[g] == -std::numeric_limits<float>::infinity() ? 0.f : exp_neg(m[g] - tmax);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < n; ++j) { sg[j] = exp_neg(sg[j] - tmax); sum += sg[j]; }
      l[g] = l[g] * corr + sum;
      m[g] = tmax;
      if (corr != 1.f) {
        float* ag = acc + g * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) ag[d] *= corr;
      }
    }
    for (int j = 0; j < n; ++j) {            // values: each V row read once for the G query heads
      const KV* vr = v + (t0 + j) * D;
      alignas(64) float vf[MAX_D];
#pragma omp simd
      for (int d = 0; d < D; ++d) vf[d] = load(vr, d);
      for (int g = 0; g < G; ++g) {
        const float p = s[g * TILE + j];
        float* ag = acc + g * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) ag[d] += p * vf[d];
      }
    }
  }
  for (int g = 0; g < G; ++g) { m_out[g] = m[g]; l_out[g] = l[g]; }
  std::memcpy(acc_out, acc, sizeof(float) * G * D);
}

#if defined(__AVX512F__)
// The same task with AVX-512 intrinsics, for head dims of 16*NV and G query heads per KV head known
// at compile time (q and the G accumulators stay in registers; a score is one FMA chain per row and
// one horizontal sum; the softmax runs on 16 scores at a time).
template <typename KV, int NV, int G>
void attend_avx512(const float* q, const KV* k, const KV* v, int64_t j0, int64_t j1,
                   float* m_out, float* l_out, float* acc_out) {
  constexpr int D = 16 * NV;
  __m512 qv[G][NV], acc[G][NV];
  float m[G], l[G];
  alignas(64) float s[G][TILE];
  for (int g = 0; g < G; ++g) {
    m[g] = -std::numeric_limits<float>::infinity();
    l[g] = 0.f;
    for (int c = 0; c < NV; ++c) { qv[g][c] = _mm512_loadu_ps(q + g * D + 16 * c); acc[g][c] = _mm512_setzero_ps(); }
  }
  for (int64_t t0 = j0; t0 < j1; t0 += TILE) {
    const int n = static_cast<int>(std::min<int64_t>(TILE, j1 - t0));
    for (int j = 0; j < n; ++j) {
      const KV* kr = k + (t0 + j) * D;
      __m512 kx[NV];
      for (int c = 0; c < NV; ++c) kx[c] = load16(kr + 16 * c);
      for (int g = 0; g < G; ++g) {
        __m512 t = _mm512_mul_ps(qv[g][0], kx[0]);
        for (int c = 1; c < NV; ++c) t = _mm512_fmadd_ps(qv[g][c], kx[c], t);
        s[g][j] = _mm512_reduce_add_ps(t);
      }
    }
    const int nb = (n + 15) / 16;
    for (int g = 0; g < G; ++g) {
      __m512 mx = _mm512_set1_ps(m[g]);
      for (int b = 0; b < nb; ++b) {
        const __mmask16 mk = n - 16 * b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - 16 * b)) - 1);
        mx = _mm512_mask_max_ps(mx, mk, mx, _mm512_loadu_ps(&s[g][16 * b]));
      }
      const float tmax = _mm512_reduce_max_ps(mx);
      const float corr = m[g] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m[g] - tmax);
      const __m512 tm = _mm512_set1_ps(tmax);
      __m512 sum = _mm512_setzero_ps();
      for (int b = 0; b < nb; ++b) {
        const __mmask16 mk = n - 16 * b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - 16 * b)) - 1);
        const __m512 e = _mm512_maskz_mov_ps(mk, exp16_neg(_mm512_sub_ps(_mm512_loadu_ps(&s[g][16 * b]), tm)));
        _mm512_storeu_ps(&s[g][16 * b], e);
        sum = _mm512_add_ps(sum, e);
      }
      l[g] = l[g] * corr + _mm512_reduce_add_ps(sum);
      m[g] = tmax;
      if (corr != 1.f) {
        const __m512 cv = _mm512_set1_ps(corr);
        for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], cv);
      }
    }
    for (int j = 0; j < n; ++j) {
      const KV* vr = v + (t0 + j) * D;
      __m512 vx[NV];
      for (int c = 0; c < NV; ++c) vx[c] = load16(vr + 16 * c);
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(s[g][j]);
        for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_fmadd_ps(p, vx[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    m_out[g] = m[g];
    l_out[g] = l[g];
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc_out + g * D + 16 * c, acc[g][c]);
  }
}

template <typename KV, int NV>
bool attend_avx512_g(const float* q, const KV* k, const KV* v, int64_t j0, int64_t j1, int G,
                     float* m, float* l, float* acc) {
  switch (G) {
#define CACHEDRAG_G(N) case N: attend_avx512<KV, NV, N>(q, k, v, j0, j1, m, l, acc); return true;
    CACHEDRAG_G(1) CACHEDRAG_G(2) CACHEDRAG_G(3) CACHEDRAG_G(4) CACHEDRAG_G(5) CACHEDRAG_G(6) CACHEDRAG_G(7) CACHEDRAG_G(8)
#undef CACHEDRAG_G
    default: return false;
  }
}
#endif

template <typename KV>
__attribute__((noinline)) void attend_any(  // one copy: the single and batched entries run the same code
    const float* q, const KV* k, const KV* v, int64_t j0, int64_t j1, int G, int D, float* m, float* l, float* acc) {
#if defined(__AVX512F__)
  if (D == 64 && attend_avx512_g<KV, 4>(q, k, v, j0, j1, G, m, l, acc)) return;
  if (D == 128 && attend_avx512_g<KV, 8>(q, k, v, j0, j1, G, m, l, acc)) return;
#endif
  if (D == 64) attend_range<KV, 64>(q, k, v, j0, j1, G, D, m, l, acc);
  else if (D == 128) attend_range<KV, 128>(q, k, v, j0, j1, G, D, m, l, acc);
  else attend_range<KV, 0>(q, k, v, j0, j1, G, D, m, l, acc);
}

// Key ranges per KV head: the fewest that give every thread the same number of tasks, doubled while
// each thread would still get <= 2 tasks of >= 512 keys; never ranges under 64 keys.
int64_t auto_splits(int H_kv, int64_t T) {
  const int threads = std::max(1, at::get_num_threads());
  int64_t splits = threads / std::gcd(threads, H_kv);
  while (H_kv * splits * 2 <= threads * 4 && T / (splits * 2) >= 512) splits *= 2;
  return std::max<int64_t>(1, std::min<int64_t>(splits, T / 64));
}

// The query rows of one request, scaled, as float32 [H_q, D] (q float32 or bfloat16, any strides).
// Not inlined, like merge_splits: the single and the batched entry run the same machine code, so a
// request's output is the same bits through either.
__attribute__((noinline)) void scaled_query(const void* q, bool q_bf16, int64_t s0, int64_t s1, int H_q, int D,
                                            float scale, float* qs) {
  const at::BFloat16* qb = q_bf16 ? static_cast<const at::BFloat16*>(q) : nullptr;
  const float* qf = q_bf16 ? nullptr : static_cast<const float*>(q);
  for (int h = 0; h < H_q; ++h)
    for (int d = 0; d < D; ++d)
      qs[h * D + d] = (qb ? static_cast<float>(qb[h * s0 + d * s1]) : qf[h * s0 + d * s1]) * scale;
}

// Merge one request's splits: out = sum e^(m_s - M) acc_s / sum e^(m_s - M) l_s, written as [H_q, D]
// rows at `out` in float32 or bfloat16 (round to nearest even).
__attribute__((noinline)) void merge_splits(const float* m, const float* l, const float* acc, int H_kv, int G, int D,
                                            int64_t splits, void* out, bool out_bf16) {
  float o[MAX_D];
  for (int h = 0; h < H_kv; ++h) {
    for (int g = 0; g < G; ++g) {
      float M = -std::numeric_limits<float>::infinity();
      for (int s = 0; s < splits; ++s) M = std::max(M, m[(h * splits + s) * G + g]);
      float L = 0.f;
      for (int d = 0; d < D; ++d) o[d] = 0.f;
      for (int s = 0; s < splits; ++s) {
        const int64_t t = static_cast<int64_t>(h) * splits + s;
        if (l[t * G + g] == 0.f) continue;
        const float w = std::exp(m[t * G + g] - M);
        L += w * l[t * G + g];
        const float* a = acc + (t * G + g) * D;
        for (int d = 0; d < D; ++d) o[d] += w * a[d];
      }
      const float inv = 1.f / L;
      const int64_t row = (static_cast<int64_t>(h) * G + g) * D;
      if (out_bf16) {
        at::BFloat16* ob = static_cast<at::BFloat16*>(out) + row;
        for (int d = 0; d < D; ++d) ob[d] = at::BFloat16(o[d] * inv);
      } else {
        float* of = static_cast<float*>(out) + row;
        for (int d = 0; d < D; ++d) of[d] = o[d] * inv;
      }
    }
  }
}

}  // namespace

// The attention of B requests (one is the single call) in ONE parallel_for: request b's scaled
// float32 query rows at qs + b*H_q*D, its whole buffers ks[b] / vs[b] [L, H_kv, C, D] (one dtype
// for all, rows contiguous: checked by the callers) at `layer`, keys starts[b]..ends[b]-1; writes
// its [H_q, D] rows at out + b*H_q*D (float32 or bfloat16). Each request's splits (key ranges per KV
// head: `splits`, 0 = auto_splits of its own length), tasks and merge depend on that request alone,
// so request b's rows are bit for bit the single call's, whatever the batch.
void attend_batch(const float* qs, const std::vector<torch::Tensor>& ks, const std::vector<torch::Tensor>& vs,
                  int64_t layer, const int64_t* starts, const int64_t* ends, int H_q, int H_kv, int D, void* out,
                  bool out_bf16, int64_t splits_given) {  // splits_given: 0 by default (native.h)
  const int64_t B = static_cast<int64_t>(ks.size());
  const int G = H_q / H_kv;
  const bool kv_f32 = ks[0].scalar_type() == torch::kFloat32;
  std::vector<const char*> k(B), v(B);  // request b's layer
  for (int64_t b = 0; b < B; ++b) {
    k[b] = static_cast<const char*>(ks[b].data_ptr()) + layer * ks[b].stride(0) * ks[b].element_size();
    v[b] = static_cast<const char*>(vs[b].data_ptr()) + layer * vs[b].stride(0) * vs[b].element_size();
  }
  std::vector<int64_t> splits(B), first(B + 1, 0);  // request b's tasks: first[b] .. first[b + 1] - 1
  for (int64_t b = 0; b < B; ++b) {
    splits[b] = splits_given > 0 ? splits_given : auto_splits(H_kv, ends[b] - starts[b]);
    first[b + 1] = first[b] + H_kv * splits[b];
  }
  const int64_t tasks = first[B];
  std::vector<float> m(tasks * G), l(tasks * G), acc(tasks * G * D);
  at::parallel_for(0, tasks, 1, [&](int64_t lo, int64_t hi) {
    int64_t b = std::upper_bound(first.begin(), first.end(), lo) - first.begin() - 1;
    for (int64_t task = lo; task < hi; ++task) {
      while (task >= first[b + 1]) ++b;
      const int64_t local = task - first[b], sp_n = splits[b];
      const int h = static_cast<int>(local / sp_n), sp = static_cast<int>(local % sp_n);
      const int64_t T = ends[b] - starts[b], per = (T + sp_n - 1) / sp_n;
      const int64_t j0 = starts[b] + sp * per, j1 = std::min(ends[b], j0 + per);
      float* mt = m.data() + task * G;
      float* lt = l.data() + task * G;
      float* at = acc.data() + task * G * D;
      if (j0 >= j1) {
        for (int g = 0; g < G; ++g) { mt[g] = -std::numeric_limits<float>::infinity(); lt[g] = 0.f; }
        std::memset(at, 0, sizeof(float) * G * D);
        continue;
      }
      const float* qh = qs + b * H_q * D + static_cast<int64_t>(h) * G * D;
      const int64_t kh = h * ks[b].stride(1), vh = h * vs[b].stride(1);
      if (kv_f32) {
        attend_any(qh, reinterpret_cast<const float*>(k[b]) + kh, reinterpret_cast<const float*>(v[b]) + vh, j0, j1, G, D,
                   mt, lt, at);
      } else {
        attend_any(qh, reinterpret_cast<const uint16_t*>(k[b]) + kh, reinterpret_cast<const uint16_t*>(v[b]) + vh, j0, j1,
                   G, D, mt, lt, at);
      }
    }
  });
  const int64_t elem = out_bf16 ? 2 : 4;
  for (int64_t b = 0; b < B; ++b)
    merge_splits(m.data() + first[b] * G, l.data() + first[b] * G, acc.data() + first[b] * G * D, H_kv, G, D, splits[b],
                 static_cast<char*>(out) + b * H_q * D * elem, out_bf16);
}

// q [H_q, D] (float32 or bfloat16), k/v [H_kv, C, D] (float32 or bfloat16, rows contiguous),
// keys start..end-1; returns [H_q, D] in q's dtype. `splits`: key ranges per KV head (0: auto_splits).
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t start, int64_t end,
                               double scale, int64_t splits) {
  TORCH_CHECK(q.dim() == 2 && k.dim() == 3 && v.dim() == 3, "decode_attention: q [H_q, D], k/v [H_kv, C, D]");
  const int H_q = q.size(0), D = q.size(1), H_kv = k.size(0);
  TORCH_CHECK(H_kv > 0 && H_q % H_kv == 0 && H_q / H_kv <= MAX_G && D <= MAX_D, "decode_attention: unsupported heads/dim");
  check_kv(k, v, D, H_kv);
  TORCH_CHECK(0 <= start && start < end && end <= k.size(1) && end <= v.size(1), "decode_attention: key range");
  TORCH_CHECK(splits >= 0, "decode_attention: splits >= 0");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16, "decode_attention: q must be float32 or bfloat16");
  auto out = torch::empty({H_q, D}, q.options());  // [H_q, D]
  const bool q_bf16 = q.scalar_type() == torch::kBFloat16;
  // scratch on the heap, not as tensors: per-call overhead matters at 30 calls per token
  std::vector<float> qs(static_cast<size_t>(H_q) * D);  // [H_q, D] float32, scaled
  scaled_query(q.data_ptr(), q_bf16, q.stride(0), q.stride(1), H_q, D, static_cast<float>(scale), qs.data());
  const std::vector<torch::Tensor> ks{k.unsqueeze(0)}, vs{v.unsqueeze(0)};  // [1, H_kv, C, D]: one layer
  attend_batch(qs.data(), ks, vs, 0, &start, &end, H_q, H_kv, D, out.data_ptr(), q_bf16, splits);
  return out;
}

// B requests in ONE call (the server's batched step): q [H_q, B, D] (any strides), ks[b] / vs[b] the
// whole buffers [L, H_kv, C, D] of request b (one dtype for all), their `layer`, keys starts[b]..ends[b]-1.
// Returns [B, H_q*D] in q's dtype. Every (request, KV head, key range) task of the batch goes to one
// parallel_for, and each request's splits, tasks and merge are those of `decode_attention` alone
// (auto_splits): row b is bit for bit the single call on request b.
torch::Tensor decode_attention_batch(torch::Tensor q, std::vector<torch::Tensor> ks, std::vector<torch::Tensor> vs,
                                     int64_t layer, std::vector<int64_t> starts, std::vector<int64_t> ends,
                                     double scale) {
  TORCH_CHECK(q.dim() == 3, "decode_attention_batch: q [H_q, B, D]");
  const int H_q = q.size(0), D = q.size(2);
  const int64_t B = q.size(1);
  TORCH_CHECK(static_cast<int64_t>(ks.size()) == B && static_cast<int64_t>(vs.size()) == B &&
              static_cast<int64_t>(starts.size()) == B && static_cast<int64_t>(ends.size()) == B,
              "decode_attention_batch: one buffer and key range per request");
  TORCH_CHECK(B > 0, "decode_attention_batch: no request");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 || q.scalar_type() == torch::kBFloat16, "decode_attention: q must be float32 or bfloat16");
  const int H_kv = ks[0].size(1);
  TORCH_CHECK(H_kv > 0 && H_q % H_kv == 0 && H_q / H_kv <= MAX_G && D <= MAX_D, "decode_attention: unsupported heads/dim");
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ks[b].dim() == 4 && vs[b].dim() == 4, "decode_attention_batch: k/v [L, H_kv, C, D]");
    check_kv(ks[b], vs[b], D, H_kv);
    TORCH_CHECK(ks[b].scalar_type() == ks[0].scalar_type(), "decode_attention_batch: one K/V dtype for the batch");
    TORCH_CHECK(0 <= layer && layer < ks[b].size(0) && layer < vs[b].size(0), "decode_attention_batch: layer");
    TORCH_CHECK(0 <= starts[b] && starts[b] < ends[b] && ends[b] <= ks[b].size(2) && ends[b] <= vs[b].size(2),
                "decode_attention_batch: key range");
  }
  const bool q_bf16 = q.scalar_type() == torch::kBFloat16;
  const int64_t elem = q_bf16 ? 2 : 4;
  std::vector<float> qs(static_cast<size_t>(B) * H_q * D);  // [B, H_q, D] float32, scaled
  for (int64_t b = 0; b < B; ++b)
    scaled_query(static_cast<const char*>(q.data_ptr()) + b * q.stride(1) * elem, q_bf16, q.stride(0), q.stride(2),
                 H_q, D, static_cast<float>(scale), qs.data() + b * H_q * D);
  auto out = torch::empty({B, static_cast<int64_t>(H_q) * D}, q.options());  // [B, H_q*D]
  attend_batch(qs.data(), ks, vs, layer, starts.data(), ends.data(), H_q, H_kv, D, out.data_ptr(), q_bf16);
  return out;
}
