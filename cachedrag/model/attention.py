"""Native CPU attention: decode (one query row per head over a request's KV rows, split across the
keys) and the partial prefill (sorted query positions, causal by position).

Owns: ``decode_attention(q, k, v, start, end, scale)`` (``[H_q, D]`` query rows over the rows
``start..end-1`` of ``[H_kv, C, D]`` key/value buffers, GQA: query head ``h`` reads KV head
``h // (H_q / H_kv)``), ``decode_attention_batch`` (B requests' rows in one call, each bit for bit
its single call: the server's batched step), its torch reference (``decode_attention_reference``) and the small C++
kernel behind it, compiled with the system's C++ compiler at first use and cached on disk
(``cache_home()/ext``, keyed by the source, torch's version and the CPU's flags, the library's
SHA-256 beside it: a library whose bytes changed is rebuilt, never loaded). Without a compiler
(or when the build fails) ``kernel()`` returns None with the reason in ``kernel_status()`` and
the runner keeps SDPA: a fallback, reported, never an error.

Why hand-written: torch's CPU SDPA (the aten flash kernel) parallelises a single query row over
(batch, head) only, so at 2 threads its 9 heads split 5/4 and every head re-reads its KV head's
rows (3 query heads per KV head here); it also reads bf16 K/V only with a bf16 query. This kernel
splits the keys too (flash-decoding: every thread a key range of every KV head, partial max /
sum / output merged after), reads each K/V row once for all the query heads that share it, and
reads float32 or bf16 K/V under a float32 query (so an fp32 or int8-dynamic runner can keep its
working KV in bf16). No maintained package does this on the CPU for torch 2.13:
intel-extension-for-pytorch (its decode attention) refuses any torch but its own 2.8, vLLM's
and SGLang's CPU kernels come with their own torch builds (checked, docs/speed.md round 7).

Threads: ``at::parallel_for`` over (KV head, key split) tasks with torch's intra-op thread
count (never more).

Also owns the partial prefill's attention kernel, ``prefill_attention(q, k, v, positions, kv_len,
scale, hidden_keys)``: query rows at sorted absolute positions (a prefill computes any subset of a
request's tokens: fresh chunks, recomputed rows of reused ones, the question) over the request's
KV rows, key ``j`` visible to the row at position ``p`` iff ``j <= p`` (and not hidden), and its
reference ``prefill_attention_reference``. Why hand-written: torch's CPU SDPA (the aten flash
kernel) takes such a mask only as a dense ``[rows, keys]`` tensor it reads for every block and
never skips, and runs its score and value products at about half the machine's float32 FMA rate
(the block-causal plan in ``runner.py`` cuts the masked work, not that rate); this kernel
transposes each head's K once per call, computes a tile of 32 keys for 12 query vectors at once
(the query heads that share a KV head and 16 rows: each K and V element is read once for all of
them), masks only the tiles a row's position cuts, skips per tile the rows that end before it, and
hands tasks (16 rows x KV head, the longest first) to threads from a counter. Probe (SmolLM2-135M
shapes, 1.3k keys, 2 threads, through ``ModelRunner.attend``): 1.3-1.6x faster than the SDPA path
per layer in float32 and bfloat16 (docs/speed.md "Prefill attention, round 11"). With bf16 queries
and K/V on AVX512-BF16 CPUs the scores run on bf16 pairs (``vdpbf16ps``, two exact products a
float32 lane; K copied per call as words of two dims by key, the scores scaled after the sum):
``pairs="scores"``, the default, 1.23x at the widened path's accuracy; ``"scores+values"`` also
multiplies V (copied as words of two keys by dim) by each tile's probabilities rounded to bf16, as
GPU flash attention does: 1.5x, mean error +13% (docs/speed.md "Prefill attention, round 13").
AVX-512 only (``prefill_module()`` is None elsewhere: the runner keeps SDPA).

Does not own: where the KV lives or its dtype (``runner.py``), which rows a prefill computes.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import shutil
import threading
from pathlib import Path

import torch

from cachedrag.model.artifact import cpu_flags_digest, file_sha256, write_atomic
from cachedrag.model.fused_decode import SOURCE as FUSED_DECODE_SOURCE

_SOURCE = r"""
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

