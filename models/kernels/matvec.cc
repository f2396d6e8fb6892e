// y[M, N] = x[M, K] . W for a few rows M (a decode step): W is [K, N] ("kn") or [N, K] ("nk", a tied output head),
// float32 or bfloat16; x and y are float32. A decode step is bound by reading W once, so the loops stream W from
// memory in order, widen bfloat16 in registers (XLA's CPU dot widens it into a float32 copy first), and split the
// rows of W between the caller and XLA's intra-op thread pool.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
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

constexpr int kMaxRows = 8;
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

#if defined(__AVX512F__)
// The same loops in AVX-512, sixteen columns a register; bfloat16 widens by a shift into the high half.
inline __m512 load16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load16(const uint16_t* p, __mmask16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}
// Prefetch `elems` elements from p: the next block of rows, ahead of the hardware's stream detection.
template <typename W>
inline void prefetch(const W* p, int64_t elems) {
  for (int64_t i = 0; i < elems; i += 64 / int64_t(sizeof(W))) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}
inline __mmask16 tail(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }

template <typename W>
void kn_rows_avx(const float* x, const W* w, float* acc, int64_t M, int64_t K, int64_t N, int64_t k0, int64_t k1,
                 int64_t n0, int64_t n1) {
  // Eight rows of W at a time, sixteen columns a register: each weight is loaded and widened once and used for
  // every row of x (broadcast from memory), so a step of M rows reads and converts W once. Whole rows (one
  // block of 8N in memory order) are prefetched; a band of columns is left to the hardware's row streams.
  int64_t k = k0;
  const bool whole = n0 == 0 && n1 == N;
  for (; k + 8 <= k1; k += 8) {
    const W* wk = w + k * N;
    const W* ahead = wk + PF * 8 * N;
    const bool fetch = whole && k + (PF + 1) * 8 <= k1;
    for (int64_t n = n0; n < n1; n += 16) {
      const __mmask16 t = tail(n1 - n);
      if (fetch) prefetch(ahead + n * 8, 128);
      __m512 v[8];
#pragma GCC unroll 8
      for (int i = 0; i < 8; ++i) v[i] = load16(wk + i * N + n, t);
      for (int64_t m = 0; m < M; ++m) {
        const float* a = x + m * K + k;
        float* y = acc + m * N + n;
        __m512 s0 = _mm512_maskz_loadu_ps(t, y);
        __m512 s1 = _mm512_mul_ps(_mm512_set1_ps(a[1]), v[1]);
        s0 = _mm512_fmadd_ps(_mm512_set1_ps(a[0]), v[0], s0);
        s0 = _mm512_fmadd_ps(_mm512_set1_ps(a[2]), v[2], s0);
        s1 = _mm512_fmadd_ps(_mm512_set1_ps(a[3]), v[3], s1);
        s0 = _mm512_fmadd_ps(_mm512_set1_ps(a[4]), v[4], s0);
        s1 = _mm512_fmadd_ps(_mm512_set1_ps(a[5]), v[5], s1);
        s0 = _mm512_fmadd_ps(_mm512_set1_ps(a[6]), v[6], s0);
        s1 = _mm512_fmadd_ps(_mm512_set1_ps(a[7]), v[7], s1);
        _mm512_mask_storeu_ps(y, t, _mm512_add_ps(s0, s1));
      }
    }
  }
  if (k < k1) kn_rows(x, w, acc, M, K, N, k, k1, n0, n1);
}

// R rows of x (1-4) against four rows of W: 4R accumulators held in registers (constant indices throughout).
template <int R, typename W>
void nk_tile_avx(const float* x, const W* w0, float* y, int64_t K, int64_t N, int64_t n, const W* ahead) {
  __m512 s[R][4];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) s[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 t = tail(K - k);
    if (ahead) prefetch(ahead + k * 4, 64);
    const __m512 v0 = load16(w0 + k, t), v1 = load16(w0 + K + k, t);
    const __m512 v2 = load16(w0 + 2 * K + k, t), v3 = load16(w0 + 3 * K + k, t);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 a = load16(x + r * K + k, t);
      s[r][0] = _mm512_fmadd_ps(a, v0, s[r][0]);
      s[r][1] = _mm512_fmadd_ps(a, v1, s[r][1]);
      s[r][2] = _mm512_fmadd_ps(a, v2, s[r][2]);
      s[r][3] = _mm512_fmadd_ps(a, v3, s[r][3]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) y[r * N + n + j] = _mm512_reduce_add_ps(s[r][j]);
}

