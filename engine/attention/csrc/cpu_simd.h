// The float32 vector primitives our CPU attention kernels share: 16 lanes with AVX-512, 8 with
// AVX2 + FMA (AMD EPYC before Zen 4, older Xeons), and no PDSERVE_SIMD on anything older (the
// kernels keep scalar loops for that). Rows of float32, bfloat16 or float16 widen to float32.

#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace pdserve_simd {

inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void load_row(const at::BFloat16* src, float* dst, int64_t n) {
  // bfloat16 is the high half of a float32: widening is a 16-bit shift, which vectorizes.
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

inline void load_row(const at::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void store_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(const float* src, at::BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<at::BFloat16>(src[i]);
}
inline void store_row(const float* src, at::Half* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<at::Half>(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float w, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

// The fast path works on float32 vectors of Vec::L lanes: 16 with AVX-512, 8 with AVX2 + FMA
// (AMD EPYC before Zen 4, older Xeons). The algorithm is the same; only these primitives differ.
#if defined(__AVX512F__)
#define PDSERVE_SIMD 1

struct Vec {
  using T = __m512;
  static constexpr int L = 16;
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T load(const at::BFloat16* p) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  }
  static T load(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static void store(float* p, T x) { _mm512_storeu_ps(p, x); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T zero() { return _mm512_setzero_ps(); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static float reduce_add(T x) { return _mm512_reduce_add_ps(x); }
  static float reduce_max(T x) { return _mm512_reduce_max_ps(x); }
  static T round(T x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // y * 2^n for integral n in [-126, 0]
  static T scale2(T y, T n) { return _mm512_scalef_ps(y, n); }
};
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PDSERVE_SIMD 1

struct Vec {
  using T = __m256;
  static constexpr int L = 8;
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T load(const at::BFloat16* p) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  }
  static T load(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static void store(float* p, T x) { _mm256_storeu_ps(p, x); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T zero() { return _mm256_setzero_ps(); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static float reduce_add(T x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float reduce_max(T x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static T round(T x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // y * 2^n for integral n in [-126, 0]: n goes straight into the exponent bits.
  static T scale2(T y, T n) {
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
  }
};
#endif

#if defined(PDSERVE_SIMD)
// exp(x) for x <= 0 = 2^n * 2^f with n = round(x log2 e) and f in [-1/2, 1/2]; 2^f by a degree-6
// polynomial (relative error below 2e-7, about one float32 ulp). Below -87 it underflows to ~0.
inline Vec::T vexp(Vec::T x) {
  const Vec::T t = Vec::mul(Vec::max(x, Vec::set1(-87.f)), Vec::set1(1.4426950408889634f));
  const Vec::T n = Vec::round(t);
  const Vec::T f = Vec::sub(t, n);
  Vec::T y = Vec::set1(1.5403530393381606e-4f);
  y = Vec::fmadd(y, f, Vec::set1(1.3333558146428443e-3f));
  y = Vec::fmadd(y, f, Vec::set1(9.6181291076284772e-3f));
  y = Vec::fmadd(y, f, Vec::set1(5.5504108664821580e-2f));
  y = Vec::fmadd(y, f, Vec::set1(2.4022650695910071e-1f));
  y = Vec::fmadd(y, f, Vec::set1(6.9314718055994531e-1f));
  y = Vec::fmadd(y, f, Vec::set1(1.f));
  return Vec::scale2(y, n);
}

// Pin vectors to registers: an empty asm that claims to change them. GCC 12 folds a vector that
// several FMAs reuse into each of them as a memory operand (one load per use instead of one per
// vector), and a tile turns load-bound: with AVX2's 16 registers in every tile, with AVX-512 in
// tiles of few rows (cpu_gemm_tile.h's, 2-4 rows: 0.44-0.55 of the 6-row tile's rate on a Zen 5).
// Element by element, with indices known at compile time.
template <typename T>  // Vec::T, or another vector type of the same registers (__m512bh)
inline void keep_in_register(T& x) {
  __asm__("" : "+v"(x));
}

template <typename T, int N, std::size_t... I>
inline void keep_in_registers_at(T (&v)[N], std::index_sequence<I...>) {
  (keep_in_register(v[I]), ...);
}

template <typename T, int N>
inline void keep_in_registers(T (&v)[N]) {
  keep_in_registers_at(v, std::make_index_sequence<N>());
}

// Whether this is an AMD Zen 4 (family 19h with AVX-512; Zen 3, the same family, has none): the
// fetch rules below differ there from Zen 5's, which they were first measured on.
inline bool zen4() {
  static const bool is = [] {
    __builtin_cpu_init();
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__builtin_cpu_is("amd") || !__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
    const unsigned base = (eax >> 8) & 0xf;
    const unsigned family = base == 0xf ? base + ((eax >> 20) & 0xff) : base;
    return family == 0x19 && __builtin_cpu_supports("avx512f");
  }();
  return is;
}

// Where a kernel's software fetch of the lines it reads next should go, by CPU: measured in the
// streams that fetch ahead of their reads (decode attention's AheadLines, the float32 panels' next
// pass in cpu_gemm_tile.h, the bf16 pair groups' in cpu_bf16_pair_linear.cpp). Into L1 on a Zen 5
// EPYC (attention 1.24x faster than into L2). Into L2 on Intel (a 2-core AMX Xeon, whole decode
// steps alternated in one process: attention 1.04-1.05x, the panels 1.05x at 16 rows and 1.03x at
// 64, level at 1-4) and on a Zen 4 (a 2-core EPYC, SmolLM2's decode steps alternated in one
// process, against into L1: bf16 pair groups 1.18x at 16 rows, 1.03x at 32, level at 64; attention
// 1.10x on top at 16 and at 64 requests; float32 panels 1.07x at 16 rows, 1.04x at 4).
inline bool fetch_into_l2() {
  static const bool l2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0 || zen4();
  }();
  return l2;
}

inline void fetch_line(const void* line, bool into_l2) {
  if (into_l2)
    _mm_prefetch(static_cast<const char*>(line), _MM_HINT_T1);
  else
    _mm_prefetch(static_cast<const char*>(line), _MM_HINT_T0);
}

#endif  // PDSERVE_SIMD

}  // namespace pdserve_simd
