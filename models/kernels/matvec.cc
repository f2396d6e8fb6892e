// y[M, N] = x[M, K] . W for a few rows M (a decode step): W is [K, N] ("kn") or [N, K] ("nk", a tied output head),
// float32 or bfloat16; x and y are float32. A decode step is bound by reading W once, so the loops stream W from
// memory in order, widen bfloat16 in registers (XLA's CPU dot widens it into a float32 copy first), and split the
// rows of W between the caller and XLA's intra-op thread pool. Beside it: a float32 and a bfloat16 GEMM for more rows,
// a decode step's attention over the KV cache, and the rows of a 16-bit table by id.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The vector registers the loops below are written in: AVX-512's sixteen floats, or AVX2's eight (with FMA: the
// x86-64-v3 CPUs, AMD's Zen 1-3 among them); without either, plain loops the compiler vectorises as it can.
// vload/vstore take the elements left in the row, so a row's last register reads and writes no further.
#if defined(__AVX512F__)
#define SHARDZOO_SIMD "AVX-512"
using vf = __m512;
constexpr int64_t kLanes = 16;
constexpr int kTileRows = 4;  // rows of x per tile of an [N, K] weight: 4 x 4 accumulators of 32 registers
constexpr bool kFloat32Loops = true;  // float32 weights take these loops too
inline __mmask16 tail(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }
inline vf vload(const float* p, int64_t left) { return _mm512_maskz_loadu_ps(tail(left), p); }
inline vf vload(const uint16_t* p, int64_t left) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(tail(left), p)), 16));
}
inline void vstore(float* p, vf v, int64_t left) { _mm512_mask_storeu_ps(p, tail(left), v); }
inline vf vset1(float a) { return _mm512_set1_ps(a); }
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline float vhmax(vf v) { return _mm512_reduce_max_ps(v); }
inline vf vkeep(vf x, vf fill, int64_t left) { return _mm512_mask_blend_ps(tail(left), fill, x); }  // x's first lanes
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2(vf n) {  // 2^n for whole n in [-126, 127], by the exponent's bits
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define SHARDZOO_SIMD "AVX2"
using vf = __m256;
constexpr int64_t kLanes = 8;
constexpr int kTileRows = 2;  // 2 x 4 accumulators, four rows of W and x's row: 13 of 16 registers
// float32 weights take the plain loops, which the compiler vectorises for AVX2: on AMD's Zen 3 they streamed GPT-2's
// float32 weights at the memory's rate, 5-10% faster than these loops' prefetched passes of eight rows; bfloat16
// weights need the prefetches (10 GB/s without, 14.5 with, the same machine).
constexpr bool kFloat32Loops = false;
// AVX2 has no masked 16-bit load: a row's last, partial register goes through a zeroed copy.
inline vf vload(const float* p, int64_t left) {
  if (left >= 8) return _mm256_loadu_ps(p);
  alignas(32) float b[8] = {};
  std::memcpy(b, p, sizeof(float) * left);
  return _mm256_load_ps(b);
}
inline vf vload(const uint16_t* p, int64_t left) {
  __m128i h;
  if (left >= 8) {
    h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  } else {
    alignas(16) uint16_t b[8] = {};
    std::memcpy(b, p, sizeof(uint16_t) * left);
    h = _mm_load_si128(reinterpret_cast<const __m128i*>(b));
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void vstore(float* p, vf v, int64_t left) {
  if (left >= 8) return _mm256_storeu_ps(p, v);
  alignas(32) float b[8];
  _mm256_store_ps(b, v);
  std::memcpy(p, b, sizeof(float) * left);
}
inline vf vset1(float a) { return _mm256_set1_ps(a); }
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline float vsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline float vhmax(vf v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline vf vkeep(vf x, vf fill, int64_t left) {  // x's first `left` lanes, fill's after them
  if (left >= 8) return x;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_blendv_ps(fill, x, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int(left)), lane)));
}
inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2(vf n) {  // 2^n for whole n in [-126, 127], by the exponent's bits
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
#endif

#if defined(SHARDZOO_SIMD)
// exp(x) for x <= 0 (a softmax's shifted scores), within 2 ulp of std::exp: x = n ln 2 + r, |r| <= ln 2 / 2, and
// Cephes' polynomial for exp(r). Below -87 it returns 2^-126 rather than 0 or a denormal: a key it weighs so is one
// the caller masked, and it skips those.
inline vf vexp(vf x) {
  x = vmax(x, vset1(-87.0f));
  const vf n = vround(vmul(x, vset1(1.44269504088896341f)));
  vf r = vfma(n, vset1(-0.693359375f), x);  // ln 2 in two parts: n ln 2 exactly enough
  r = vfma(n, vset1(2.12194440e-4f), r);
  vf p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  p = vfma(p, vmul(r, r), vadd(r, vset1(1.0f)));
  return vmul(p, vpow2(n));
}
#endif

constexpr int kMaxRows = 8;

// fn(std::integral_constant<int, R>()) for R = rows, 1 <= rows <= kMax: a tile whose row count is known when
// compiling, so that its accumulators stay in registers.
template <int kMax, typename Fn>
inline void with_rows(int64_t rows, Fn&& fn) {
  if constexpr (kMax > 0) {
    if (rows == kMax) return fn(std::integral_constant<int, kMax>());
    with_rows<kMax - 1>(rows, fn);
  }
}

// A worker's scratch, which it writes before it reads: not zeroed (a vector would zero it on every call).
template <typename T>
std::unique_ptr<T[]> scratch_of(size_t n) {
  return std::unique_ptr<T[]>(new T[n]);
}
// Columns of a wide [K, N] weight (N >= 4 kBand) one worker takes: one accumulator per worker would be M x N each.
constexpr int64_t kBand = 4096;
// Blocks of weight rows prefetched ahead of the block being read. The hardware prefetcher alone, on 4 or 8 rows
// read side by side, left bfloat16 rows at 17 GB/s; two blocks ahead gave 25-30 GB/s (1, 4 and 8 were no better).
constexpr int64_t PF = 2;

// Rows [k0, k1) and columns [n0, n1) of a [K, N] weight into acc[M, N] (acc += x[:, k] * W[k, :]), four weight
// rows per pass so each pass reads and writes the accumulator once for four rows of W.
template <typename W>
void kn_rows(const float* x, const W* w, float* acc, int64_t M, int64_t K, int64_t N, int64_t k0, int64_t k1,
             int64_t n0, int64_t n1) {
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    const W* w0 = w + k * N;
    const W* w1 = w0 + N;
    const W* w2 = w1 + N;
    const W* w3 = w2 + N;
    for (int64_t m = 0; m < M; ++m) {
      const float a0 = x[m * K + k], a1 = x[m * K + k + 1], a2 = x[m * K + k + 2], a3 = x[m * K + k + 3];
      float* __restrict y = acc + m * N;
#pragma GCC ivdep
      for (int64_t n = n0; n < n1; ++n) {
        y[n] += a0 * widen(w0[n]) + a1 * widen(w1[n]) + a2 * widen(w2[n]) + a3 * widen(w3[n]);
      }
    }
  }
  for (; k < k1; ++k) {
    const W* w0 = w + k * N;
    for (int64_t m = 0; m < M; ++m) {
      const float a0 = x[m * K + k];
      float* __restrict y = acc + m * N;
#pragma GCC ivdep
      for (int64_t n = n0; n < n1; ++n) y[n] += a0 * widen(w0[n]);
    }
  }
}

// Rows [n0, n1) of an [N, K] weight: y[m, n] = dot(x[m, :], W[n, :]), four weight rows at a time.
template <typename W>
void nk_rows(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const W* w0 = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
      for (int64_t k = 0; k < K; ++k) {
        const float a = xm[k];
        s0 += a * widen(w0[k]);
        s1 += a * widen(w0[K + k]);
        s2 += a * widen(w0[2 * K + k]);
        s3 += a * widen(w0[3 * K + k]);
      }
      y[m * N + n] = s0, y[m * N + n + 1] = s1, y[m * N + n + 2] = s2, y[m * N + n + 3] = s3;
    }
  }
  for (; n < n1; ++n) {
    for (int64_t m = 0; m < M; ++m) {
      float s = 0;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * widen(w[n * K + k]);
      y[m * N + n] = s;
    }
  }
}

#if defined(SHARDZOO_SIMD)
// The same loops in vector registers of kLanes floats; bfloat16 widens by a shift into the high half.
// Prefetch `elems` elements from p (into L1, or the cache kHint names): the next block of rows, ahead of the
// hardware's stream detection.
template <auto kHint = _MM_HINT_T0, typename W>
inline void prefetch(const W* p, int64_t elems) {
  for (int64_t i = 0; i < elems; i += 64 / int64_t(sizeof(W))) _mm_prefetch(reinterpret_cast<const char*>(p + i), kHint);
}

#if defined(__AVX512F__)
// One row of x (a decode step of batch 1) against R rows of W a pass from row k: the R weights of x broadcast once
// into registers, the pass's R rows of W read side by side, the sums into acc. Returns the first row it left (fewer
// than R remain). R follows the length of W's rows: on an AMD EPYC with AVX-512 (GPT-2's matrices, a process
// alternating the loops) rows of 1.5 KB read fastest 4 at a time (8-13% faster than 8), rows of 3 KB and more 16 at
// a time (5-9% faster than 8).
template <int R, typename W>
int64_t kn_one_row(const float* x, const W* w, float* acc, int64_t N, int64_t k, int64_t k1) {
  // 4 short rows are prefetched two passes ahead (without, 3072 x 768 bfloat16 read at 19 GB/s instead of 30); 16
  // long rows are left to the hardware, which a prefetch two passes (192 KB) ahead only hindered: a batch-1 decode
  // step took 2% (bfloat16) and 8% (float32) longer with it.
  constexpr bool kFetch = R < 16;
  for (; k + R <= k1; k += R) {
    const W* wk = w + k * N;
    const W* ahead = wk + PF * R * N;
    const bool fetch = kFetch && k + (PF + 1) * R <= k1;
    vf a[R];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) a[i] = vset1(x[k + i]);
    for (int64_t n = 0; n < N; n += kLanes) {
      const int64_t left = N - n;
      if (fetch) prefetch(ahead + n * R, R * kLanes);
      vf s0 = vload(acc + n, left), s1 = vzero();  // two chains of sums
#pragma GCC unroll 16
      for (int i = 0; i < R; i += 2) {
        s0 = vfma(a[i], vload(wk + i * N + n, left), s0);
        s1 = vfma(a[i + 1], vload(wk + (i + 1) * N + n, left), s1);
      }
      vstore(acc + n, vadd(s0, s1), left);
    }
  }
  return k;
}
#endif

#if defined(__AVX512BF16__)
// vdpbf16ps over two rows unpacked into pairs (unpacklo/unpackhi_epi16, which work within 128-bit lanes) sums 32
// columns into lo (each lane's first 4 columns of 8) and hi (its last 4): stored to o[0, 32) in column order.
inline void store_unpacked(float* o, __m512 lo, __m512 hi) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  _mm512_storeu_ps(o, _mm512_permutex2var_ps(lo, first, hi));
  _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(lo, second, hi));
}