constexpr int TILE = 64;       // keys whose scores are held at once (per query head)
constexpr int MAX_G = 16;      // query heads per KV head
constexpr int MAX_D = 256;     // head dim

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {
  uint32_t u = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

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

void check_kv(const torch::Tensor& k, const torch::Tensor& v, int D, int H_kv) {
  TORCH_CHECK(k.size(-1) == D && v.size(-1) == D && v.size(-3) == H_kv && k.size(-3) == H_kv, "decode_attention: k/v shape");
  TORCH_CHECK(k.stride(-1) == 1 && k.stride(-2) == D && v.stride(-1) == 1 && v.stride(-2) == D, "decode_attention: k/v rows must be contiguous");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "decode_attention: k/v dtypes differ");
  TORCH_CHECK(k.scalar_type() == torch::kFloat32 || k.scalar_type() == torch::kBFloat16, "decode_attention: k/v must be float32 or bfloat16");
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
                  bool out_bf16, int64_t splits_given = 0) {
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

"""

# The partial prefill's attention (``prefill_attention``): sorted query positions over a request's
# KV rows, causal by absolute position, optional hidden keys. Same library as the decode kernel
# (it reuses ``exp16_neg`` / ``load16`` from it); AVX-512 only (elsewhere the runner keeps SDPA).
_PREFILL_SOURCE = r"""
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
"""

_BINDINGS = r"""
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "one query row per head over KV rows, split-K (cachedrag)");
  m.def("decode_attention_batch", &decode_attention_batch, "decode_attention for B requests in one call (cachedrag)");
  m.def("prefill_attention", &prefill_attention, "sorted query positions over KV rows, causal by position (cachedrag)");
  m.def("prefill_attention_available", &prefill_attention_available, "whether prefill_attention was built (AVX-512)");
  register_fused_decode(m);
}
"""

# One library: the decode kernel, the prefill kernel, then the fused decode step that calls the first
# (``model/fused_decode.py``).
_SOURCES = [_SOURCE, _PREFILL_SOURCE, FUSED_DECODE_SOURCE, _BINDINGS]

_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fno-trapping-math",
          "-fopenmp"]
_lock = threading.Lock()
_state: dict = {}


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, end: int,
                               scale: float) -> torch.Tensor:
    """The reference: float32 softmax attention of ``q [H_q, D]`` over rows ``start..end-1`` of
    ``k, v [H_kv, C, D]`` (GQA by repeating KV heads); ``[H_q, D]`` in ``q``'s dtype."""
    g = q.shape[0] // k.shape[0]
    kk = k[:, start:end].float().repeat_interleave(g, 0)  # [H_q, T, D]
    vv = v[:, start:end].float().repeat_interleave(g, 0)  # [H_q, T, D]
    s = torch.einsum("hd,htd->ht", q.float(), kk) * scale  # [H_q, T]
    return torch.einsum("ht,htd->hd", s.softmax(-1), vv).to(q.dtype)  # [H_q, D]


def kernel():
    """The compiled kernel's module (``.decode_attention``) or None when it cannot be built here
    (reason in ``kernel_status()``). Built once per process, loaded from the disk cache after."""
    with _lock:
        if "module" not in _state:
            try:
                _state["module"] = _load()
                _state["status"] = "built" if _state.get("built") else "loaded"
            except Exception as exc:  # no compiler, a failed build: the runner keeps SDPA  # noqa: BLE001
                _state["module"] = None
                _state["status"] = f"unavailable: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ''}"
        return _state["module"]


def kernel_status() -> str:
    """``"built"``, ``"loaded"`` (from the disk cache), ``"unavailable: <why>"`` or ``"not tried"``."""
    return _state.get("status", "not tried")


def _key() -> str:
    blob = "\n".join([*_SOURCES, " ".join(_FLAGS), torch.__version__, cpu_flags_digest(), platform.machine()])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def library_dir(cache_dir: Path | None = None) -> Path:
    """The folder of this build of the kernel's library (sources, flags, torch, CPU) under
    ``cache_dir`` (default ``cache_home()/ext``)."""
    return (cache_dir or _cache_dir()) / f"cachedrag_decode_attn_{_key()}"


def _load(cache_dir: Path | None = None):
    """Load the kernel's library from ``cache_dir`` (default ``cache_home()/ext``) when its digest
    matches, else build it there (under a file lock: concurrent processes build once)."""
    directory = library_dir(cache_dir)
    name = directory.name
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f"{name}.lock", "w") as lock:
        try:
            import fcntl

            fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:  # no POSIX locks (Windows): one process at a time is the caller's job
            pass
        return _load_locked(name, directory)


def _load_locked(name: str, directory: Path):
    so = directory / f"{name}.so"
    digest = directory / f"{name}.sha256"
    if so.exists() and digest.exists() and digest.read_text().strip() == file_sha256(so):
        spec = importlib.util.spec_from_file_location(name, so, loader=importlib.machinery.ExtensionFileLoader(name, str(so)))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if so.exists() or digest.exists():  # bytes changed since the build (or a build cut short): rebuild
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)
    from torch.utils import cpp_extension

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise RuntimeError("no C++ compiler (c++) on PATH")
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not available")
    # a copy: load_inline inserts an #include into the list it is given, which changed _key() for the
    # rest of a process that built the library (a second build, or a test, looked under another name)
    module = cpp_extension.load_inline(name=name, cpp_sources=list(_SOURCES), extra_cflags=list(_FLAGS),
                                       extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
    write_atomic(digest, file_sha256(so))  # the digest last: a library without one is never loaded
    _state["built"] = True
    return module


def _cache_dir() -> Path:
    from cachedrag.paths import cache_home

    return cache_home() / "ext"




def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, end: int, scale: float,
                     splits: int = 0) -> torch.Tensor:
    """``decode_attention_reference`` through the compiled kernel (raises when it is unavailable:
    callers check ``kernel()`` first). ``q [H_q, D]``, ``k, v [H_kv, C, D]`` -> ``[H_q, D]``."""
    mod = kernel()
    if mod is None:
        raise RuntimeError(f"decode attention kernel {kernel_status()}")
    return mod.decode_attention(q, k, v, start, end, scale, splits)


