// float32 vectors of the widest kind this build's CPU has (AVX-512 or AVX2 with FMA), and
// loads that widen bfloat16 to float32 (bfloat16 is the top half of a float32).
#pragma once

#include <ATen/core/TensorBase.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vload(const at::BFloat16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#else
#error "the CPU kernels need AVX2 with FMA, or AVX-512"
#endif

// Weight streams are read this many bytes ahead with a software prefetch into L1: the
// hardware prefetcher alone left a 2-core AVX-512 EPYC's few-row GEMMs short of the memory's
// speed, more so as rows add arithmetic (all of SmolLM2-135M's linear layers in bfloat16,
// small_gemm, medians of 15 passes, ms at 1 / 5 / 9 rows: no prefetch 6.31 / 8.59 / 10.60;
// 4 KiB ahead 5.60 / 6.55 / 8.01; 8 KiB 5.59 / 6.11 / 7.34; 12 KiB 5.71 / 6.03 / 7.26; 16 KiB 6.43 /
// 6.71 / 7.50). A prefetch past the end of a stream is harmless (no fault).
constexpr int kPrefetchBytes = 8192;
inline void prefetch_ahead(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T0);
}

inline void vstore(float* p, Vec v) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(p, v);
#else
  _mm256_storeu_ps(p, v);
#endif
}
inline Vec vbroadcast(float v) {
#if defined(__AVX512F__)
  return _mm512_set1_ps(v);
#else
  return _mm256_set1_ps(v);
#endif
}

}  // namespace
