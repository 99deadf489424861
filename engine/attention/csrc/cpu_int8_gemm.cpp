// y = x Wᵀ for many rows of x (prefill chunks) with an int8 weight: one float32 scale per output
// row, or one per group of consecutive weights in a row (GGUF's Q8_0). x stays float32: this is
// the weight-only product, computed in float32 with the dequantized weight, as the decode kernel
// (cpu_int8_linear.cpp) computes it for a few rows.
//
// Why a GEMM of our own: at many rows the arithmetic is the cost, not the weight's bytes. Widening
// the whole weight to float32 and handing it to MKL (the earlier path) wrote and read four bytes
// per weight on every call and ran MKL unpacked: 1.6x oneDNN's float32 prefill at 256 rows.
// Here each task widens a panel of 16 output rows for a slice of the reduction into a small
// float32 buffer, transposed so that one vector holds the 16 outputs' weights at one k, and then
// every row of x streams past it: each x value is broadcast and FMA'd into 16 outputs at once.
// The panel is built once per block of x rows and reused from L1 by all of them.
//
// Summation order: each output is one FMA chain over k from 0 to K-1, whatever the number of rows
// or threads, so a row's result does not depend on the other rows of the batch.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_gemm_tile.h"

namespace {

using pdserve_gemm::kPanel;
using pdserve_gemm::kRowsMax;
using pdserve_gemm::micro_rows;

constexpr int64_t kSliceK = 256;  // reduction per panel build: 16 KiB of float32, within L1
constexpr int64_t kBlockM = 256;  // x rows per block: 256 x 256 float32 = 256 KiB, within L2

// The panel: w[n0 + j][k0 + k] * scale at panel[k * 16 + j], zero for rows past the weight's end.
// Group scales (ldg per row, `group` weights each) are applied here, so each entry is exactly the
// dequantized float32 weight; row scales (`row_scaled`) are left to the end of the sum.
void build_panel_scalar(const int8_t* w, int64_t k_size, int64_t rows, int64_t k0, int64_t kc, const float* gs,
                        int64_t ldg, int64_t group, float* panel) {
  for (int64_t j = 0; j < kPanel; ++j) {
    float* col = panel + j;
    if (j >= rows) {
      for (int64_t k = 0; k < kc; ++k) col[k * kPanel] = 0.f;
      continue;
    }
    const int8_t* row = w + j * k_size + k0;
    for (int64_t k = 0; k < kc; ++k)
      col[k * kPanel] = gs == nullptr ? static_cast<float>(row[k]) : static_cast<float>(row[k]) * gs[j * ldg + (k0 + k) / group];
  }
}

#if PDSERVE_GEMM_ISA
// 16 rows x 16 bytes (row i at rows[i]) -> 16 vectors, vector k holding byte k of every row: four
// rounds of interleaving, each doubling the width of the pieces that are in place.
inline void transpose16x16_bytes(const __m128i (&r)[16], __m128i (&out)[16]) {
  __m128i b[16], c[16], d[16];
  for (int i = 0; i < 8; ++i) {  // b[i]: rows 2i, 2i+1 paired at k 0..7; b[8 + i]: at k 8..15
    b[i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
    b[8 + i] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {  // c[h + i]: rows 4i..4i+3 at k h..h+3; c[h + 4 + i]: at k h+4..h+7
      c[h + i] = _mm_unpacklo_epi16(b[h + 2 * i], b[h + 2 * i + 1]);
      c[h + 4 + i] = _mm_unpackhi_epi16(b[h + 2 * i], b[h + 2 * i + 1]);
    }
  for (int q = 0; q < 16; q += 4)
    for (int i = 0; i < 2; ++i) {  // d[q + i]: rows 8i..8i+7 at k q, q+1; d[q + 2 + i]: at k q+2, q+3
      d[q + i] = _mm_unpacklo_epi32(c[q + 2 * i], c[q + 2 * i + 1]);
      d[q + 2 + i] = _mm_unpackhi_epi32(c[q + 2 * i], c[q + 2 * i + 1]);
    }
  for (int q = 0; q < 16; q += 4) {  // all 16 rows at k q..q+3
    out[q] = _mm_unpacklo_epi64(d[q], d[q + 1]);
    out[q + 1] = _mm_unpackhi_epi64(d[q], d[q + 1]);
    out[q + 2] = _mm_unpacklo_epi64(d[q + 2], d[q + 3]);
    out[q + 3] = _mm_unpackhi_epi64(d[q + 2], d[q + 3]);
  }
}

// 16 int8 -> float32, times 16 scales (one per output row), stored at p.
inline void widen_store(__m128i bytes, const float* scale, float* p) {
#if PDSERVE_GEMM_ISA == 512
  __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  if (scale != nullptr) v = _mm512_mul_ps(v, _mm512_loadu_ps(scale));
  _mm512_storeu_ps(p, v);
#else
  __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
  if (scale != nullptr) {
    lo = _mm256_mul_ps(lo, _mm256_loadu_ps(scale));
    hi = _mm256_mul_ps(hi, _mm256_loadu_ps(scale + 8));
  }
  _mm256_storeu_ps(p, lo);
  _mm256_storeu_ps(p + 8, hi);
#endif
}
#endif

// The weights the build after this one reads (ahead_len bytes of ahead_rows rows from `ahead`) are
// asked into L2 first.
void build_panel(const int8_t* w, int64_t k_size, int64_t rows, int64_t k0, int64_t kc, const float* gs,
                 int64_t ldg, int64_t group, float* panel, const int8_t* ahead = nullptr, int64_t ahead_rows = 0,
                 int64_t ahead_len = 0) {
  int64_t k = 0;
#if PDSERVE_GEMM_ISA
  for (int64_t j = 0; j < ahead_rows; ++j)
    for (int64_t c = 0; c < ahead_len; c += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead + j * k_size + c), _MM_HINT_T1);
  // 16 weights of each of the 16 rows at a time, turned k-major in registers. Groups are whole
  // multiples of 8, so a run of 16 weights holds at most a few groups: the scale vector is rebuilt
  // where a group starts.
  float scale[kPanel] = {};
  // The group holding k0 + k + i and where the next one starts, kept by counting: a division per
  // weight column cost more than the widening itself.
  int64_t g = gs != nullptr ? k0 / group : 0, next = gs != nullptr ? (g + 1) * group : INT64_MAX;
  const auto load_scales = [&] {
    for (int64_t j = 0; j < kPanel; ++j) scale[j] = j < rows ? gs[j * ldg + g] : 0.f;
  };
  if (gs != nullptr) load_scales();
  for (; k + 16 <= kc; k += 16) {
    __m128i r[16], t[16];
    for (int64_t j = 0; j < kPanel; ++j)
      r[j] = j < rows ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j * k_size + k0 + k)) : _mm_setzero_si128();
    transpose16x16_bytes(r, t);
    for (int64_t i = 0; i < 16; ++i) {
      if (k0 + k + i == next) {
        ++g;
        next += group;
        load_scales();
      }
      widen_store(t[i], gs != nullptr ? scale : nullptr, panel + (k + i) * kPanel);
    }
  }
#endif
  if (k < kc) build_panel_scalar(w, k_size, rows, k0 + k, kc - k, gs, ldg, group, panel + k * kPanel);
}