template <typename W>
void nk_rows_avx(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  // Four rows of W at a time against up to four rows of x: each weight is loaded and widened once per four rows of
  // x; a fifth to eighth row of x reads the same four rows of W again, from L1.
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const W* w0 = w + n * K;
    const W* ahead = n + (PF + 1) * 4 <= n1 ? w0 + PF * 4 * K : nullptr;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const float* xm = x + m0 * K;
      float* ym = y + m0 * N;
      const W* fetch = m0 == 0 ? ahead : nullptr;
      switch (std::min<int64_t>(4, M - m0)) {
        case 4: nk_tile_avx<4>(xm, w0, ym, K, N, n, fetch); break;
        case 3: nk_tile_avx<3>(xm, w0, ym, K, N, n, fetch); break;
        case 2: nk_tile_avx<2>(xm, w0, ym, K, N, n, fetch); break;
        default: nk_tile_avx<1>(xm, w0, ym, K, N, n, fetch); break;
      }
    }
  }
  if (n < n1) nk_rows(x, w, y, M, K, N, n, n1);
}
#define KN_ROWS kn_rows_avx
#define NK_ROWS nk_rows_avx
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
  std::atomic<int> workers{0};
};

template <typename Fn>
void run_chunks(ffi::ThreadPool& pool, int64_t chunks, int max_workers, Fn fn) {
  auto work = std::make_shared<Work>();
  work->chunks = chunks;
  auto drain = [work, fn](int worker) {
    for (int64_t c; (c = work->next.fetch_add(1)) < work->chunks;) {
      fn(worker, c);
      work->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int helpers = int(std::min<int64_t>(pool.num_threads(), max_workers - 1));
  for (int t = 1; t <= helpers; ++t) pool.Schedule([drain, t] { drain(t); });
  drain(0);
  while (work->done.load(std::memory_order_acquire) < chunks) std::this_thread::yield();
}

template <typename W>
ffi::Error matvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y,
                  bool nk) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("matvec: x and w must be 2-d");
  const int64_t M = xd[0], K = xd[1], N = nk ? wd[0] : wd[1];
  if ((nk ? wd[1] : wd[0]) != K) return ffi::Error::InvalidArgument("matvec: contracting sizes differ");
  if (M > kMaxRows) return ffi::Error::InvalidArgument("matvec: more rows than the kernel takes");
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
  // Split K: each worker sums its chunks into its own accumulator, added up at the end.
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(16, K / 64));
  const int64_t per = (K / chunks + 3) / 4 * 4;
  const int workers = int(std::min<int64_t>(max_workers, chunks));
  std::vector<float> acc(size_t(workers) * M * N, 0.0f);
  float* ap = acc.data();
  run_chunks(pool, chunks, workers, [&, ap](int worker, int64_t c) {
    const int64_t k0 = c * per, k1 = c + 1 == chunks ? K : std::min(K, (c + 1) * per);
    if (k0 < k1) KN_ROWS(xp, wp, ap + worker * M * N, M, K, N, k0, k1, 0, N);
  });
  std::memcpy(yp, ap, sizeof(float) * M * N);
  for (int t = 1; t < workers; ++t) {
    const float* a = ap + t * M * N;
    for (int64_t i = 0; i < M * N; ++i) yp[i] += a[i];
  }
  return ffi::Error::Success();
}

ffi::Error dispatch(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y,
                    bool nk) {
  switch (w.element_type()) {
    case ffi::DataType::F32:
      return matvec<float>(pool, x, w, y, nk);
    case ffi::DataType::BF16:
      return matvec<uint16_t>(pool, x, w, y, nk);
    default:
      return ffi::Error::InvalidArgument("matvec: weights must be float32 or bfloat16");
  }
}

#if defined(__AVX512BF16__)
// bfloat16 x bfloat16 for more rows (a prefill, a batch above kMaxRows): pairs of products summed in float32 by
// AVX-512 BF16's dot instruction (vdpbf16ps), as torch's oneDNN path multiplies; XLA's CPU dot widens both
// operands into float32 copies first. K must be even (every model's widths are).
#define SHARDZOO_BF16_GEMM 1

// KN: rows k and k+1 of a 32-column panel of W interleaved into (W[k, n], W[k+1, n]) pairs, the lanes
// vdpbf16ps takes, against a broadcast pair (x[m, k], x[m, k+1]); R rows of x share each interleaved panel.
template <int R>
void kn_tile_bf16(const uint16_t* x, const uint16_t* w, float* y, int64_t K, int64_t N, int64_t m0, int64_t n) {
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                  24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  const int64_t left = N - n;
  const __mmask32 cols = left >= 32 ? ~__mmask32(0) : __mmask32((1ull << left) - 1);
  __m512 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    const __m512i r0 = _mm512_maskz_loadu_epi16(cols, w + k * N + n);
    const __m512i r1 = _mm512_maskz_loadu_epi16(cols, w + (k + 1) * N + n);
    const __m512bh b0 = (__m512bh)_mm512_permutex2var_epi16(r0, lo, r1);
    const __m512bh b1 = (__m512bh)_mm512_permutex2var_epi16(r0, hi, r1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_broadcastd_epi32(_mm_loadu_si32(x + (m0 + r) * K + k));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float* out = y + (m0 + r) * N + n;
    _mm512_mask_storeu_ps(out, __mmask16(cols), acc[r][0]);
    _mm512_mask_storeu_ps(out + 16, __mmask16(cols >> 16), acc[r][1]);
  }
}

