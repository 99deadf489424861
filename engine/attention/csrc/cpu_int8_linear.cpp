// y = x Wᵀ for a few rows of x (decode steps), where reading the weight from memory is the cost:
// - `int8_linear`: an int8 weight with one float scale per output row (`quantization="int8"`),
//   widened to float32 in registers, so int8 reads a quarter of float32's bytes; x is never
//   rounded (weight-only quantization);
// - `f32_linear`: a float32 weight, for one row where this streams the weight faster than MKL's
//   gemv or oneDNN's packed layout (engine/model/linear_tuning.py times all three per shape).
//
// Each task takes a block of output rows; within it, a tile of NR weight rows times MR rows of x
// is accumulated in AVX2 registers over the whole reduction, so the weight block is read from
// memory once and from L1 for each further tile of x rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_INT8_AVX2 1
#else
#define PDSERVE_INT8_AVX2 0
#endif

namespace {

#if PDSERVE_INT8_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 int8 weights widened to 8 floats.
inline __m256 load8(const int8_t* p) {
  __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
#endif

// out[m][n] = scale[n] * sum_k x[m][k] * w[n][k] for NR rows of w from n and MR rows of x from m
// (no scale: a float32 weight).
template <int NR, int MR, typename W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t ldw, const float* scale, float* out,
                 int64_t ldo, int64_t k_size) {
  float sums[MR][NR];
  int64_t k = 0;
#if PDSERVE_INT8_AVX2
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (; k + 8 <= k_size; k += 8) {
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load8(w + j * ldw + k);
    for (int i = 0; i < MR; ++i) {
      __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) sums[i][j] = hsum(acc[i][j]);
#else
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) sums[i][j] = 0.f;
#endif
  for (; k < k_size; ++k)  // the tail of a reduction not a multiple of 8 (or all of it without AVX2)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) sums[i][j] += x[i * ldx + k] * static_cast<float>(w[j * ldw + k]);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i * ldo + j] = scale != nullptr ? sums[i][j] * scale[j] : sums[i][j];
}

template <int NR, typename W>
void rows_of_x(const float* x, int64_t m_size, int64_t ldx, const W* w, int64_t ldw, const float* scale,
               float* out, int64_t ldo, int64_t k_size) {
  int64_t m = 0;
  for (; m + 4 <= m_size; m += 4) tile<NR, 4>(x + m * ldx, ldx, w, ldw, scale, out + m * ldo, ldo, k_size);
  switch (m_size - m) {
    case 3: tile<NR, 3>(x + m * ldx, ldx, w, ldw, scale, out + m * ldo, ldo, k_size); break;
    case 2: tile<NR, 2>(x + m * ldx, ldx, w, ldw, scale, out + m * ldo, ldo, k_size); break;
    case 1: tile<NR, 1>(x + m * ldx, ldx, w, ldw, scale, out + m * ldo, ldo, k_size); break;
    default: break;
  }
}

constexpr int64_t kRowsPerTile = 2;

// out = x wᵀ (times the row scales, if any), the output rows split over threads unless `serial`.
template <typename W>
void small_linear(const at::Tensor& xc, const W* wp, const float* sp, int64_t n_size, int64_t k_size, at::Tensor& out,
                  bool serial = false) {
  const int64_t m_size = xc.size(0);
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = xc.stride(0);
  // Blocks of 16 output rows: enough work per task to hide the scheduling, and fine enough that
  // the last tasks do not leave a core idle.
  constexpr int64_t kBlock = 16;
  const int64_t blocks = (n_size + kBlock - 1) / kBlock;
  // Serial: a grain of every block keeps the loop on the calling thread. Where OpenMP's idle
  // threads sleep (OMP_WAIT_POLICY=PASSIVE, as `pdserve up` sets for prefill engines), waking
  // them costs more than a small weight takes to read.
  at::parallel_for(0, blocks, serial ? blocks : 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * kBlock, n1 = std::min(n_size, n0 + kBlock);
      const float* scale = sp != nullptr ? sp + n0 : nullptr;
      int64_t n = n0;
      for (; n + kRowsPerTile <= n1; n += kRowsPerTile, scale = scale != nullptr ? scale + kRowsPerTile : nullptr)
        rows_of_x<kRowsPerTile>(xp, m_size, ldx, wp + n * k_size, k_size, scale, op + n, n_size, k_size);
      for (; n < n1; ++n, scale = scale != nullptr ? scale + 1 : nullptr)
        rows_of_x<1>(xp, m_size, ldx, wp + n * k_size, k_size, scale, op + n, n_size, k_size);
    }
  });
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_linear: x must be a 2-D float32 tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "int8_linear: weight must be a contiguous 2-D int8 tensor");
  TORCH_CHECK(x.size(1) == weight.size(1), "int8_linear: x has ", x.size(1), " columns, weight ", weight.size(1));
  TORCH_CHECK(scales.dim() == 1 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == weight.size(0),
              "int8_linear: scales must be float32 with one entry per weight row");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({xc.size(0), weight.size(0)}, x.options());
  small_linear(xc, weight.data_ptr<int8_t>(), scales.data_ptr<float>(), weight.size(0), weight.size(1), out);
  return out;
}

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& weight, bool serial) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "f32_linear: x must be a 2-D float32 tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "f32_linear: weight must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(x.size(1) == weight.size(1), "f32_linear: x has ", x.size(1), " columns, weight ", weight.size(1));
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({xc.size(0), weight.size(0)}, x.options());
  small_linear(xc, weight.data_ptr<float>(), static_cast<const float*>(nullptr), weight.size(0), weight.size(1), out,
               serial);
  return out;
}

bool int8_linear_vectorized() { return PDSERVE_INT8_AVX2; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  m.def("f32_linear(Tensor x, Tensor weight, bool serial=False) -> Tensor");
  m.def("int8_linear_vectorized() -> bool");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("f32_linear", &f32_linear);
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CatchAll, m) { m.impl("int8_linear_vectorized", &int8_linear_vectorized); }