// One row of x whose values are bfloat16 (a bfloat16 model's activation, widened by the caller) against R rows of a
// bfloat16 [K, N] weight a pass, by AVX-512 BF16's vdpbf16ps: rows k + 2j and k + 2j + 1 interleaved into the pairs it
// takes, x's pairs `xpairs` (from row k0) broadcast once a pass. Unpacking within 128-bit lanes leaves each lane's
// first 4 columns of 8 in lo and its last 4 in hi: acc's 32 columns are permuted into that order and back
// (store_unpacked) around each pass. Widening each weight and multiplying it takes about three times the instructions: on an AMD EPYC that loop
// read GPT-2's matrices at 61-78 GB/s from cache, close enough to the memory's fast spells (46) to fall behind it.
// The products are exact and summed in float32 as the widening loop sums them, in another order; denormals count as
// zero. Returns the first row it left.
template <int R>
int64_t kn_one_row_dp(const uint32_t* xpairs, int64_t k0, const uint16_t* w, float* acc, int64_t N, int64_t k,
                      int64_t k1) {
  static_assert(R % 2 == 0, "rows come in pairs");
  constexpr bool kFetch = R < 16;  // as kn_one_row: short rows prefetched two passes ahead, long ones not
  const __m512i to_lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i to_hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const int64_t whole = N / 32 * 32;
  for (; k + R <= k1; k += R) {
    const uint16_t* wk = w + k * N;
    const uint16_t* ahead = wk + PF * R * N;
    const bool fetch = kFetch && k + (PF + 1) * R <= k1;
    __m512bh p[R / 2];
#pragma GCC unroll 8
    for (int j = 0; j < R / 2; ++j) p[j] = (__m512bh)_mm512_set1_epi32(int(xpairs[(k - k0) / 2 + j]));
    for (int64_t n = 0; n < whole; n += 32) {
      if (fetch) prefetch(ahead + n * R, R * 32);
      const __m512 a0 = _mm512_loadu_ps(acc + n), a1 = _mm512_loadu_ps(acc + n + 16);
      __m512 lo = _mm512_permutex2var_ps(a0, to_lo, a1), hi = _mm512_permutex2var_ps(a0, to_hi, a1);
#pragma GCC unroll 8
      for (int j = 0; j < R / 2; ++j) {
        const __m512i r0 = _mm512_loadu_si512(wk + 2 * j * N + n), r1 = _mm512_loadu_si512(wk + (2 * j + 1) * N + n);
        lo = _mm512_dpbf16_ps(lo, (__m512bh)_mm512_unpacklo_epi16(r0, r1), p[j]);
        hi = _mm512_dpbf16_ps(hi, (__m512bh)_mm512_unpackhi_epi16(r0, r1), p[j]);
      }
      store_unpacked(acc + n, lo, hi);
    }
  }
  return k;
}

// Whether x[k0, k1) are all bfloat16 values (their low 16 bits zero), k1 - k0 even; `out` then holds them as pairs
// (rows k0 + 2i and k0 + 2i + 1).
inline bool bf16_pairs(const float* x, int64_t k0, int64_t k1, std::vector<uint32_t>& out) {
  if ((k1 - k0) % 2) return false;
  out.resize(size_t((k1 - k0) / 2));
  uint32_t low = 0;
  for (int64_t k = k0; k < k1; k += 2) {
    uint32_t a, b;
    std::memcpy(&a, x + k, 4);
    std::memcpy(&b, x + k + 1, 4);
    low |= (a | b) & 0xFFFFu;
    out[size_t((k - k0) / 2)] = (a >> 16) | (b & 0xFFFF0000u);
  }
  return low == 0;
}
#endif

template <typename W>
void kn_rows_simd(const float* x, const W* w, float* acc, int64_t M, int64_t K, int64_t N, int64_t k0, int64_t k1,
                  int64_t n0, int64_t n1) {
  // Eight rows of W at a time, kLanes columns a register: each weight is loaded and widened once and used for
  // every row of x (broadcast from memory), so a step of M rows reads and converts W once. Whole rows (one
  // block of 8N in memory order) are prefetched; a band of columns is left to the hardware's row streams.
  if constexpr (sizeof(W) == 4 && !kFloat32Loops) return kn_rows(x, w, acc, M, K, N, k0, k1, n0, n1);
  int64_t k = k0;
  const bool whole = n0 == 0 && n1 == N;
#if defined(__AVX512F__)
  if (M == 1 && whole) {
#if defined(__AVX512BF16__)
    if constexpr (sizeof(W) == 2) {
      thread_local std::vector<uint32_t> pairs;
      if (N >= 32 && bf16_pairs(x, k0, k1, pairs)) {
        if (N * int64_t(sizeof(W)) >= 2048) k = kn_one_row_dp<16>(pairs.data(), k0, w, acc, N, k, k1);
        k = kn_one_row_dp<4>(pairs.data(), k0, w, acc, N, k, k1);
        if (N % 32) kn_rows(x, w, acc, M, K, N, k0, k, N / 32 * 32, N);  // the columns past the last 32
        if (k < k1) kn_rows(x, w, acc, M, K, N, k, k1, n0, n1);
        return;
      }
    }
#endif
    if (N * int64_t(sizeof(W)) >= 2048) k = kn_one_row<16>(x, w, acc, N, k, k1);
    k = kn_one_row<4>(x, w, acc, N, k, k1);  // all of it for shorter rows; the rest, fewer than 16, for longer
    if (k < k1) kn_rows(x, w, acc, M, K, N, k, k1, n0, n1);
    return;
  }
#endif
  for (; k + 8 <= k1; k += 8) {
    const W* wk = w + k * N;
    const W* ahead = wk + PF * 8 * N;
    const bool fetch = whole && k + (PF + 1) * 8 <= k1;
    for (int64_t n = n0; n < n1; n += kLanes) {
      const int64_t left = n1 - n;
      if (fetch) prefetch(ahead + n * 8, 8 * kLanes);
      vf v[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) v[i] = vload(wk + i * N + n, left);
      for (int64_t m = 0; m < M; ++m) {
        const float* a = x + m * K + k;
        float* y = acc + m * N + n;
        vf s0 = vload(y, left);
        vf s1 = vmul(vset1(a[1]), v[1]);
        s0 = vfma(vset1(a[0]), v[0], s0);
        s0 = vfma(vset1(a[2]), v[2], s0);
        s1 = vfma(vset1(a[3]), v[3], s1);
        s0 = vfma(vset1(a[4]), v[4], s0);
        s1 = vfma(vset1(a[5]), v[5], s1);
        s0 = vfma(vset1(a[6]), v[6], s0);
        s1 = vfma(vset1(a[7]), v[7], s1);
        vstore(y, vadd(s0, s1), left);
      }
    }
  }
  if (k < k1) kn_rows(x, w, acc, M, K, N, k, k1, n0, n1);
}

// R rows of x (1 to kTileRows) against four rows of W: 4R accumulators held in registers (constant indices
// throughout).
template <int R, typename W>
void nk_tile_simd(const float* x, const W* w0, float* y, int64_t K, int64_t N, int64_t n, const W* ahead) {
  vf s[R][4];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) s[r][j] = vzero();
  for (int64_t k = 0; k < K; k += kLanes) {
    const int64_t left = K - k;
    if (ahead) prefetch(ahead + k * 4, 4 * kLanes);
    const vf v0 = vload(w0 + k, left), v1 = vload(w0 + K + k, left);
    const vf v2 = vload(w0 + 2 * K + k, left), v3 = vload(w0 + 3 * K + k, left);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const vf a = vload(x + r * K + k, left);
      s[r][0] = vfma(a, v0, s[r][0]);
      s[r][1] = vfma(a, v1, s[r][1]);
      s[r][2] = vfma(a, v2, s[r][2]);
      s[r][3] = vfma(a, v3, s[r][3]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) y[r * N + n + j] = vsum(s[r][j]);
}

// One row of x against rows [n, n1) of an [N, K] weight, one row of W after the other: the weights are read strictly
// in memory order, as a plain read loop reads them. A batch-1 float32 decode step of GPT-2 (whose tied head is
// [vocab, embed]) took 6% less time than with four rows of W side by side; bfloat16 was no different.
template <typename W>
void nk_one_row(const float* x, const W* w, float* y, int64_t K, int64_t n, int64_t n1) {
  for (; n < n1; ++n) {
    const W* wn = w + n * K;
    vf s0 = vzero(), s1 = vzero();  // two chains of sums
    int64_t k = 0;
    for (; k + 2 * kLanes <= K; k += 2 * kLanes) {
      s0 = vfma(vload(x + k, kLanes), vload(wn + k, kLanes), s0);
      s1 = vfma(vload(x + k + kLanes, kLanes), vload(wn + k + kLanes, kLanes), s1);
    }
    for (; k < K; k += kLanes) s0 = vfma(vload(x + k, K - k), vload(wn + k, K - k), s0);
    y[n] = vsum(vadd(s0, s1));
  }
}

// Four rows of W at a time against up to kTileRows rows of x: each weight is loaded and widened once per tile of
// rows of x; the next tile reads the same four rows of W again, from L1.
template <typename W>
void nk_row_tiles(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  if (M == 1) return nk_one_row(x, w, y, K, n0, n1);
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const W* w0 = w + n * K;
    const W* ahead = n + (PF + 1) * 4 <= n1 ? w0 + PF * 4 * K : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
      const float* xm = x + m0 * K;
      float* ym = y + m0 * N;
      const W* fetch = m0 == 0 ? ahead : nullptr;
      with_rows<kTileRows>(std::min<int64_t>(kTileRows, M - m0),
                           [&](auto r) { nk_tile_simd<decltype(r)::value>(xm, w0, ym, K, N, n, fetch); });
    }
  }
  if (n < n1) nk_rows(x, w, y, M, K, N, n, n1);
}

template <typename W>
void nk_rows_simd(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  if constexpr (sizeof(W) == 4 && !kFloat32Loops) return nk_rows(x, w, y, M, K, N, n0, n1);
  nk_row_tiles(x, w, y, M, K, N, n0, n1);
}
#define KN_ROWS kn_rows_simd
#define NK_ROWS nk_rows_simd
#else
#define KN_ROWS kn_rows
#define NK_ROWS nk_rows
#endif

// Chunks of weight rows, claimed through one counter by the caller and by tasks on XLA's pool. A task the pool
// starts late finds nothing left; the caller never waits for a task that has not started, so a busy pool
// cannot stall it.
struct Work {
  std::atomic<int64_t> next{0}, done{0};
  int64_t chunks = 0;
};

// drain(worker) on the caller (worker 0) and on up to max_workers - 1 of the pool's threads, until all of work's
// chunks are done.
template <typename Drain>
void run_drains(ffi::ThreadPool& pool, const Work& work, int max_workers, Drain drain) {
  const int helpers = int(std::min<int64_t>(pool.num_threads(), max_workers - 1));
  for (int t = 1; t <= helpers; ++t) pool.Schedule([drain, t] { drain(t); });
  drain(0);
  while (work.done.load(std::memory_order_acquire) < work.chunks) std::this_thread::yield();
}

template <typename Fn>
void run_chunks(ffi::ThreadPool& pool, int64_t chunks, int max_workers, Fn fn) {
  auto work = std::make_shared<Work>();
  work->chunks = chunks;
  run_drains(pool, *work, max_workers, [work, fn](int worker) {
    for (int64_t c; (c = work->next.fetch_add(1)) < work->chunks;) {
      fn(worker, c);
      work->done.fetch_add(1, std::memory_order_release);
    }
  });
}

// run_chunks, each worker claiming its next chunk before it runs this one: fn(worker, chunk, next) where `next` is
// the chunk this worker runs after it (or -1), whose data it can prefetch while this one computes. Chunks claimed
// from one counter go to the workers in turn, so a chunk's neighbour in memory is usually the other worker's.
template <typename Fn>
void run_chunks_ahead(ffi::ThreadPool& pool, int64_t chunks, int max_workers, Fn fn) {
  auto work = std::make_shared<Work>();
  work->chunks = chunks;
  run_drains(pool, *work, max_workers, [work, fn](int worker) {
    for (int64_t c = work->next.fetch_add(1); c < work->chunks;) {
      const int64_t next = work->next.fetch_add(1);
      fn(worker, c, next < work->chunks ? next : int64_t(-1));
      work->done.fetch_add(1, std::memory_order_release);
      c = next;
    }
  });
}

#if defined(SHARDZOO_SIMD)
// More rows than kMaxRows (a batch's decode step, a prefill) against float32 or bfloat16 weights, float32 sums. XLA's
// CPU dot ran GPT-2's matrices of 32 rows at a quarter to a third of an AVX2 machine's matmul rate (35-52 GFLOP/s of
// 132 on AMD's Zen 3), and at 32 rows at 136 GFLOP/s of 215 on an AMD EPYC with AVX-512, where these tiles over
// packed panels reached 205.
#define SHARDZOO_GEMM 1
// Blocked as BLAS libraries block a GEMM (Goto and van de Geijn): a chunk of kNc columns of W is packed kKc rows at a
// time, widened to float32, into panels of kKc x kPanel that every tile of rows of x reads from L2, kMc rows of x at
// a time (so that they stay in L2 too). W is read in runs of kNc columns of a row, and the next block's runs are
// prefetched into L2 while this block's tiles run, so that reading W and multiplying overlap. (Blocks of 256 rows,
// whose panels fit L1, were no faster at 32 rows and slower at 1,024 on Zen 3.)
constexpr int64_t kPanel = 2 * kLanes;  // columns of W per packed panel: two registers
#if defined(__AVX512F__)
// Rows of x per tile: 16 accumulators, two of W, one of x, of 32 registers. Tiles of 6 rows ran GPT-2's matrices of
// 32 rows 10% slower, of 14 rows 5% slower (and 12 rows no faster than 8).
constexpr int kGemmRows = 8;
#else
constexpr int kGemmRows = 6;  // rows of x per tile: 12 accumulators, two of W, one of x: 15 of 16 registers
#endif
constexpr int64_t kKc = 768;  // rows of W per block: a panel of 48 KB (AVX2) or 96 KB (AVX-512) in float32
constexpr int64_t kNc = 128;  // columns of W per chunk of work: a row's run of 512 bytes
constexpr int64_t kMc = 96;   // rows of x per pass over a block's panels