// NK (a tied head, W [N, K]): R rows of x against four rows of W as dot products over K, 32 values a step.
template <int R>
void nk_tile_bf16(const uint16_t* x, const uint16_t* w, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0) {
  const int rows_w = int(std::min<int64_t>(4, N - n0));
  __m512 acc[R][4];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t left = K - k;
    const __mmask32 t = left >= 32 ? ~__mmask32(0) : __mmask32((1ull << left) - 1);
    __m512bh b[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j)
      b[j] = (__m512bh)(j < rows_w ? _mm512_maskz_loadu_epi16(t, w + (n0 + j) * K + k) : _mm512_setzero_si512());
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_maskz_loadu_epi16(t, x + (m0 + r) * K + k);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], a, b[j]);
    }
  }
  // All four reduced by constant indices (a variable index would keep the accumulators in memory), rows_w kept.
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float sums[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) sums[j] = _mm512_reduce_add_ps(acc[r][j]);
    for (int j = 0; j < rows_w; ++j) y[(m0 + r) * N + n0 + j] = sums[j];
  }
}

template <int R>
void kn_rows_bf16(const uint16_t* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n) {
  int64_t m = 0;
  for (; m + R <= M; m += R) kn_tile_bf16<R>(x, w, y, K, N, m, n);
  switch (M - m) {  // the rows left over, in one tile of their own
    case 7: kn_tile_bf16<7>(x, w, y, K, N, m, n); break;
    case 6: kn_tile_bf16<6>(x, w, y, K, N, m, n); break;
    case 5: kn_tile_bf16<5>(x, w, y, K, N, m, n); break;
    case 4: kn_tile_bf16<4>(x, w, y, K, N, m, n); break;
    case 3: kn_tile_bf16<3>(x, w, y, K, N, m, n); break;
    case 2: kn_tile_bf16<2>(x, w, y, K, N, m, n); break;
    case 1: kn_tile_bf16<1>(x, w, y, K, N, m, n); break;
    default: break;
  }
}

void nk_rows_bf16(const uint16_t* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) nk_tile_bf16<4>(x, w, y, K, N, m, n);
  switch (M - m) {
    case 3: nk_tile_bf16<3>(x, w, y, K, N, m, n); break;
    case 2: nk_tile_bf16<2>(x, w, y, K, N, m, n); break;
    case 1: nk_tile_bf16<1>(x, w, y, K, N, m, n); break;
    default: break;
  }
}

ffi::Error gemm_bf16(ffi::ThreadPool pool, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                     ffi::ResultBuffer<ffi::F32> y, bool nk) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("gemm_bf16: x and w must be 2-d");
  const int64_t M = xd[0], K = xd[1], N = nk ? wd[0] : wd[1];
  if ((nk ? wd[1] : wd[0]) != K || K % 2) return ffi::Error::InvalidArgument("gemm_bf16: K differs or is odd");
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.untyped_data());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.untyped_data());
  float* yp = y->typed_data();
  const int max_workers = int(std::max<int64_t>(1, pool.num_threads()));
  // Chunks of output columns: 32-column panels of W (KN), or 4 rows of W (NK), a few to a chunk.
  const int64_t width = nk ? 16 : 64;
  const int64_t chunks = (N + width - 1) / width;
  run_chunks(pool, chunks, max_workers, [&](int, int64_t c) {
    const int64_t end = std::min(N, (c + 1) * width);
    for (int64_t n = c * width; n < end; n += nk ? 4 : 32) {
      if (nk)
        nk_rows_bf16(xp, wp, yp, M, K, N, n);
      else
        kn_rows_bf16<8>(xp, wp, yp, M, K, N, n);
    }
  });
  return ffi::Error::Success();
}
#else
ffi::Error gemm_bf16(ffi::ThreadPool, ffi::Buffer<ffi::BF16>, ffi::Buffer<ffi::BF16>, ffi::ResultBuffer<ffi::F32>,
                     bool) {
  return ffi::Error::Unimplemented("gemm_bf16: built without AVX-512 BF16");
}
#endif

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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardzooMatvec, dispatch,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("nk"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardzooGemmBf16, gemm_bf16,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("nk"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ShardzooTakeRows, take_rows,
                              ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::AnyBuffer>());

// Whether ShardzooGemmBf16 runs here (built with AVX-512 BF16).
extern "C" int shardzoo_has_bf16_gemm() {
#if defined(SHARDZOO_BF16_GEMM)
  return 1;
#else
  return 0;
#endif
}

extern "C" const char* shardzoo_matvec_isa() {
#if defined(__AVX512F__)
  return "AVX-512";
#else
  return "portable C++";
#endif
}