#if PDSERVE_GEMM_ISA == 512
// int8_gemm through micro_group: each thread's panels four at a time, widened a slice of k at a time.
// All slices of a group are done before the next group, so the group's sums stay in L1 between
// slices, and each weight row is read in order. The other order (every group per slice) sent an
// lm_head's sums (16 rows x 32000) to L3 and back on every slice: on the AMX Xeon (paired, Q8_0
// scales) this order ran the lm_head 1.13-1.21x faster at 10-64 rows and 1.22-1.27x at 128-256,
// a step's 48 layer matmuls 1.02-1.07x at 10-64 rows and level at 128-256.
void int8_gemm_grouped(const float* xp, int64_t ldx, const int8_t* wp, const float* sp, bool grouped, int64_t ldg,
                       int64_t group, int64_t m_size, int64_t n_size, int64_t k_size, float* op) {
  using pdserve_gemm::kGroupPanels, pdserve_gemm::kGroupRows, pdserve_gemm::kGroupSteps;
  const int64_t panels = (n_size + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> slab(kGroupPanels * kGroupSteps * kPanel);  // the four panels, one after another
    for (int64_t m0 = 0; m0 < m_size; m0 += kBlockM) {
      const int64_t mb = std::min(kBlockM, m_size - m0);
      for (int64_t p = p0; p < p1; p += kGroupPanels) {
        const int here = static_cast<int>(std::min<int64_t>(kGroupPanels, p1 - p));
        for (int64_t k0 = 0; k0 < k_size; k0 += kGroupSteps) {
          const int64_t kc = std::min(kGroupSteps, k_size - k0);
          const bool first = k0 == 0, last = k0 + kc == k_size;
          for (int j = 0; j < here; ++j) {
            // Each build asks for what the same panel's next build reads: its next slice, or after
            // the last one the first slice of the next group's panel. A slice's 16 row pieces lie a
            // row length apart, a pattern the hardware's prefetchers missed: 1.10-1.15x at 10-32
            // rows, 1.02-1.05x at 64-128 (the 48 layer matmuls, in the other loop order).
            const int64_t n0 = (p + j) * kPanel, rows = std::min(kPanel, n_size - n0);
            int64_t ahead_n0 = n0, ahead_k0 = k0 + kc, ahead_rows = rows;
            if (last) {  // the next group's panel, from its first slice (none past the thread's panels)
              ahead_n0 = n0 + kGroupPanels * kPanel;
              ahead_k0 = 0;
              ahead_rows = p + kGroupPanels < p1 ? std::max<int64_t>(0, std::min(kPanel, n_size - ahead_n0)) : 0;
            }
            build_panel(wp + n0 * k_size, k_size, rows, k0, kc, grouped ? sp + n0 * ldg : nullptr, ldg, group,
                        slab.data() + j * kGroupSteps * kPanel,
                        ahead_rows > 0 ? wp + ahead_n0 * k_size + ahead_k0 : nullptr, ahead_rows,
                        std::min(kGroupSteps, k_size - ahead_k0));
          }
          const int64_t n0 = p * kPanel, cols = std::min(kPanel, n_size - (p + here - 1) * kPanel);
          const float* row_scale = !grouped && last ? sp + n0 : nullptr;
          for (int64_t m = 0; m < mb; m += kGroupRows) {
            const int rows = static_cast<int>(std::min<int64_t>(kGroupRows, mb - m));
            pdserve_gemm::micro_group_any(here, rows, xp + (m0 + m) * ldx + k0, ldx, slab.data(),
                                          kGroupSteps * kPanel, 0, kc, op + (m0 + m) * n_size + n0, n_size, cols,
                                          first, row_scale);
          }
        }
      }
    }
  });
}
#endif