// A block of W to come, prefetched into L2 a few cache lines at a time: `rows` runs of `elems` elements, `stride`
// elements apart.
struct Ahead {
  const char* base = nullptr;
  int64_t stride = 0, rows = 0, lines = 0, next = 0;
  Ahead() = default;
  template <typename W>
  Ahead(const W* p, int64_t stride_elems, int64_t rows_, int64_t elems)
      : base(reinterpret_cast<const char*>(p)), stride(stride_elems * int64_t(sizeof(W))), rows(rows_),
        lines((elems * int64_t(sizeof(W)) + 63) / 64) {}
  int64_t total() const { return rows * lines; }
  void issue(int64_t count) {
    for (const int64_t end = std::min(total(), next + count); next < end; ++next)
      _mm_prefetch(base + (next / lines) * stride + (next % lines) * 64, _MM_HINT_T1);
  }
};

// Rows [k0, k0 + kc) and columns [n0, n0 + panels kPanel) of a [K, N] weight into panels (zeros past N).
template <typename W>
void pack_kn(const W* w, float* packed, int64_t N, int64_t n0, int64_t k0, int64_t kc, int64_t panels) {
  const int64_t cols = std::min(kNc, N - n0);
  for (int64_t k = 0; k < kc; ++k) {
    const W* row = w + (k0 + k) * N + n0;
    for (int64_t p = 0; p < panels; ++p) {
      float* out = packed + (p * kc + k) * kPanel;
#pragma GCC unroll 2
      for (int64_t j = 0; j < kPanel; j += kLanes) {
        const int64_t left = cols - p * kPanel - j;
        vstore(out + j, left > 0 ? vload(row + p * kPanel + j, left) : vzero(), kLanes);
      }
    }
  }
}

// R rows of x against kc rows of a panel (float32, or bfloat16 widened as it is loaded): 2R sums in registers,
// started from y's (more) or from zero. `ahead`: a panel to come, one cache line of it prefetched every `every` rows
// of this one (the tiles of a panel share that panel's prefetches between them).
template <int R, typename W = float>
void panel_tile_f32(const float* x, int64_t ldx, const W* panel, int64_t kc, float* y, int64_t ldy, int64_t left,
                    bool more, const W* ahead = nullptr, int64_t every = 0) {
  vf acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    acc[r][0] = more ? vload(y + r * ldy, left) : vzero();
    acc[r][1] = more && left > kLanes ? vload(y + r * ldy + kLanes, left - kLanes) : vzero();
  }
  if (!ahead) every = kc;
  for (int64_t k0 = 0; k0 < kc; k0 += every) {
    if (ahead) prefetch<_MM_HINT_T1>(ahead + (k0 / every) * kPanel, kLanes);
    for (int64_t k = k0, k1 = std::min(kc, k0 + every); k < k1; ++k) {
      const vf b0 = vload(panel + k * kPanel, kLanes), b1 = vload(panel + k * kPanel + kLanes, kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const vf a = vset1(x[r * ldx + k]);
        acc[r][0] = vfma(a, b0, acc[r][0]);
        acc[r][1] = vfma(a, b1, acc[r][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    vstore(y + r * ldy, acc[r][0], left);
    if (left > kLanes) vstore(y + r * ldy + kLanes, acc[r][1], left - kLanes);
  }
}

// y = x . W for M rows. [K, N]: chunks of kNc columns split between the workers, each a block of kKc rows of W at a
// time, packed into the worker's scratch while the block after it (the next chunk's first, after the last) is
// prefetched. A tied head, [N, K], is read as dot products, four rows of W from L1 by every tile of rows of x (its
// rows packed the same way, transposed, were no faster: the head's read from memory bounds it either way).
template <typename W>
void gemm_f32(ffi::ThreadPool& pool, const float* xp, const W* wp, float* yp, int64_t M, int64_t K, int64_t N,
              bool nk) {
  const int max_workers = int(std::max<int64_t>(1, pool.num_threads()));
  if (nk) {
    const int64_t rows = 64;
    run_chunks(pool, (N + rows - 1) / rows, max_workers, [&](int, int64_t c) {
      nk_row_tiles(xp, wp, yp, M, K, N, c * rows, std::min(N, (c + 1) * rows));
    });
    return;
  }
  const int64_t per_worker = kKc * kNc + kLanes;  // floats, with room to align the panels to a register
  const auto scratch = scratch_of<float>(size_t(max_workers) * per_worker);
  const int64_t tiles = (M + kGemmRows - 1) / kGemmRows + M / kMc;  // tiles per panel, about
  run_chunks(pool, (N + kNc - 1) / kNc, max_workers, [&](int worker, int64_t c) {
    float* packed = scratch.get() + worker * per_worker;
    packed += (kLanes - (reinterpret_cast<uintptr_t>(packed) / sizeof(float)) % kLanes) % kLanes;
    const int64_t n0 = c * kNc, panels = (std::min(kNc, N - n0) + kPanel - 1) / kPanel;
    for (int64_t k0 = 0; k0 < K; k0 += kKc) {
      const int64_t kc = std::min(kKc, K - k0);
      pack_kn(wp, packed, N, n0, k0, kc, panels);
      const int64_t n_next = k0 + kKc < K ? n0 : n0 + kNc, k_next = k0 + kKc < K ? k0 + kKc : 0;
      Ahead ahead = n_next < N ? Ahead(wp + k_next * N + n_next, N, std::min(kKc, K - k_next),
                                       std::min(kNc, N - n_next))
                               : Ahead();
      const int64_t per_tile = (ahead.total() + panels * tiles - 1) / (panels * tiles);
      for (int64_t m0 = 0; m0 < M; m0 += kMc) {
        const int64_t m1 = std::min(M, m0 + kMc);
        for (int64_t p = 0; p < panels; ++p) {
          const float* panel = packed + p * kc * kPanel;
          const int64_t n = n0 + p * kPanel;
          for (int64_t m = m0; m < m1; m += kGemmRows) {
            ahead.issue(per_tile);
            with_rows<kGemmRows>(std::min<int64_t>(kGemmRows, m1 - m), [&](auto r) {
              panel_tile_f32<decltype(r)::value>(xp + m * K + k0, K, panel, kc, yp + m * N + n, N, N - n, k0 > 0);
            });
          }
        }
      }
    }
  });
}

// A decode loop's GEMM (a batch of rows against the same weights every step): W's panels packed once, by an
// operation of their own that XLA computes outside the loop, [ceil(N / kPanel), K, kPanel] in W's dtype (zeros past
// N), so that each step reads each panel in order, 48 KB at a time for K = 768 in float32, with nothing to gather.
// At 32 rows on Zen 3, packing W's strided runs in the step read it at 4-5 GB/s a core against 9-10 for a run in
// order, and took as long as the tiles. bfloat16 panels are widened in the tiles, as the rows of W are.
template <typename W>
void pack_panels(ffi::ThreadPool& pool, const W* w, W* out, int64_t K, int64_t N, bool nk) {
  const int64_t panels = (N + kPanel - 1) / kPanel, full = N / kPanel;
  const int workers = int(std::max<int64_t>(1, pool.num_threads()));
  if (nk) {  // 16 rows of W [N, K] transposed into each panel, 64 of K at a time: both sides in cache
    run_chunks(pool, panels, workers, [&](int, int64_t p) {
      const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
      W* panel = out + p * K * kPanel;
      for (int64_t k0 = 0; k0 < K; k0 += 64) {
        const int64_t k1 = std::min(K, k0 + 64);
        for (int64_t j = 0; j < kPanel; ++j) {
          const W* row = w + (n0 + std::min(j, cols - 1)) * K;
          for (int64_t k = k0; k < k1; ++k) panel[k * kPanel + j] = j < cols ? row[k] : W(0);
        }
      }
    });
    return;
  }
  // [K, N]: blocks of W's rows, each row read in order and its runs of kPanel columns copied into the panels.
  const int64_t rows = 16;
  run_chunks(pool, (K + rows - 1) / rows, workers, [&](int, int64_t c) {
    for (int64_t k = c * rows; k < std::min(K, (c + 1) * rows); ++k) {
      const W* row = w + k * N;
      for (int64_t p = 0; p < full; ++p) std::memcpy(out + (p * K + k) * kPanel, row + p * kPanel, sizeof(W) * kPanel);
      if (full < panels) {
        W* tail = out + (full * K + k) * kPanel;
        for (int64_t j = 0; j < kPanel; ++j) tail[j] = full * kPanel + j < N ? row[full * kPanel + j] : W(0);
      }
    }
  });
}

// Rows of x per tile: kGemmRows, but the last kGemmRows + 1 to 2 kGemmRows - 1 rows in two tiles of about half (a
// tile of 2 rows has 4 chains of sums, too few to hide the FMA's latency).
inline int64_t tile_rows(int64_t left) {
  return left <= kGemmRows ? left : left < 2 * kGemmRows ? (left + 1) / 2 : kGemmRows;
}

#if defined(__AVX512F__)
// Panels per chunk of work: one, which the hardware prefetcher streams alone. On an AMD EPYC with AVX-512, chunks of
// two panels, the second prefetched into L2 as the first's tiles ran, took 10% longer at 32 rows, and chunks of eight
// (three for N = 768, between two workers) a third longer, with tiles of 6 rows. Prefetching the panel the worker runs
// next, as the bfloat16 GEMM does, took GPT-2's decode GEMMs 9% longer at 32 rows: a float32 panel is twice the bytes.
constexpr int64_t kPanelsPerChunk = 1;
#else
constexpr int64_t kPanelsPerChunk = 8;  // panels per chunk of work: 128 columns, the next panel prefetched
#endif

template <typename W>
void gemm_panels_f32(ffi::ThreadPool& pool, const float* xp, const W* panels, float* yp, int64_t M, int64_t K,
                     int64_t N) {
  const int64_t count = (N + kPanel - 1) / kPanel;
  int64_t tiles = 0;
  for (int64_t m = 0; m < M; m += tile_rows(M - m)) ++tiles;
  const int64_t every = tiles, share = (K + every - 1) / every;  // each tile prefetches `share` of the next panel
  run_chunks(pool, (count + kPanelsPerChunk - 1) / kPanelsPerChunk, int(std::max<int64_t>(1, pool.num_threads())),
             [&](int, int64_t c) {
               const int64_t p1 = std::min(count, (c + 1) * kPanelsPerChunk);
               for (int64_t p = c * kPanelsPerChunk; p < p1; ++p) {
                 const W* panel = panels + p * K * kPanel;
                 const W* next = p + 1 < p1 ? panel + K * kPanel : nullptr;
                 const int64_t n = p * kPanel;
                 int64_t t = 0;
                 for (int64_t m = 0, r; m < M; m += r, ++t) {
                   r = tile_rows(M - m);
                   const W* ahead = next ? next + t * share * kPanel : nullptr;
                   with_rows<kGemmRows>(r, [&](auto rows) {
                     panel_tile_f32<decltype(rows)::value>(xp + m * K, K, panel, K, yp + m * N + n, N, N - n, false,
                                                           ahead, every);
                   });
                 }
               }
             });
}
#endif

// A [K, N] weight of a few rows' matmul and its result (kn_split).
template <typename W>
struct KnMatrix {
  const W* w;
  float* y;
  int64_t N;
};

// y_i = x . W_i for `count` (up to kMaxMatrices) [K, N_i] weights of one x (M <= kMaxRows rows): a layer's query,
// key and value projections in one call, where three calls each paid the pool's hand-off and left the memory idle
// between them. Split K: each chunk of rows of a weight sums into its own accumulator, and a weight's accumulators
// are added pairwise up a fixed binary tree over its chunks (left + right), so the result does not depend on which
// worker took which chunk (greedy decoding gives the same tokens each run), nor on the weights beside it. The worker
// that completes a pair adds it, while the other goes on to the next chunk.
constexpr int kMaxMatrices = 3;
template <typename W>
void kn_split(ffi::ThreadPool& pool, const float* xp, const KnMatrix<W>* mats, int count, int64_t M, int64_t K,
              int64_t split) {
  constexpr int64_t kMaxChunks = 16;  // a tree of four levels below
  // `split` chunks a weight (tests), else one per worker, of at least 64 rows: each chunk pays a start of its own (its
  // accumulator, the prefetch's ramp, an add up the tree), so more chunks than workers only add starts
  // (docs/performance.md, "One chunk a worker").
  const int max_workers = int(std::max<int64_t>(1, pool.num_threads()));
  const int64_t chunks =
    std::max<int64_t>(1, std::min<int64_t>(kMaxChunks, split > 0 ? split : std::min<int64_t>(K / 64, max_workers)));
  const int64_t per = (K / chunks + 3) / 4 * 4;
  const int workers = int(std::min<int64_t>(max_workers, chunks * count));
  int64_t offset[kMaxMatrices + 1] = {0};  // each weight's accumulators in the scratch
  for (int i = 0; i < count; ++i) offset[i + 1] = offset[i] + chunks * M * mats[i].N;
  const auto acc = scratch_of<float>(size_t(offset[count]));
  float* const base = acc.get();
  // per weight, per level of the tree (2^4 chunks), per pair: halves done
  std::atomic<int> arrived[kMaxMatrices][4][kMaxChunks / 2] = {};
  run_chunks(pool, chunks * count, workers, [&](int, int64_t job) {
    const int i = int(job / chunks);
    const int64_t c = job % chunks, N = mats[i].N, MN = M * N;
    const int64_t k0 = c * per, k1 = c + 1 == chunks ? K : std::min(K, (c + 1) * per);
    float* const ap = base + offset[i];
    float* a = ap + c * MN;
    std::fill(a, a + MN, 0.0f);
    if (k0 < k1) KN_ROWS(xp, mats[i].w, a, M, K, N, k0, k1, 0, N);
    for (int level = 0; (int64_t(1) << level) < chunks; ++level) {
      const int64_t node = c >> level, left = (node & ~int64_t(1)) << level, right = left + (int64_t(1) << level);
      if (right >= chunks) continue;  // no right half: the left goes up as it is
      if (arrived[i][level][node >> 1].fetch_add(1, std::memory_order_acq_rel) == 0) return;  // the other adds them
      float* __restrict l = ap + left * MN;
      const float* __restrict r = ap + right * MN;
#pragma GCC ivdep
      for (int64_t e = 0; e < MN; ++e) l[e] += r[e];
    }
  });
  for (int i = 0; i < count; ++i) std::memcpy(mats[i].y, base + offset[i], sizeof(float) * M * mats[i].N);
}

template <typename W>
ffi::Error matvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y,
                  bool nk, int64_t split) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("matvec: x and w must be 2-d");
  const int64_t M = xd[0], K = xd[1], N = nk ? wd[0] : wd[1];
  if ((nk ? wd[1] : wd[0]) != K) return ffi::Error::InvalidArgument("matvec: contracting sizes differ");
  if (M > kMaxRows) {
#if defined(SHARDZOO_GEMM)
    gemm_f32(pool, x.typed_data(), reinterpret_cast<const W*>(w.untyped_data()), y->typed_data(), M, K, N, nk);
    return ffi::Error::Success();
#else
    return ffi::Error::InvalidArgument("matvec: more rows than the kernel takes");
#endif
  }
  const float* xp = x.typed_data();
  const W* wp = reinterpret_cast<const W*>(w.untyped_data());
  float* yp = y->typed_data();
  const int max_workers = int(std::max<int64_t>(1, pool.num_threads()));
  if (nk) {
    const int64_t rows = 256;  // 768-wide rows: 0.4-0.8 MB of weights per chunk
    const int64_t chunks = (N + rows - 1) / rows;
    run_chunks(pool, chunks, max_workers, [&](int, int64_t c) {
      NK_ROWS(xp, wp, yp, M, K, N, c * rows, std::min(N, (c + 1) * rows));
    });
    return ffi::Error::Success();
  }
  if (N >= kBand * 4) {  // a wide W (an untied head): bands of columns, each written by one worker
    const int64_t chunks = (N + kBand - 1) / kBand;
    run_chunks(pool, chunks, max_workers, [&](int, int64_t c) {
      const int64_t n0 = c * kBand, n1 = std::min(N, n0 + kBand);
      for (int64_t m = 0; m < M; ++m) std::fill(yp + m * N + n0, yp + m * N + n1, 0.0f);
      KN_ROWS(xp, wp, yp, M, K, N, 0, K, n0, n1);
    });
    return ffi::Error::Success();
  }
  const KnMatrix<W> one{wp, yp, N};
  kn_split(pool, xp, &one, 1, M, K, split);
  return ffi::Error::Success();
}

ffi::Error dispatch(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y,
                    bool nk, int64_t split) {
  switch (w.element_type()) {
    case ffi::DataType::F32:
      return matvec<float>(pool, x, w, y, nk, split);
    case ffi::DataType::BF16:
      return matvec<uint16_t>(pool, x, w, y, nk, split);
    default:
      return ffi::Error::InvalidArgument("matvec: weights must be float32 or bfloat16");
  }
}

// fn(the buffer's data as float* or uint16_t*) for a float32 or bfloat16 buffer; else the error `wrong`.
template <typename B, typename Fn>
ffi::Error by_dtype(B& buffer, const std::string& wrong, Fn fn) {
  switch (buffer.element_type()) {
    case ffi::DataType::F32:
      fn(reinterpret_cast<float*>(buffer.untyped_data()));
      return ffi::Error::Success();
    case ffi::DataType::BF16:
      fn(reinterpret_cast<uint16_t*>(buffer.untyped_data()));
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument(wrong);
  }
}

// Three [K, N_i] weights of one dtype against one x of up to kMaxRows rows (kernels.matmuls): kn_split over all of
// them in one call. Each N_i below kBand * 4: a wider weight takes matvec's bands of columns, one call each.
ffi::Error matvec3(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w0, ffi::AnyBuffer w1,
                   ffi::AnyBuffer w2, ffi::Result<ffi::Buffer<ffi::F32>> y0, ffi::Result<ffi::Buffer<ffi::F32>> y1,
                   ffi::Result<ffi::Buffer<ffi::F32>> y2, int64_t split) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || xd[0] > kMaxRows) return ffi::Error::InvalidArgument("matvec3: x must be [M <= 8, K]");
  if (w1.element_type() != w0.element_type() || w2.element_type() != w0.element_type())
    return ffi::Error::InvalidArgument("matvec3: the weights must share a dtype");
  const int64_t M = xd[0], K = xd[1];
  ffi::AnyBuffer ws[3] = {w0, w1, w2};
  ffi::Result<ffi::Buffer<ffi::F32>> ys[3] = {y0, y1, y2};
  for (int i = 0; i < 3; ++i) {
    const auto wd = ws[i].dimensions(), yd = ys[i]->dimensions();
    if (wd.size() != 2 || wd[0] != K || yd.size() != 2 || yd[0] != M || yd[1] != wd[1] || wd[1] >= kBand * 4)
      return ffi::Error::InvalidArgument("matvec3: each w must be [K, N < 16384] and its y [M, N]");
  }
  return by_dtype(w0, "matvec3: weights must be float32 or bfloat16", [&](auto* first) {
    using W = std::remove_pointer_t<decltype(first)>;
    KnMatrix<W> mats[3];
    for (int i = 0; i < 3; ++i)
      mats[i] = {reinterpret_cast<const W*>(ws[i].untyped_data()), ys[i]->typed_data(), ws[i].dimensions()[1]};
    kn_split(pool, x.typed_data(), mats, 3, M, K, split);
  });
}

