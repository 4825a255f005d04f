// float32 vectors of the widest kind this build's CPU has (AVX-512 or AVX2 with FMA), loads
// that widen bfloat16 (and int8) to float32 (bfloat16 is the top half of a float32), and the few vector
// functions the attention kernel needs (exp, a transposing horizontal sum).
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
inline Vec vload(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline float vmax_lanes(Vec v) { return _mm512_reduce_max_ps(v); }
// 2^n * y for integral-valued n.
inline Vec vscale2(Vec y, Vec n) { return _mm512_scalef_ps(y, n); }
inline Vec vround(Vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// Lane i of the result: the sum of v[i]'s lanes (kLanes vectors in, one out).
inline Vec vsum_lanes(const Vec* v) {
  Vec pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit block: [a0+a2, b0+b2, a1+a3, b1+b3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit block: the four vectors' sums over that block
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const Vec low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const Vec high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(3, 1, 3, 1)));
}
// float32 -> bfloat16 bits (nearest even, as c10 rounds; NaN stays NaN) in each lane's low half.
inline __m512i round_to_bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC0));
}
// The first n of 16 lanes (n may be <= 0 or >= 16).
inline __mmask16 first_lanes(int n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1);
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
inline Vec vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vsub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec vmax(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline float vmax_lanes(Vec v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline Vec vscale2(Vec y, Vec n) {  // n in [-127, 0] here (see vexp)
  const __m256i bits = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(y), bits));
}
inline Vec vround(Vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec vsum_lanes(const Vec* v) {  // lane i: the sum of v[i]'s lanes
  const Vec low = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const Vec high = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
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

// exp(x) for x <= 0 (attention's shifted scores), float32: x = n ln 2 + r with |r| <= ln 2 / 2,
// exp(r) by the degree-6 minimax polynomial of the Cephes library's expf (about 1 ulp), times 2^n.
// Below -87.3 (where exp underflows float32's normal range) the result is 0.
inline Vec vexp(Vec x) {
  const Vec floor = vbroadcast(-87.3f);
  const Vec n = vround(vmul(x, vbroadcast(1.44269504088896341f)));
  Vec r = vfma(n, vbroadcast(-0.693359375f), x);  // ln 2 in two parts, so r keeps its low bits
  r = vfma(n, vbroadcast(2.12194440e-4f), r);
  Vec p = vbroadcast(1.9875691500e-4f);
  p = vfma(p, r, vbroadcast(1.3981999507e-3f));
  p = vfma(p, r, vbroadcast(8.3334519073e-3f));
  p = vfma(p, r, vbroadcast(4.1665795894e-2f));
  p = vfma(p, r, vbroadcast(1.6666665459e-1f));
  p = vfma(p, r, vbroadcast(5.0000001201e-1f));
  const Vec y = vadd(vfma(vmul(p, r), r, r), vbroadcast(1.f));
#if defined(__AVX512F__)
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, floor, _CMP_GE_OQ), vscale2(y, n));
#else
  return _mm256_and_ps(_mm256_cmp_ps(x, floor, _CMP_GE_OQ), vscale2(y, n));
#endif
}

// x * sigmoid(x) for bfloat16 or float32 x, float32 arithmetic: sigmoid from e = exp(-|x|) <= 1,
// as 1 / (1 + e) for x >= 0 and e / (1 + e) below, so no exp overflows.
inline Vec vsilu(Vec x) {
#if defined(__AVX512F__)
  const Vec e = vexp(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
  const Vec num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, vzero(), _CMP_GE_OQ), e, vbroadcast(1.f));
  return _mm512_mul_ps(x, _mm512_div_ps(num, vadd(e, vbroadcast(1.f))));
#else
  const Vec abs = _mm256_andnot_ps(vbroadcast(-0.f), x);
  const Vec e = vexp(_mm256_sub_ps(vzero(), abs));
  const Vec num = _mm256_blendv_ps(e, vbroadcast(1.f), _mm256_cmp_ps(x, vzero(), _CMP_GE_OQ));
  return _mm256_mul_ps(x, _mm256_div_ps(num, vadd(e, vbroadcast(1.f))));
#endif
}

// v rounded to bfloat16's precision, still float32: round to nearest even on the top 16 bits, as
// c10::BFloat16's conversion (NaN stays NaN).
inline Vec vround_bf16(Vec v) {
#if defined(__AVX512F__)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))),
                                           _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_castsi512_ps(rounded), v);
#else
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))),
                                           _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
#endif
}

// v rounded to T's precision (float32: unchanged), and stored as T (bfloat16: the top halves of
// an already rounded v).
inline Vec vround_to(Vec v, const float*) { return v; }
inline Vec vround_to(Vec v, const at::BFloat16*) { return vround_bf16(v); }
inline void vstore_as(float* p, Vec v) { vstore(p, v); }
inline void vstore_as(at::BFloat16* p, Vec v) {
#if defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
#else
  const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(v), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(top, top), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
#endif
}

}  // namespace