at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_gemm: x must be a 2-D float32 tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "int8_gemm: weight must be a contiguous 2-D int8 tensor");
  TORCH_CHECK(x.size(1) == weight.size(1), "int8_gemm: x has ", x.size(1), " columns, weight ", weight.size(1));
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == weight.size(0) &&
                  (scales.dim() == 1 || scales.dim() == 2),
              "int8_gemm: scales must be float32, one per weight row (1-D) or per group of each row (2-D)");
  const int64_t m_size = x.size(0), n_size = weight.size(0), k_size = weight.size(1);
  const bool grouped = scales.dim() == 2;
  const int64_t ldg = grouped ? scales.size(1) : 0;
  TORCH_CHECK(!grouped || (ldg > 0 && k_size % ldg == 0), "int8_gemm: ", ldg, " groups do not split a row of ",
              k_size, " into equal groups");
  const int64_t group = grouped ? k_size / ldg : 0;
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({m_size, n_size}, x.options());
  if (m_size == 0 || n_size == 0) return out;
  if (k_size == 0) return out.zero_();
  const float* xp = xc.data_ptr<float>();
  const int64_t ldx = xc.stride(0);
  const int8_t* wp = weight.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t panels = (n_size + kPanel - 1) / kPanel;
#if PDSERVE_GEMM_ISA == 512
  // From 10 rows, four panels at a time through the wider tile (cpu_gemm_tile.h's micro_group), in
  // slices of k half as long so the four stay in L1: the same FMA chains, outputs bit-identical. On
  // the AVX-512 Xeon (a step's 48 matmuls, 2 threads, paired): 0.99-1.08x at 10 rows, 1.11-1.16x at
  // 16, 1.22-1.26x at 64, 1.31-1.44x at 256; at 2-8 rows, where widening the weights is the cost,
  // 0.89-0.98x.
  constexpr int64_t kGroupMinRows = 10;
  if (m_size >= kGroupMinRows) {
    int8_gemm_grouped(xp, ldx, wp, sp, grouped, ldg, group, m_size, n_size, k_size, op);
    return out;
  }
#endif
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> panel(kSliceK * kPanel);
    for (int64_t m0 = 0; m0 < m_size; m0 += kBlockM) {
      const int64_t mb = std::min(kBlockM, m_size - m0);
      for (int64_t k0 = 0; k0 < k_size; k0 += kSliceK) {
        const int64_t kc = std::min(kSliceK, k_size - k0);
        const bool first = k0 == 0, last = k0 + kc == k_size;
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t n0 = p * kPanel, cols = std::min(kPanel, n_size - n0);
          build_panel(wp + n0 * k_size, k_size, cols, k0, kc, grouped ? sp + n0 * ldg : nullptr, ldg, group,
                      panel.data());
          const float* row_scale = !grouped && last ? sp + n0 : nullptr;
          for (int64_t m = 0; m < mb; m += kRowsMax) {
            const int rows = static_cast<int>(std::min<int64_t>(kRowsMax, mb - m));
            micro_rows(rows, xp + (m0 + m) * ldx + k0, ldx, panel.data(), kc, op + (m0 + m) * n_size + n0, n_size,
                       cols, first, row_scale);
          }
        }
      }
    }
  });
  return out;
}

// The register tile's vector width in bits (cpu_gemm_tile.h): 512, 256, or 0 for the scalar loop. Both
// GEMMs (int8 here, float32 in panels) run on it.
int64_t gemm_tile_isa() { return PDSERVE_GEMM_ISA; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("int8_gemm(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  m.def("gemm_tile_isa() -> int");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("int8_gemm", &int8_gemm); }

TORCH_LIBRARY_IMPL(pdserve_cpu, CatchAll, m) { m.impl("gemm_tile_isa", &gemm_tile_isa); }