// W packed into the float32 GEMM's panels ([ceil(N / kPanel), K, kPanel] in W's dtype; shardzoo_gemm_panel says
// kPanel), and that GEMM over them: a decode loop's weights, packed once outside it.
ffi::Error pack_f32(ffi::ThreadPool pool, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> out, bool nk) {
#if defined(SHARDZOO_GEMM)
  const auto wd = w.dimensions();
  const auto od = out->dimensions();
  if (wd.size() != 2 || od.size() != 3 || out->element_type() != w.element_type())
    return ffi::Error::InvalidArgument("pack_f32: w must be 2-d, out 3-d in w's dtype");
  const int64_t K = nk ? wd[1] : wd[0], N = nk ? wd[0] : wd[1];
  if (od[0] != (N + kPanel - 1) / kPanel || od[1] != K || od[2] != kPanel)
    return ffi::Error::InvalidArgument("pack_f32: out must be [ceil(N / panel), K, panel]");
  return by_dtype(w, "pack_f32: weights must be float32 or bfloat16", [&](auto* wp) {
    pack_panels<std::remove_pointer_t<decltype(wp)>>(pool, wp, reinterpret_cast<decltype(wp)>(out->untyped_data()),
                                                     K, N, nk);
  });
#else
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "built without the float32 GEMM");
#endif
}

ffi::Error gemm_f32_packed(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer panels,
                           ffi::ResultBuffer<ffi::F32> y) {
#if defined(SHARDZOO_GEMM)
  const auto xd = x.dimensions();
  const auto pd = panels.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || yd.size() != 2 || pd[1] != xd[1] || pd[2] != kPanel || yd[0] != xd[0] ||
      (yd[1] + kPanel - 1) / kPanel != pd[0])
    return ffi::Error::InvalidArgument("gemm_f32_packed: x [M, K], panels [ceil(N / panel), K, panel], y [M, N]");
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  return by_dtype(panels, "gemm_f32_packed: panels must be float32 or bfloat16",
                  [&](auto* pp) {
                    gemm_panels_f32<std::remove_pointer_t<decltype(pp)>>(pool, xp, pp, yp, xd[0], xd[1], yd[1]);
                  });
#else
  return ffi::Error(ffi::ErrorCode::kUnimplemented, "built without the float32 GEMM");
#endif
}

#if defined(__AVX512BF16__)
// bfloat16 x bfloat16 for more rows (a prefill, a batch above kMaxRows): W in 32-column panels (32 rows of an NK
// head), each packed once into `panel` (K registers' worth, in L1/L2) as the bfloat16 pairs AVX-512 BF16's vdpbf16ps
// takes, and read by every tile of 8 rows of x, whose 8 x 32 float32 sums stay in registers (as torch's oneDNN path
// multiplies; XLA's CPU dot widens both operands into float32 copies first). K must be even (every model's widths
// are).
#define SHARDZOO_BF16_GEMM 1

inline __mmask32 panel_cols(int64_t N, int64_t n) {
  return N - n >= 32 ? ~__mmask32(0) : __mmask32((1ull << (N - n)) - 1);
}

// KN, bfloat16: rows k and k+1 interleaved into (W[k, n], W[k+1, n]) pairs, the lanes vdpbf16ps takes; panel[k]
// and panel[k + 1] hold the pairs of columns [n, n + 16) and [n + 16, n + 32).
void pack_panel(const uint16_t* w, __m512i* panel, int64_t K, int64_t N, int64_t n) {
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  const __mmask32 cols = panel_cols(N, n);
  for (int64_t k = 0; k < K; k += 2) {
    const __m512i r0 = _mm512_maskz_loadu_epi16(cols, w + k * N + n);
    const __m512i r1 = _mm512_maskz_loadu_epi16(cols, w + (k + 1) * N + n);
    _mm512_storeu_si512(panel + k, _mm512_permutex2var_epi16(r0, lo, r1));
    _mm512_storeu_si512(panel + k + 1, _mm512_permutex2var_epi16(r0, hi, r1));
  }
}

inline void transpose16(__m512i r[16]) {  // 16 x 16 dwords
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

// NK (a tied head, W [N, K]): the same panel from 32 rows of W, each row's (W[n, k], W[n, k+1]) pairs (a dword)
// transposed in blocks of 16 dwords of 16 rows, so that the head runs the KN tiles.
void pack_panel_nk(const uint16_t* w, __m512i* panel, int64_t K, int64_t N, int64_t n) {
  const int64_t dwords = K / 2;
  const int32_t* d = reinterpret_cast<const int32_t*>(w);
  for (int64_t p0 = 0; p0 < dwords; p0 += 16) {
    const __mmask16 cols = tail(dwords - p0);
    for (int h = 0; h < 2; ++h) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) {
        const int64_t row = n + 16 * h + j;
        r[j] = row < N ? _mm512_maskz_loadu_epi32(cols, d + row * dwords + p0) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int64_t i = 0; i < std::min<int64_t>(16, dwords - p0); ++i)
        _mm512_storeu_si512(panel + 2 * (p0 + i) + h, r[i]);
    }
  }
}