def decode_attention_batch(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor], layer: int,
                           starts: list[int], ends: list[int], scale: float) -> torch.Tensor:
    """B requests in one call (the server's batched step): ``q [H_q, B, D]`` (any strides), request
    ``b``'s whole buffers ``ks[b], vs[b] [L, H_kv, C, D]`` at ``layer``, keys ``starts[b]..ends[b]-1``;
    returns ``[B, H_q*D]``. Row ``b`` equals ``decode_attention(q[:, b], ks[b][layer], vs[b][layer],
    starts[b], ends[b], scale)`` bit for bit: the same splits, tasks and merge, all the batch's tasks
    in one parallel loop (one fork/join per layer instead of one per request)."""
    mod = kernel()
    if mod is None:
        raise RuntimeError(f"decode attention kernel {kernel_status()}")
    return mod.decode_attention_batch(q, ks, vs, layer, starts, ends, scale)


def prefill_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                                kv_len: int, scale: float, hidden_keys: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: float32 softmax attention of ``q [H_q, T, D]`` (row ``t`` at ``positions[t]``)
    over rows ``[0, kv_len)`` of ``k, v [H_kv, C, D]``, key ``j`` visible iff ``j <= positions[t]`` and
    not ``hidden_keys[j]``; ``[T, H_q*D]`` in ``q``'s dtype (GQA by repeating KV heads)."""
    g = q.shape[0] // k.shape[0]
    kk = k[:, :kv_len].float().repeat_interleave(g, 0)  # [H_q, T_k, D]
    vv = v[:, :kv_len].float().repeat_interleave(g, 0)  # [H_q, T_k, D]
    s = torch.einsum("htd,hkd->htk", q.float(), kk) * scale  # [H_q, T, T_k]
    hide = torch.arange(kv_len, device=q.device)[None, :] > positions.to(q.device)[:, None]  # [T, T_k]
    if hidden_keys is not None:
        hide = hide | hidden_keys[None, :kv_len].to(q.device)
    s = s.masked_fill(hide[None], float("-inf"))  # [H_q, T, T_k]
    out = torch.einsum("htk,hkd->thd", s.softmax(-1), vv)  # [T, H_q, D]
    return out.reshape(q.shape[1], -1).to(q.dtype)  # [T, H_q*D]


def prefill_module():
    """The compiled library when it holds the prefill kernel (AVX-512 builds), else None."""
    mod = kernel()
    return mod if mod is not None and mod.prefill_attention_available() else None


PAIRS = {"none": 0, "scores": 1, "scores+values": 2}  # prefill_attention's ``pairs`` -> the kernel's code


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, kv_len: int,
                      scale: float, hidden_keys: torch.Tensor | None = None, pairs: str = "scores") -> torch.Tensor:
    """``prefill_attention_reference`` through the compiled kernel (raises when it is unavailable:
    callers check ``prefill_module()`` first). ``positions`` must ascend (as every prefill passes
    them); ``hidden_keys``: bool ``[kv_len]`` or None. ``pairs`` (bf16 ``q`` and K/V on AVX512-BF16
    CPUs; elsewhere every element is widened to float32): ``"scores"`` multiplies bf16 pairs for the
    scores (exact products, another order of sums: the widened path's accuracy), ``"scores+values"``
    for the value products too (the probabilities rounded to bf16 for them, as GPU flash attention
    does: faster, a little less accurate), ``"none"`` widens everything. Returns ``[T, H_q*D]``."""
    if pairs not in PAIRS:
        raise ValueError(f"pairs must be one of {', '.join(PAIRS)}, got {pairs!r}")
    mod = prefill_module()
    if mod is None:
        raise RuntimeError(f"prefill attention kernel unavailable ({kernel_status()})")
    hidden = _NO_HIDDEN if hidden_keys is None else hidden_keys[:kv_len].to(torch.uint8).contiguous()
    return mod.prefill_attention(q, k, v, positions.to(torch.int64), kv_len, scale, hidden, PAIRS[pairs])


_NO_HIDDEN = torch.empty(0, dtype=torch.uint8)