// R rows of x against a packed panel: per step, a broadcast pair (x[m, k], x[m, k+1]) of each row against the
// panel's two registers of that step.
template <int R, typename Y>
void panel_tile(const uint16_t* x, const __m512i* panel, Y* y, int64_t K, int64_t N, int64_t m0, int64_t n,
                const __m512i* ahead) {
  const __mmask32 cols = panel_cols(N, n);
  __m512 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + k), b1 = (__m512bh)_mm512_loadu_si512(panel + k + 1);
    if (ahead) {  // the next panel, as far into it as this tile is into its own
      _mm_prefetch(reinterpret_cast<const char*>(ahead + k), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(ahead + k + 1), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_broadcastd_epi32(_mm_loadu_si32(x + (m0 + r) * K + k));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    Y* out = y + (m0 + r) * N + n;
    if constexpr (sizeof(Y) == 2) {  // rounded to bfloat16 (to nearest even) here, not in a pass of XLA's after
      _mm512_mask_storeu_epi16(out, cols, (__m512i)_mm512_cvtne2ps_pbh(acc[r][1], acc[r][0]));
    } else {
      _mm512_mask_storeu_ps(out, __mmask16(cols), acc[r][0]);
      _mm512_mask_storeu_ps(out + 16, __mmask16(cols >> 16), acc[r][1]);
    }
  }
}

// The tiles of M rows against one panel; the first also prefetches `ahead` (the packed panel its worker runs next,
// or null).
template <typename Y>
void panel_rows(const uint16_t* x, const __m512i* panel, Y* y, int64_t M, int64_t K, int64_t N, int64_t n,
                const __m512i* ahead = nullptr) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8, ahead = nullptr) panel_tile<8, Y>(x, panel, y, K, N, m, n, ahead);
  switch (M - m) {  // the rows left over, in one tile of their own
    case 7: panel_tile<7, Y>(x, panel, y, K, N, m, n, ahead); break;
    case 6: panel_tile<6, Y>(x, panel, y, K, N, m, n, ahead); break;
    case 5: panel_tile<5, Y>(x, panel, y, K, N, m, n, ahead); break;
    case 4: panel_tile<4, Y>(x, panel, y, K, N, m, n, ahead); break;
    case 3: panel_tile<3, Y>(x, panel, y, K, N, m, n, ahead); break;
    case 2: panel_tile<2, Y>(x, panel, y, K, N, m, n, ahead); break;
    case 1: panel_tile<1, Y>(x, panel, y, K, N, m, n, ahead); break;
    default: break;
  }
}

inline void pack_panel_any(const uint16_t* w, __m512i* panel, int64_t K, int64_t N, int64_t n, bool nk) {
  if (nk)
    pack_panel_nk(w, panel, K, N, n);
  else
    pack_panel(w, panel, K, N, n);
}

// The tiles over W's panels. `packed` null: two panels a chunk of work, each packed from W as it is needed, into the
// worker's scratch. Else the panels W's packing (`pack_bf16`) laid out ahead, one a chunk: in a decode loop XLA
// computes that packing once, outside the loop (its operand, a weight, is the same every step), so each step streams
// its panels with nothing to gather (at 32 rows, packing from W's strided rows took as long as the tiles that use a
// panel). A panel's first tile prefetches the panel its worker runs next: against prefetching the panel next in memory,
// which the other worker usually runs, GPT-2's decode GEMMs took 0.88x the time at 32 rows and 0.83x at 16.
template <typename Y>
void gemm_panels(ffi::ThreadPool& pool, const uint16_t* xp, const uint16_t* wp, const __m512i* packed, Y* yp,
                 int64_t M, int64_t K, int64_t N, bool nk) {
  const int max_workers = int(std::max<int64_t>(1, pool.num_threads()));
  if (packed) {
    run_chunks_ahead(pool, (N + 31) / 32, max_workers, [&](int, int64_t p, int64_t next) {
      panel_rows(xp, packed + p * K, yp, M, K, N, p * 32, next >= 0 ? packed + next * K : nullptr);
    });
    return;
  }
  const auto scratch = scratch_of<__m512i>(size_t(max_workers) * K);  // a panel per worker
  run_chunks(pool, (N + 63) / 64, max_workers, [&](int worker, int64_t c) {
    for (int64_t n = c * 64; n < std::min(N, (c + 1) * 64); n += 32) {
      __m512i* panel = scratch.get() + worker * K;
      pack_panel_any(wp, panel, K, N, n, nk);
      panel_rows(xp, panel, yp, M, K, N, n);
    }
  });
}

bool gemm_shapes(ffi::Span<const int64_t> xd, ffi::Span<const int64_t> wd, bool nk, int64_t& M, int64_t& K,
                 int64_t& N) {
  if (xd.size() != 2 || wd.size() != 2) return false;
  M = xd[0], K = xd[1], N = nk ? wd[0] : wd[1];
  return (nk ? wd[1] : wd[0]) == K && K % 2 == 0;
}

// y in float32 or bfloat16 (a bfloat16 model's Dense layers: XLA would round a float32 result in a pass of its own,
// a tenth of a bfloat16 prefill's time at batch 32).
ffi::Error gemm_bf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w, ffi::Result<ffi::AnyBuffer> y,
                     bool nk) {
  int64_t M, K, N;
  if (!gemm_shapes(x.dimensions(), w.dimensions(), nk, M, K, N))
    return ffi::Error::InvalidArgument("gemm_bf16: x and w must be 2-d, K the same and even");
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.untyped_data());
  return by_dtype(*y, "gemm_bf16: the result must be float32 or bfloat16",
                  [&](auto* yp) { gemm_panels(pool, xp, wp, nullptr, yp, M, K, N, nk); });
}

// W's panels as gemm_packed reads them: [ceil(N / 32), K, 32] bfloat16, the columns past N zero.
ffi::Error pack_bf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::BF16> out, bool nk) {
  const auto wd = w.dimensions();
  const auto od = out->dimensions();
  if (wd.size() != 2 || od.size() != 3) return ffi::Error::InvalidArgument("pack_bf16: w must be 2-d, out 3-d");
  const int64_t K = nk ? wd[1] : wd[0], N = nk ? wd[0] : wd[1];
  if (K % 2 || od[0] != (N + 31) / 32 || od[1] != K || od[2] != 32)
    return ffi::Error::InvalidArgument("pack_bf16: out must be [ceil(N / 32), K, 32] and K even");
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.untyped_data());
  __m512i* panels = reinterpret_cast<__m512i*>(out->untyped_data());
  run_chunks(pool, od[0], int(std::max<int64_t>(1, pool.num_threads())), [&](int, int64_t p) {
    pack_panel_any(wp, panels + p * K, K, N, p * 32, nk);
  });
  return ffi::Error::Success();
}

ffi::Error gemm_packed(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> packed,
                       ffi::Result<ffi::AnyBuffer> y) {
  const auto xd = x.dimensions();
  const auto pd = packed.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || pd.size() != 3 || yd.size() != 2 || pd[1] != xd[1] || pd[2] != 32 || yd[0] != xd[0] ||
      (yd[1] + 31) / 32 != pd[0] || xd[1] % 2)
    return ffi::Error::InvalidArgument("gemm_packed: x [M, K], packed [ceil(N / 32), K, 32], y [M, N], K even");
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const __m512i* pp = reinterpret_cast<const __m512i*>(packed.untyped_data());
  return by_dtype(*y, "gemm_packed: the result must be float32 or bfloat16",
                  [&](auto* yp) { gemm_panels(pool, xp, nullptr, pp, yp, xd[0], xd[1], yd[1], false); });
}
#else
ffi::Error unbuilt() { return ffi::Error(ffi::ErrorCode::kUnimplemented, "built without AVX-512 BF16"); }
ffi::Error gemm_bf16(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::BF16>, ffi::Result<ffi::AnyBuffer>, bool) {
  return unbuilt();
}
ffi::Error pack_bf16(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::ResultBuffer<ffi::BF16>, bool) { return unbuilt(); }
ffi::Error gemm_packed(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::BF16>, ffi::Result<ffi::AnyBuffer>) {
  return unbuilt();
}
#endif

// One new query per row against its KV cache (a decode step's attention): for each row b and KV head g, the R
// query heads of g read each cached key and value once, widened in registers. XLA's CPU compiler widens a
// bfloat16 cache into a float32 copy every step and runs the two products as batched dots of one row each; at
// batch 32 that was two thirds of a GPT-2 step's non-matmul time. Scores, softmax and output are float32, in the
// order layers.Attention's XLA path takes: scale, soft cap, mask (finfo.min), softmax with the sink's logit in its
// denominator.
inline float cap_score(float s, float softcap) { return softcap > 0 ? softcap * std::tanh(s / softcap) : s; }

// The softmax of the scores s[c0, c1) in place, left unnormalised: each scaled, soft-capped and added to bias[c] (0,
// or the mask's lowest), then exp(s - max), the max and the sum taken with the sink's logit where there is one (nullptr:
// none; `lowest`, the max without one). Returns 1 / the sum. The exponentials run in vector registers (vexp), the
// span's last, partial register masked: a scalar std::exp a score was 5-11% of GPT-2's attention over the cache at
// batch 32, half of it at one row, and the partial registers' scalar tails an eighth of its prompt attention.
inline float softmax_span(float* s, const float* bias, int64_t c0, int64_t c1, float scale, float softcap,
                          const float* sink, float lowest) {
  float m = sink ? *sink : lowest;
  int64_t c = c0;
#if defined(SHARDZOO_SIMD)
  if (softcap <= 0) {
    vf vm = vset1(lowest);
    for (; c < c1; c += kLanes) {
      const int64_t left = c1 - c;
      const vf x = vadd(vmul(vload(s + c, left), vset1(scale)), vload(bias + c, left));
      vstore(s + c, x, left);
      vm = vmax(vm, vkeep(x, vset1(lowest), left));
    }
    m = std::max(m, vhmax(vm));
  }
#endif
  for (; c < c1; ++c) m = std::max(m, s[c] = cap_score(s[c] * scale, softcap) + bias[c]);
  float total = sink ? std::exp(*sink - m) : 0.0f;
  c = c0;
#if defined(SHARDZOO_SIMD)
  vf vt = vzero();
  for (; c < c1; c += kLanes) {
    const int64_t left = c1 - c;
    const vf e = vkeep(vexp(vadd(vload(s + c, left), vset1(-m))), vzero(), left);
    vstore(s + c, e, left);
    vt = vadd(vt, e);
  }
  total += vsum(vt);
#endif
  for (; c < c1; ++c) total += (s[c] = std::exp(s[c] - m));
  return 1.0f / total;
}

#if defined(SHARDZOO_SIMD)
// Four keys' dot products with q at once: four sums in registers (a chain of FMAs per key would wait on each FMA's
// latency), each key's row read in order.
template <typename C>
inline void dot_rows4(const float* q, const C* k, int64_t K, float* out) {
  vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  for (int64_t i = 0; i < K; i += kLanes) {
    const int64_t left = K - i;
    const vf qv = vload(q + i, left);
    a0 = vfma(qv, vload(k + i, left), a0);
    a1 = vfma(qv, vload(k + K + i, left), a1);
    a2 = vfma(qv, vload(k + 2 * K + i, left), a2);
    a3 = vfma(qv, vload(k + 3 * K + i, left), a3);
  }
  out[0] = vsum(a0), out[1] = vsum(a1), out[2] = vsum(a2), out[3] = vsum(a3);
}

// o[0, V kLanes) (+)= sum over n slots of p[c] v[c, 0..): V registers of sums, each value row read once (a row of
// o loaded and stored for every slot would make each slot wait on the last one's store).
template <int V, typename C>
inline void weigh_rows(const float* p, const C* v, const bool* mask, int64_t n, int64_t K, int64_t left, bool more,
                       float* o) {
  vf acc[V];
#pragma GCC unroll 8
  for (int j = 0; j < V; ++j) acc[j] = more ? vload(o + j * kLanes, left - j * kLanes) : vzero();
  for (int64_t c = 0; c < n; ++c) {
    if (!mask[c]) continue;  // weight 0 (exp of finfo.min less a real score), unless every slot is masked
    const vf pv = vset1(p[c]);
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j) acc[j] = vfma(pv, vload(v + c * K + j * kLanes, left - j * kLanes), acc[j]);
  }
#pragma GCC unroll 8
  for (int j = 0; j < V; ++j) vstore(o + j * kLanes, acc[j], left - j * kLanes);
}
#endif

template <typename C>
inline float dot_row(const float* q, const C* k, int64_t K) {
  float s = 0;
  for (int64_t i = 0; i < K; ++i) s += q[i] * widen(k[i]);
  return s;
}

// The R query heads q[R, K] of one KV head over its first n slots k, v [n, K]; s: scratch of (R + 1) x n floats (the
// scores, the mask's biases). Each key
// and value is read from memory once for all R heads: four keys at a time against every head, then 64 slots' values
// at a time (from L1) by every head.
template <typename C>
void attend_group(const float* q, const C* k, const C* v, const bool* mask, int64_t n, int64_t K, int64_t R,
                  float scale, float softcap, const float* sinks, float* s, float* o, const C* next_k = nullptr) {
  constexpr float lowest = -std::numeric_limits<float>::max();
  int64_t c = 0;
#if defined(SHARDZOO_SIMD)
  for (; c + 4 <= n; c += 4) {
    // The values weighed next, into L2 while the keys stream: a second stream of reads in flight.
    prefetch<_MM_HINT_T1>(v + c * K, 4 * K);
    for (int64_t r = 0; r < R; ++r) dot_rows4(q + r * K, k + c * K, K, s + r * n + c);
  }
#endif
  for (; c < n; ++c)
    for (int64_t r = 0; r < R; ++r) s[r * n + c] = dot_row(q + r * K, k + c * K, K);
  float* bias = s + R * n;  // a masked slot's score: finfo.min, as the XLA path's (its weight is 0 all the same)
  for (c = 0; c < n; ++c) bias[c] = mask[c] ? 0.0f : lowest;
  for (int64_t r = 0; r < R; ++r) {
    float* sr = s + r * n;
    const float inv = softmax_span(sr, bias, 0, n, scale, softcap, sinks ? sinks + r : nullptr, lowest);
    for (c = 0; c < n; ++c) sr[c] *= inv;
  }
#if defined(SHARDZOO_SIMD)
  constexpr int64_t kSlots = 64, kBlock = 8 * kLanes;  // slots per block (L1); columns of o per pass: 8 registers
  if (n == 0) std::fill(o, o + R * K, 0.0f);
  for (int64_t c0 = 0; c0 < n; c0 += kSlots) {
    const int64_t cn = std::min(kSlots, n - c0);
    // The keys of this worker's next group into L2 while these values, already there, are weighed: the memory
    // would idle otherwise (GPT-2's 12 layers at batch 32, bfloat16: 0.88x the time; at batch 1 no change).
    if (next_k) prefetch<_MM_HINT_T1>(next_k + c0 * K, cn * K);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < K; i += kBlock) {
        const int64_t left = K - i;
        with_rows<8>((std::min(left, kBlock) + kLanes - 1) / kLanes, [&](auto vecs) {
          weigh_rows<decltype(vecs)::value>(s + r * n + c0, v + c0 * K + i, mask + c0, cn, K, left, c0 > 0,
                                            o + r * K + i);
        });
      }
  }
#else
  std::fill(o, o + R * K, 0.0f);
  for (c = 0; c < n; ++c) {
    if (!mask[c]) continue;  // weight 0 (exp of finfo.min less a real score), unless every slot is masked
    for (int64_t r = 0; r < R; ++r)
      for (int64_t i = 0; i < K; ++i) o[r * K + i] += s[r * n + c] * widen(v[c * K + i]);
  }
#endif
}

// fn(float{} or uint16_t{}), the element type of an attention's keys and values, float32 or bfloat16 alike; else
// the error "<who>: k and v differ" or "<who>: <what> must be float32 or bfloat16".
template <typename Fn>
ffi::Error by_kv_dtype(const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, const std::string& who,
                       const std::string& what, Fn fn) {
  if (k.element_type() != v.element_type()) return ffi::Error::InvalidArgument(who + ": k and v differ");
  switch (k.element_type()) {
    case ffi::DataType::F32:
      return fn(float{});
    case ffi::DataType::BF16:
      return fn(uint16_t{});
    default:
      return ffi::Error::InvalidArgument(who + ": " + what + " must be float32 or bfloat16");
  }
}

// A decode step's attention: each group's new key and value (k_new, v_new: (B, G, K) rows) written into slot `at` of
// its cache just before the group's keys are read, then its R query heads over the first n slots. Written by calls
// of their own, GPT-2's 24 writes a step took 45 us each at batch 32, each of a write's 384 rows of 128 bytes in a
// 4 KB page of its own.
template <typename T>
void decode_attention(ffi::ThreadPool& pool, const float* qp, T* kp, T* vp, const T* k_new, const T* v_new,
                      int64_t at, const bool* mp, int64_t B, int64_t H, int64_t K, int64_t G, int64_t C, int64_t n,
                      const float* sp, float* op, float scale, float softcap) {
  const int64_t R = H / G;
  const int max_workers = int(std::max<int64_t>(1, pool.num_threads()));
  const int64_t scores = (R + 1) * std::max<int64_t>(n, 1);  // a worker's scratch: scores and the mask's biases
  std::vector<float> scratch(size_t(max_workers) * scores);
  run_chunks_ahead(pool, B * G, max_workers, [&](int worker, int64_t item, int64_t next) {
    const int64_t b = item / G, g = item % G, base = item * C * K;
    std::memcpy(kp + base + at * K, k_new + item * K, K * sizeof(T));
    std::memcpy(vp + base + at * K, v_new + item * K, K * sizeof(T));
    attend_group(qp + (b * H + g * R) * K, kp + base, vp + base, mp + b * C, n, K, R, scale, softcap,
                 sp ? sp + g * R : nullptr, scratch.data() + worker * scores, op + (b * H + g * R) * K,
                 next >= 0 ? kp + next * C * K : nullptr);
  });
}

// kernels.decode_attention: k_new and v_new (the caches' shape with one slot) written into slot `at` (clamped into
// the cache) of k and v, whose buffers the results k_out and v_out are (aliased), then q against the first `filled`
// slots where the mask is set. A cache of one row may come without its batch axis (G, C, K): layers.Attention
// carries it so, and adding the axis back made XLA copy the cache to write it.
ffi::Error attention_dispatch(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> filled, ffi::Buffer<ffi::F32> sinks,
                              ffi::AnyBuffer k_new, ffi::AnyBuffer v_new, ffi::Buffer<ffi::S32> at,
                              ffi::ResultBuffer<ffi::F32> out, ffi::Result<ffi::AnyBuffer> k_out,
                              ffi::Result<ffi::AnyBuffer> v_out, float scale, float softcap, bool has_sinks) {
  const auto qd = q.dimensions(), kd = k.dimensions(), nd = k_new.dimensions();
  if (qd.size() != 3 || kd.size() < 3 || kd.size() > 4 ||
      !std::equal(kd.begin(), kd.end(), v.dimensions().begin(), v.dimensions().end()))
    return ffi::Error::InvalidArgument("decode_attention: q (B, H, K), k and v (B, G, C, K) or (G, C, K)");
  const size_t lead = kd.size() - 3;
  const int64_t B = qd[0], H = qd[1], K = qd[2], G = kd[lead], C = kd[lead + 1];
  if ((lead ? kd[0] : 1) != B || kd[lead + 2] != K || H % G || mask.element_count() != size_t(B * C))
    return ffi::Error::InvalidArgument("decode_attention: q, cache and mask sizes differ");
  if (k_new.element_type() != k.element_type() || v_new.element_type() != k.element_type() ||
      nd.size() != kd.size() || !std::equal(nd.begin(), nd.end(), v_new.dimensions().begin(), v_new.dimensions().end()))
    return ffi::Error::InvalidArgument("decode_attention: k_new and v_new must be the cache's dtype and rank");
  for (size_t i = 0; i < kd.size(); ++i)
    if (nd[i] != (i == kd.size() - 2 ? 1 : kd[i]))
      return ffi::Error::InvalidArgument("decode_attention: k_new and v_new must be the cache's shape, one slot");
  const int64_t n = std::clamp<int64_t>(filled.typed_data()[0], 0, C);
  const int64_t slot = std::clamp<int64_t>(at.typed_data()[0], 0, C - 1);
  return by_kv_dtype(k, v, "decode_attention", "the cache", [&](auto c) {
    using T = decltype(c);
    T* kp = reinterpret_cast<T*>(k_out->untyped_data());
    T* vp = reinterpret_cast<T*>(v_out->untyped_data());
    if (kp != k.untyped_data()) std::memcpy(kp, k.untyped_data(), k.size_bytes());  // XLA did not alias them
    if (vp != v.untyped_data()) std::memcpy(vp, v.untyped_data(), v.size_bytes());
    decode_attention<T>(pool, q.typed_data(), kp, vp, reinterpret_cast<const T*>(k_new.untyped_data()),
                        reinterpret_cast<const T*>(v_new.untyped_data()), slot, mask.typed_data(), B, H, K, G, C, n,
                        has_sinks ? sinks.typed_data() : nullptr, out->typed_data(), scale, softcap);
    return ffi::Error::Success();
  });
}

// A prompt's causal attention (the prefill), q (B, T, H, K) against k and v (B, T, G, K) as the projections make them:
// XLA's CPU compiler transposes the keys and values into the layout its dot wants with loops that ran at under 1
// GB/s, and runs the masks and softmax as separate passes (GPT-2's layer at 32 x 128: 62 ms against this loop's 8.5).
// One work item is a row's KV head: its keys transposed once into scratch (K x T, from L1/L2 afterwards), then for
// each of its R query heads, six queries at a time, the scores of the keys they may see, the softmax in float32
// (scaled, soft-capped, masked as attention.attend's XLA path, whose finfo.min weighs a masked key 0 as this -inf
// does; the sinks' logits in the denominator) and the weighted values, the six queries' sums together. Key s is
// seen by query t where s <= t, t - s < window (0: no window) and valid[b, s]; a query that sees no key (a left
// pad's) gets zeros, an output nothing reads. A bfloat16 query over bfloat16 keys and values takes AVX-512 BF16's
// dot products where the CPU has them: GPT-2's 12 layers at 32 rows of 128 tokens 0.78x the float32 FMAs' time, one
// row of 1,024 tokens 0.67x.
#if defined(SHARDZOO_SIMD)
// s[i * T + c] for the kQ queries q[i] and the keys c in [c0, c0 + min(n, W kLanes)), from the transposed keys kt
// (K x T): each register of keys loaded once for the tile's queries, each query's element broadcast once for W
// registers. A last register of fewer than kLanes keys is loaded and stored masked (one key at a time, in scalar
// loops, had been a quarter of GPT-2's prompt attention).
template <int W, int kQ>
inline void score_tile(const float* const* q, const float* kt, int64_t T, int64_t K, int64_t c0, int64_t n,
                       float* s) {
  vf a[kQ][W];
#pragma GCC unroll 8
  for (int i = 0; i < kQ; ++i)
    for (int w = 0; w < W; ++w) a[i][w] = vzero();
  for (int64_t d = 0; d < K; ++d) {
    vf kv[W];
    for (int w = 0; w < W; ++w) kv[w] = vload(kt + d * T + c0 + w * kLanes, n - w * kLanes);
#pragma GCC unroll 8
    for (int i = 0; i < kQ; ++i) {
      const vf qv = vset1(q[i][d]);
      for (int w = 0; w < W; ++w) a[i][w] = vfma(qv, kv[w], a[i][w]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < kQ; ++i)
    for (int w = 0; w < W; ++w) vstore(s + i * T + c0 + w * kLanes, a[i][w], n - w * kLanes);
}

// o[i * ldo + ...) = inv[i] x the sum over keys c in [c0, c1) of p[i * T + c] v[c * stride + ...), for Q queries
// and V registers of columns: each key's values loaded once for the Q queries, Q x V sums in registers. One query at
// a time had read every value row again from L2 for each query, and each of its V chains of sums waited on the FMA
// before it.
template <int Q, int V, typename C>
inline void weigh_tile(const float* p, int64_t T, const float* inv, const C* v, int64_t stride, const bool* ok,
                       int64_t c0, int64_t c1, int64_t left, float* o, int64_t ldo) {
  vf acc[Q][V];
#pragma GCC unroll 8
  for (int i = 0; i < Q; ++i)
    for (int j = 0; j < V; ++j) acc[i][j] = vzero();
  for (int64_t c = c0; c < c1; ++c) {
    if (!ok[c]) continue;  // a masked key: weight 0 (its values need not be finite)
    vf vv[V];
#pragma GCC unroll 8
    for (int j = 0; j < V; ++j) vv[j] = vload(v + c * stride + j * kLanes, left - j * kLanes);
#pragma GCC unroll 8
    for (int i = 0; i < Q; ++i) {
      const vf pv = vset1(p[i * T + c]);
      for (int j = 0; j < V; ++j) acc[i][j] = vfma(pv, vv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < Q; ++i)
    for (int j = 0; j < V; ++j) vstore(o + i * ldo + j * kLanes, vmul(acc[i][j], vset1(inv[i])), left - j * kLanes);
}
#endif

#if defined(SHARDZOO_BF16_GEMM)
// score_tile for bfloat16 queries and keys by vdpbf16ps: the keys transposed into pairs kt2 (K/2 x T, each lane a key's
// elements d and d + 1), the queries' pairs q2 broadcast; half the instructions of the float32 FMAs, the products
// exact in float32 as theirs.
template <int W, int kQ>
inline void score_tile_bf16(const uint32_t* q2, const uint32_t* kt2, int64_t T, int64_t K2, int64_t c0, int64_t n,
                            float* s) {
  __m512 a[kQ][W];
  __mmask16 m[W];
  for (int w = 0; w < W; ++w) m[w] = tail(n - w * 16);
#pragma GCC unroll 8
  for (int i = 0; i < kQ; ++i)
    for (int w = 0; w < W; ++w) a[i][w] = _mm512_setzero_ps();
  for (int64_t d = 0; d < K2; ++d) {
    __m512i kv[W];
    for (int w = 0; w < W; ++w) kv[w] = _mm512_maskz_loadu_epi32(m[w], kt2 + d * T + c0 + w * 16);
#pragma GCC unroll 8
    for (int i = 0; i < kQ; ++i) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(int(q2[i * K2 + d]));
      for (int w = 0; w < W; ++w) a[i][w] = _mm512_dpbf16_ps(a[i][w], qv, (__m512bh)kv[w]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < kQ; ++i)
    for (int w = 0; w < W; ++w) _mm512_mask_storeu_ps(s + i * T + c0 + w * 16, m[w], a[i][w]);
}

// weigh_tile for bfloat16 weights p16 (already normalised and rounded, as the XLA path rounds them to the query's
// dtype) and bfloat16 values, J registers of 32 columns: keys c and c + 1 interleaved into the pairs vdpbf16ps takes
// (unpacking within 128-bit lanes leaves each lane's first 4 columns in lo, its last 4 in hi, put back in order at
// the end). A masked key's values are read as zeros (they need not be finite).
template <int Q, int J>
inline void weigh_tile_bf16(const uint16_t* p16, int64_t T, const uint16_t* v, int64_t stride, const bool* ok,
                            int64_t c0, int64_t c1, float* o, int64_t ldo) {
  __m512 lo[Q][J], hi[Q][J];
#pragma GCC unroll 8
  for (int i = 0; i < Q; ++i)
    for (int j = 0; j < J; ++j) lo[i][j] = hi[i][j] = _mm512_setzero_ps();
  for (int64_t c = c0; c < c1; c += 2) {
    const bool a = ok[c], b = c + 1 < c1 && ok[c + 1];
    __m512i ul[J], uh[J];
    for (int j = 0; j < J; ++j) {
      const __m512i r0 = a ? _mm512_loadu_si512(v + c * stride + 32 * j) : _mm512_setzero_si512();
      const __m512i r1 = b ? _mm512_loadu_si512(v + (c + 1) * stride + 32 * j) : _mm512_setzero_si512();
      ul[j] = _mm512_unpacklo_epi16(r0, r1);
      uh[j] = _mm512_unpackhi_epi16(r0, r1);
    }
#pragma GCC unroll 8
    for (int i = 0; i < Q; ++i) {
      const uint32_t pair = uint32_t(p16[i * T + c]) | (c + 1 < c1 ? uint32_t(p16[i * T + c + 1]) << 16 : 0u);
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(int(pair));
      for (int j = 0; j < J; ++j) {
        lo[i][j] = _mm512_dpbf16_ps(lo[i][j], pp, (__m512bh)ul[j]);
        hi[i][j] = _mm512_dpbf16_ps(hi[i][j], pp, (__m512bh)uh[j]);
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < Q; ++i)
    for (int j = 0; j < J; ++j) store_unpacked(o + i * ldo + 32 * j, lo[i][j], hi[i][j]);
}

// Whether prefill_group's bfloat16 path takes heads of width K (whole registers of 32 columns).
inline bool prefill_bf16_width(int64_t K) { return K > 0 && K % 32 == 0; }
#endif

// `dp`: a bfloat16 query over bfloat16 keys and values, by AVX-512 BF16's dot products (score_tile_bf16,
// weigh_tile_bf16); `extra` then holds the tile's weights in bfloat16 (kQ x T) and its queries' pairs (kQ x K / 2).
template <typename C>
void prefill_group(const float* q, const C* k, const C* v, const bool* valid, int64_t T, int64_t H, int64_t G,
                   int64_t K, int64_t R, int64_t window, float scale, float softcap, const float* sinks, float* kt,
                   float* s, float* bias, int64_t* seen, float* o, bool dp, float* extra) {
  constexpr float lowest = -std::numeric_limits<float>::infinity();
  constexpr int kQ = 6;  // queries per tile: 6 x 2 registers of sums, 2 of keys, 1 of a query: 15 of AVX2's 16
  const int64_t stride = G * K;  // between one token's rows of k (or v) and the next's
  // 16 tokens at a time, so that each row of kt is written a cache line at a time (a token at a time wrote to K
  // lines per token, and took a fifth of GPT-2's prompt attention).
#if defined(SHARDZOO_BF16_GEMM)
  uint32_t* kt2 = reinterpret_cast<uint32_t*>(kt);  // dp: K/2 x T pairs of a key's elements
  uint16_t* p16 = reinterpret_cast<uint16_t*>(extra);
  uint32_t* q2 = reinterpret_cast<uint32_t*>(extra) + kQ * T / 2;  // after p16's kQ x T
  const int64_t K2 = K / 2;
  if constexpr (std::is_same_v<C, uint16_t>) {
    if (dp)
      for (int64_t t0 = 0; t0 < T; t0 += 16)
        for (int64_t d = 0; d < K2; ++d)
          for (int64_t t = t0; t < std::min(T, t0 + 16); ++t) std::memcpy(kt2 + d * T + t, k + t * stride + 2 * d, 4);
  }
#endif
  if (!dp)
    for (int64_t t0 = 0; t0 < T; t0 += 16)
      for (int64_t d = 0; d < K; ++d)
        for (int64_t t = t0; t < std::min(T, t0 + 16); ++t) kt[d * T + t] = widen(k[t * stride + d]);
  seen[0] = 0;
  for (int64_t c = 0; c < T; ++c) {
    bias[c] = valid[c] ? 0.0f : lowest;  // a masked key's score: -inf, weight exactly 0 (XLA: finfo.min, also 0)
    seen[c + 1] = seen[c] + valid[c];
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t t0 = 0; t0 < T; t0 += kQ) {
      const int64_t nq = std::min<int64_t>(kQ, T - t0), hi = t0 + nq;  // keys [lo, hi) cover the tile's queries
      const int64_t lo = window > 0 ? std::max<int64_t>(0, t0 - window + 1) : 0;
      const float* qr[kQ];
      for (int64_t i = 0; i < kQ; ++i) qr[i] = q + ((t0 + std::min(i, nq - 1)) * H + r) * K;
      int64_t c = lo;
#if defined(SHARDZOO_BF16_GEMM)
      if (dp) {
        // The queries' pairs: a bfloat16's float32 widening keeps it in the high 16 bits.
        for (int64_t i = 0; i < kQ; ++i)
          for (int64_t d = 0; d < K2; ++d) {
            uint32_t a, b;
            std::memcpy(&a, qr[i] + 2 * d, 4);
            std::memcpy(&b, qr[i] + 2 * d + 1, 4);
            q2[i * K2 + d] = (a >> 16) | (b & 0xFFFF0000u);
          }
        for (; c + 32 <= hi; c += 32) score_tile_bf16<2, kQ>(q2, kt2, T, K2, c, 32, s);
        for (; c < hi; c += 16) score_tile_bf16<1, kQ>(q2, kt2, T, K2, c, hi - c, s);
      }
#endif
#if defined(SHARDZOO_SIMD)
      for (; c + 2 * kLanes <= hi; c += 2 * kLanes) score_tile<2, kQ>(qr, kt, T, K, c, 2 * kLanes, s);
      for (; c < hi; c += kLanes) score_tile<1, kQ>(qr, kt, T, K, c, hi - c, s);
#endif
      for (; c < hi; ++c)
        for (int64_t i = 0; i < kQ; ++i) {
          float dot = 0;
          for (int64_t d = 0; d < K; ++d) dot += qr[i][d] * kt[d * T + c];
          s[i * T + c] = dot;
        }
      // Each query's weights over the tile's keys [lo, hi): its softmax over its own span, zeros outside it (and all
      // zeros for a query with no key to see, a left pad's: an output of zeros, which nothing reads).
      float inv[kQ];
      for (int64_t i = 0; i < nq; ++i) {
        const int64_t t = t0 + i, first = window > 0 ? std::max<int64_t>(0, t - window + 1) : 0, end = t + 1;
        float* si = s + i * T;
        if (seen[end] == seen[first]) {
          inv[i] = 0.0f;
          std::fill(si + lo, si + hi, 0.0f);
          continue;
        }
        inv[i] = softmax_span(si, bias, first, end, scale, softcap, sinks ? sinks + r : nullptr, lowest);
        std::fill(si + lo, si + first, 0.0f);
        std::fill(si + end, si + hi, 0.0f);
      }
      float* ot = o + (t0 * H + r) * K;  // the tile's first query's row; the next query's is H K further
#if defined(SHARDZOO_BF16_GEMM)
      if constexpr (std::is_same_v<C, uint16_t>)
        if (dp) {
          // The weights normalised and rounded to bfloat16 (zeros outside each query's span stay zeros).
          for (int64_t i = 0; i < nq; ++i)
            for (int64_t c1 = lo; c1 < hi; c1 += 16) {
              const __mmask16 m = tail(hi - c1);
              const __m512 w = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + i * T + c1), _mm512_set1_ps(inv[i]));
              _mm256_mask_storeu_epi16(p16 + i * T + c1, m, (__m256i)_mm512_cvtneps_pbh(w));
            }
          for (int64_t d = 0; d < K; d += 64)
            with_rows<2>(std::min<int64_t>(K - d, 64) / 32, [&](auto regs) {
              with_rows<kQ>(nq, [&](auto rows) {
                weigh_tile_bf16<decltype(rows)::value, decltype(regs)::value>(p16, T, v + d, stride, valid, lo, hi,
                                                                              ot + d, H * K);
              });
            });
          continue;
        }
#endif
#if defined(SHARDZOO_SIMD)
      // columns of the output per pass: the tile's queries' sums in registers (6 x 4 of AVX-512's 32, 6 x 2 of
      // AVX2's 16), with the key's values and a weight
      constexpr int kVecs = kLanes == 16 ? 4 : 2;
      for (int64_t d = 0; d < K; d += kVecs * kLanes) {
        const int64_t left = K - d;
        with_rows<kVecs>((std::min<int64_t>(left, kVecs * kLanes) + kLanes - 1) / kLanes, [&](auto vecs) {
          with_rows<kQ>(nq, [&](auto rows) {
            weigh_tile<decltype(rows)::value, decltype(vecs)::value>(s, T, inv, v + d, stride, valid, lo, hi, left,
                                                                     ot + d, H * K);
          });
        });
      }
#else
      for (int64_t i = 0; i < nq; ++i) {
        float* oi = ot + i * H * K;
        std::fill(oi, oi + K, 0.0f);
        for (c = lo; c < hi; ++c)
          if (valid[c])
            for (int64_t d = 0; d < K; ++d) oi[d] += s[i * T + c] * inv[i] * widen(v[c * stride + d]);
      }
#endif
    }
  }
}

template <typename C>
ffi::Error prefill_attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                             ffi::Buffer<ffi::PRED> valid, ffi::Buffer<ffi::F32> sinks, ffi::ResultBuffer<ffi::F32> out,
                             float scale, float softcap, int64_t window, bool has_sinks, bool q_bf16) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 ||
      !std::equal(kd.begin(), kd.end(), v.dimensions().begin(), v.dimensions().end()))
    return ffi::Error::InvalidArgument("prefill_attention: q (B, T, H, K), k and v (B, T, G, K)");
  const int64_t B = qd[0], T = qd[1], H = qd[2], K = qd[3], G = kd[2];
  if (kd[0] != B || kd[1] != T || kd[3] != K || H % G || valid.element_count() != size_t(B * T))
    return ffi::Error::InvalidArgument("prefill_attention: q, k, v and valid sizes differ");
  const int64_t R = H / G;
  const float* qp = q.typed_data();
  const C* kp = reinterpret_cast<const C*>(k.untyped_data());
  const C* vp = reinterpret_cast<const C*>(v.untyped_data());
  const bool* mp = valid.typed_data();
  const float* sp = has_sinks ? sinks.typed_data() : nullptr;
  float* op = out->typed_data();
  const int max_workers = int(std::max<int64_t>(1, pool.num_threads()));
#if defined(SHARDZOO_BF16_GEMM)
  const bool dp = std::is_same_v<C, uint16_t> && q_bf16 && prefill_bf16_width(K);
#else
  const bool dp = false;
#endif
  // a worker's scratch: the transposed keys, a tile's scores, the keys' masks (and dp's weights and query pairs)
  const int64_t per = K * T + 8 * T + (dp ? 3 * T + 3 * K : 0);
  auto scratch = scratch_of<float>(size_t(max_workers) * per);
  auto seen = scratch_of<int64_t>(size_t(max_workers) * (T + 1));
  run_chunks(pool, B * G, max_workers, [&](int worker, int64_t item) {
    const int64_t b = item / G, g = item % G;
    float* mine = scratch.get() + worker * per;
    prefill_group(qp + (b * T * H + g * R) * K, kp + (b * T * G + g) * K, vp + (b * T * G + g) * K, mp + b * T, T,
                  H, G, K, R, window, scale, softcap, sp ? sp + g * R : nullptr, mine, mine + K * T,
                  mine + K * T + 6 * T, seen.get() + worker * (T + 1), op + (b * T * H + g * R) * K, dp,
                  mine + K * T + 8 * T);
  });
  return ffi::Error::Success();
}

ffi::Error prefill_dispatch(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::Buffer<ffi::PRED> valid, ffi::Buffer<ffi::F32> sinks, ffi::ResultBuffer<ffi::F32> out,
                            float scale, float softcap, int64_t window, bool has_sinks, bool q_bf16) {
  return by_kv_dtype(k, v, "prefill_attention", "k and v", [&](auto c) {
    return prefill_attention<decltype(c)>(pool, q, k, v, valid, sinks, out, scale, softcap, window, has_sinks, q_bf16);
  });
}

// The index of each row's largest value, as jnp.argmax: the first of equal maxima, the first NaN where there is
// one. A greedy decode's choice over the vocabulary: XLA's CPU compiler runs it as a variadic reduce, one element
// at a time (GPT-2 at batch 32: 3.7 ms a step, the 32 rows' 6.4 MB of logits).
int32_t argmax_row(const float* x, int64_t V) {
#if defined(__AVX512F__)
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i at = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  for (int64_t i = 0; i < V; i += 16, idx = _mm512_add_epi32(idx, step)) {
    const __mmask16 t = tail(V - i);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), t, x + i);
    if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) {
      for (int64_t j = i;; ++j)
        if (std::isnan(x[j])) return int32_t(j);
    }
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strictly: a lane keeps its first maximum
    best = _mm512_mask_mov_ps(best, gt, v);
    at = _mm512_mask_mov_epi32(at, gt, idx);
  }
  const __mmask16 top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(_mm512_reduce_max_ps(best)), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(top, at);
#elif defined(SHARDZOO_SIMD)
  // Each lane keeps its first maximum (a strict comparison); a NaN is found by the unordered compare.
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256i at = _mm256_setzero_si256(), idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  int64_t i = 0;
  for (; i + 8 <= V; i += 8, idx = _mm256_add_epi32(idx, step)) {
    const __m256 v = _mm256_loadu_ps(x + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) {
      for (int64_t j = i;; ++j)
        if (std::isnan(x[j])) return int32_t(j);
    }
    const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, gt);
    at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at), _mm256_castsi256_ps(idx), gt));
  }
  alignas(32) float lane[8];
  alignas(32) int32_t lane_at[8];
  _mm256_store_ps(lane, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane_at), at);
  int64_t a = -1;  // the first of the lanes' equal maxima; then the elements past the last whole register
  for (int j = 0; j < 8; ++j)
    if (i > 0 && (a < 0 || lane[j] > x[a] || (lane[j] == x[a] && lane_at[j] < a))) a = lane_at[j];
  for (a = a < 0 ? i : a; i < V; ++i) {
    if (std::isnan(x[i])) return int32_t(i);
    if (x[i] > x[a]) a = i;
  }
  return int32_t(a);
#else
  int64_t a = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (std::isnan(x[i])) return int32_t(i);
    if (x[i] > x[a]) a = i;
  }
  return int32_t(a);
#endif
}

ffi::Error argmax_rows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  const auto xd = x.dimensions();
  if (xd.size() != 2 || out->element_count() != size_t(xd[0]) || xd[1] < 1)
    return ffi::Error::InvalidArgument("argmax_rows: x must be [rows, V > 0], the result [rows]");
  const int64_t V = xd[1];
  const float* xp = x.typed_data();
  int32_t* op = out->typed_data();
  run_chunks(pool, xd[0], int(std::max<int64_t>(1, pool.num_threads())),
             [&](int, int64_t r) { op[r] = argmax_row(xp + r * V, V); });
  return ffi::Error::Success();
}

// Rows of a table by id (a decode's embedding lookup): bytes copied as they are. XLA's CPU compiler gathers a
// bfloat16 table in float32, and hoisted the widening of the whole table out of the decode loop. An id outside the
// table gives a row of all-ones bytes: NaNs, as jnp.take's fill.
ffi::Error take_rows(ffi::AnyBuffer table, ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::AnyBuffer> out) {
  const auto td = table.dimensions();
  if (td.size() != 2) return ffi::Error::InvalidArgument("take_rows: the table must be 2-d");
  const int64_t rows = td[0];
  const size_t row_bytes = size_t(td[1]) * ffi::ByteWidth(table.element_type());
  const char* src = reinterpret_cast<const char*>(table.untyped_data());
  char* dst = reinterpret_cast<char*>(out->untyped_data());
  const int32_t* id = ids.typed_data();
  for (size_t i = 0, n = ids.element_count(); i < n; ++i) {
    if (0 <= id[i] && id[i] < rows)
      std::memcpy(dst + i * row_bytes, src + size_t(id[i]) * row_bytes, row_bytes);
    else
      std::memset(dst + i * row_bytes, 0xFF, row_bytes);
  }
  return ffi::Error::Success();
}

// x written into a KV cache at slots [at, at + T) of axis `axis` (T: x's size there), in place: the result is the
// cache's buffer (kernels.write_slots aliases them), the start clamped into the cache as dynamic_update_slice's. XLA's
// CPU compiler writes a 16-bit slice through a fusion whose root is a bitcast (layers.write_slots), which it runs
// as a copy of the whole cache: a decode step of one row copied each layer's keys and values (GPT-2 in bfloat16:
// 0.4 ms of a 9 ms step).
ffi::Error write_slots(ffi::AnyBuffer cache, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> at, ffi::Result<ffi::AnyBuffer> out,
                       int64_t axis) {
  const auto cd = cache.dimensions(), xd = x.dimensions();
  if (cache.element_type() != x.element_type() || cd.size() != xd.size() || axis < 0 || axis >= int64_t(cd.size()))
    return ffi::Error::InvalidArgument("write_slots: the cache and x must have one dtype and rank, axis within it");
  int64_t outer = 1, inner = ffi::ByteWidth(cache.element_type());
  for (int64_t i = 0; i < int64_t(cd.size()); ++i) {
    if (i != axis && cd[i] != xd[i]) return ffi::Error::InvalidArgument("write_slots: x and the cache's sizes differ");
    if (i < axis) outer *= cd[i];
    if (i > axis) inner *= cd[i];
  }
  const int64_t C = cd[axis], T = xd[axis];
  if (T > C) return ffi::Error::InvalidArgument("write_slots: more slots written than the cache has");
  const int64_t start = std::clamp<int64_t>(at.typed_data()[0], 0, C - T);
  char* dst = reinterpret_cast<char*>(out->untyped_data());
  if (dst != cache.untyped_data()) std::memcpy(dst, cache.untyped_data(), cache.size_bytes());
  const char* src = reinterpret_cast<const char*>(x.untyped_data());
  for (int64_t o = 0; o < outer; ++o) std::memcpy(dst + (o * C + start) * inner, src + o * T * inner, T * inner);
  return ffi::Error::Success();
}

// y = table[x], element by element: a function of a 16-bit float (a bfloat16 MLP's activation) looked up in the 65,536
// values it takes, which kernels.elementwise16 computes with XLA's own loop. XLA's loops computed GPT-2's gelu_new, whose
// every operation rounds to bfloat16, at about a nanosecond an element on two cores, bound by the instruction rate (some
// 115 vector operations for 16 values); a lookup is a load, and the entries an MLP's values use stay in L1 or L2.
ffi::Error lookup16(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::U16> table, ffi::Result<ffi::AnyBuffer> y) {
  if (ffi::ByteWidth(x.element_type()) != 2 || x.element_type() != y->element_type() ||
      x.element_count() != y->element_count())
    return ffi::Error::InvalidArgument("lookup16: x and y must be of one 16-bit type and size");
  if (table.element_count() != 65536) return ffi::Error::InvalidArgument("lookup16: the table takes 65,536 entries");
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const uint16_t* tp = table.typed_data();
  uint16_t* yp = reinterpret_cast<uint16_t*>(y->untyped_data());
  const int64_t n = int64_t(x.element_count()), per = 16384, chunks = (n + per - 1) / per;
  run_chunks(pool, chunks, chunks > 1 ? int(std::max<int64_t>(1, pool.num_threads())) : 1, [&](int, int64_t c) {
    for (int64_t i = c * per, end = std::min(n, i + per); i < end; ++i) yp[i] = tp[xp[i]];
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardzooMatvec, dispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("nk")
                                  .Attr<int64_t>("split"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardzooMatvec3, matvec3,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("split"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardzooPackF32, pack_f32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("nk"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardzooGemmF32Packed, gemm_f32_packed,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardzooGemmBf16, gemm_bf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("nk"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardzooPackBf16, pack_bf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<bool>("nk"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardzooGemmPacked, gemm_packed,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardzooDecodeAttention, attention_dispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<bool>("has_sinks"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardzooPrefillAttention, prefill_dispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Attr<int64_t>("window")
                                  .Attr<bool>("has_sinks")
                                  .Attr<bool>("q_bf16"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardzooLookup16, lookup16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::U16>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardzooArgmax, argmax_rows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardzooWriteSlots, write_slots,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("axis"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardzooTakeRows, take_rows,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::AnyBuffer>());

// Whether ShardzooMatvec takes more than kMaxRows rows (built for AVX2 or AVX-512: its float32 GEMM).
extern "C" int shardzoo_has_gemm() {
#if defined(SHARDZOO_GEMM)
  return 1;
#else
  return 0;
#endif
}

// The float32 GEMM's panel width (columns of W), which ShardzooPackF32's output shape takes; 0 without it.
extern "C" int shardzoo_gemm_panel() {
#if defined(SHARDZOO_GEMM)
  return int(kPanel);
#else
  return 0;
#endif
}

// Whether ShardzooGemmBf16 runs here (built with AVX-512 BF16).
extern "C" int shardzoo_has_bf16_gemm() {
#if defined(SHARDZOO_BF16_GEMM)
  return 1;
#else
  return 0;
#endif
}

extern "C" const char* shardzoo_matvec_isa() {
#if defined(SHARDZOO_SIMD)
  return SHARDZOO_SIMD;
#else
  return "portable C++";
#endif
}
