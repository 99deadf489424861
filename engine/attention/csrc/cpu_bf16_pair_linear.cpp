// y = x Wᵀ for bfloat16 x and weights on CPUs with AVX512-BF16 but no AMX (AMD Zen 4 and Zen 5),
// the weights stored in pair groups: W's output rows in groups of 48, each group holding, for every
// pair of reduction steps (2q, 2q + 1), its 48 rows' two weights side by side (layers.py's
// `to_pair_groups`: pairs[g][q][j][h] = W[48g + j][2q + h], zero past the edges). Each 64-byte line
// is one vdpbf16ps operand: 16 outputs times two steps of k, multiplied by x's two values at those
// steps broadcast to every lane, and added into 16 float32 sums. A group is one run of memory, so a
// thread's share of the weight streams from start to end and is fetched ahead in one line of code.
//
// Why our own: on a 2-core Zen 5 EPYC with a decode step's weights from memory (bench model, 2
// threads, alternated in one process), oneDNN's packed bf16 matmul ran 16 rows at 29-31 GB/s, where
// it reads 1 row at 35-52: it waits on memory and then computes, without overlapping the two (16
// rows are 3.2 GFLOP, about 3.3 ms of this CPU's bf16 peak; the weights take 3.2-4.7 ms to read). This
// tile, with the weights fetched ahead, ran 1.2-1.35x faster from 2 to 16 rows, 1.1x at
// 32, 1.05x at 64, level from 128 to 512 rows and 0.95x at 2048; 1.07-1.22x at one row.
//
// Summation order: each output's sum runs over k in order, two steps per vdpbf16ps, so a row's result
// does not depend on the other rows of the batch nor on the number of threads. The float32 sum is
// rounded to bfloat16 (nearest even) once.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_gemm_tile.h"
#include "cpu_parallel.h"
#include "cpu_step_parts.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define PDSERVE_PAIR_PANELS 1
#else
#define PDSERVE_PAIR_PANELS 0
#endif

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel: one vector of float32 sums
constexpr int kGroup = 3;       // panels of a group, multiplied together

#if PDSERVE_PAIR_PANELS
// 8 rows x 3 panels: 24 accumulators and 3 weight vectors of the 32 registers; a 16-row decode batch
// is two row blocks.
constexpr int kRows = 8;
constexpr int64_t kLine = kGroup * kPanel;  // a group's outputs: its float32 sums per row

// Pairs per pass over the row blocks (the group's pass stays in L1 for every block), and how far ahead
// the weights are fetched: one pass. Fetched at all, 16 rows of a decode step's weights ran 1.2-1.27x
// faster than with the hardware's prefetch alone on a Zen 5 EPYC (without it the row blocks after the
// first computed while no line was on its way). Passes of 64 pairs (12 KiB) fetched one pass ahead then
// ran, against 128-pair passes fetched two ahead, 1.12-1.13x at 16 rows, 1.03-1.06x at 1 to 64 (1.05x
// with 128-pair passes one ahead; 1.04x at 32-pair passes; fetching a further 1024 pairs ahead to L2
// on top, 0.94x), but 0.97x at 256 rows, where 128-pair passes fetched one ahead are level with two.
constexpr int64_t steps_per_pass(int64_t rows) { return rows <= 64 ? 64 : 128; }

// Each row block fetches its share of a pass's three panels (pdserve_gemm::ahead_share; 16 rows: panels
// 0 and 1 in the first block, 2 in the second). On the Zen 5, a decode step's weights from memory,
// against the first block fetching all three: 1.07-1.13x at 32 rows, 1.03-1.09x at 24, 48, 64 and 128,
// 1.01-1.03x at 16, level at 1, 8 and 512.

// Sums of rows [0, MR) of x (bf16 pairs as 32-bit words, ldx words a row) times one group over pairs
// [q0, q1), added to `sums` (MR rows of kLine floats) unless `first`. On the `last` pass they are
// rounded to bfloat16 and stored to `out` instead, its first `cols` columns only. As each pair q is
// read, NF side-by-side lines from fetch + q * kLine are fetched, into L2 where L2 (as
// pdserve_simd::fetch_into_l2 picks), else into L1: this block's share of the panels a pass on (past
// the group's end, the next group's).
//
// NF is a template argument, not a run-time mask: testing a mask's bits in the loop took general
// registers that the 8 row pointers of x had left short, and GCC parked loop values in vector
// registers and spilled a weight vector to the stack on every pair. On a Zen 5 EPYC the 16-row tile
// then ran at 84% of the vdpbf16ps peak on one thread; without the spill, 89-91%. Measured in one
// process against the masked loop (2 threads): 16 rows 1.04-1.06x with the weights in cache, 1.02x for
// the bench model's 49 matmuls from memory, 1.07x at 64 rows, 1.05-1.08x at 512; level at 1 and 4.
template <int MR, int NF, bool L2>
inline void tile(const uint32_t* x, int64_t ldx, const uint32_t* group, int64_t q0, int64_t q1, float* sums,
                 bool first, bool last, at::BFloat16* out, int64_t ldo, int64_t cols, const uint32_t* fetch) {
  __m512 acc[MR][kGroup];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < kGroup; ++j)
      acc[i][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + i * kLine + j * kPanel);
  }
  for (int64_t q = q0; q < q1; ++q) {
    const uint32_t* line = group + q * kLine;
#pragma GCC unroll 4
    for (int j = 0; j < NF; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(fetch + q * kLine + j * kPanel), L2 ? _MM_HINT_T1 : _MM_HINT_T0);
    __m512bh wv[kGroup];
#pragma GCC unroll 4
    for (int j = 0; j < kGroup; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(line + j * kPanel);
    // In registers (cpu_simd.h): GCC 12 otherwise folded them into the 2-row tile's vdpbf16ps as memory
    // operands (Zen 5, weights in L1: 231 -> 300 GFLOP/s).
    pdserve_simd::keep_in_registers(wv);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * ldx + q]));
#pragma GCC unroll 4
      for (int j = 0; j < kGroup; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  if (!last) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
      for (int j = 0; j < kGroup; ++j) _mm512_storeu_ps(sums + i * kLine + j * kPanel, acc[i][j]);
    }
    return;
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < kGroup; ++j) {
      const int64_t here = std::clamp<int64_t>(cols - j * kPanel, 0, kPanel);
      const __m256i bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[i][j]));
      _mm256_mask_storeu_epi16(out + i * ldo + j * kPanel, static_cast<__mmask16>((1u << here) - 1), bits);
    }
  }
}

// tile<rows, fetched, into_l2> for run-time counts (1 <= rows <= kRows, 0 <= fetched <= kGroup).
template <int MR = kRows>
inline void tile_rows(int rows, int fetched, bool into_l2, const uint32_t* x, int64_t ldx, const uint32_t* group,
                      int64_t q0, int64_t q1, float* sums, bool first, bool last, at::BFloat16* out, int64_t ldo,
                      int64_t cols, const uint32_t* fetch) {
  if constexpr (MR > 0) {
    if (rows != MR)
      return tile_rows<MR - 1>(rows, fetched, into_l2, x, ldx, group, q0, q1, sums, first, last, out, ldo, cols,
                               fetch);
#define PDSERVE_TILE(NF, L2) return tile<MR, NF, L2>(x, ldx, group, q0, q1, sums, first, last, out, ldo, cols, fetch)
    switch (fetched) {
      case 0: PDSERVE_TILE(0, false);
      case 1: if (into_l2) PDSERVE_TILE(1, true); PDSERVE_TILE(1, false);
      case 2: if (into_l2) PDSERVE_TILE(2, true); PDSERVE_TILE(2, false);
      default: if (into_l2) PDSERVE_TILE(3, true); PDSERVE_TILE(3, false);
    }
#undef PDSERVE_TILE
  }
}

// Below this many rows a Zen 4 leaves the weights to its hardware prefetcher. On a 2-core Zen 4
// EPYC (SmolLM2's bf16 decode steps alternated in one process), against fetching into L1 one pass
// ahead: no software fetch 1.16x faster at 1 row, 1.19x at 2, 1.15x at 4 (into L2 1.09x, 1.15x,
// 1.04x), level with into L2 at 8 (1.10x and 1.12x), 0.89x at 32 rows. On the Zen 5 the fetch was
// measured at 16 rows only, where it paid (above): it keeps it at every row count.
constexpr int64_t kZen4FetchRows = 8;

// out[m, n] = x[m] · W[n] for every row m, the groups split over threads.
void pairs_times(const uint32_t* x, int64_t ldx, const uint32_t* w, int64_t groups, int64_t m_size, int64_t q_size,
                 int64_t n_size, at::BFloat16* out) {
  const int64_t group_size = q_size * kLine;
  const int64_t steps = steps_per_pass(m_size);
  // Long inputs (prefill chunks) go through in slices (pdserve_gemm::slice_rows), each through all of
  // the thread's groups, so that a slice of x and its sums stay in L2 while the groups pass, as in
  // cpu_panel_linear.cpp. On a Zen 5 (2 threads, alternated): 2048 rows 1.03-1.04x (900-945 GFLOP/s of
  // a 1090 bf16 peak) on SmolLM2's and the bench model's matmul shapes, level at 512 and 1024.
  const int64_t slice = pdserve_gemm::slice_rows(m_size, kRows);
  const bool fetch = !(pdserve_simd::zen4() && m_size < kZen4FetchRows);
  const bool into_l2 = pdserve_simd::fetch_into_l2();
  pdserve_parallel::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    // The float32 sums between passes over k: every row of the slice for the group's columns.
    std::vector<float> sums(q_size > steps ? static_cast<size_t>(std::min(slice, m_size) * kLine) : 0);
    for (int64_t m0 = 0; m0 < m_size; m0 += slice) {
      const int64_t m1 = std::min(m_size, m0 + slice), blocks = (m1 - m0 + kRows - 1) / kRows;
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t n0 = g * kLine, cols = std::min(kLine, n_size - n0);
        const uint32_t* group = w + g * group_size;
        for (int64_t q0 = 0; q0 < q_size; q0 += steps) {
          const int64_t q1 = std::min(q_size, q0 + steps);
          for (int64_t m = m0, b = 0; m < m1; m += kRows, ++b) {
            // This block's panels to fetch ahead (pdserve_gemm::ahead_share): a run of side-by-side lines.
            const int share = fetch ? pdserve_gemm::ahead_share(b, blocks, kGroup) : 0;
            const int first_panel = share ? __builtin_ctz(share) : 0;
            tile_rows(static_cast<int>(std::min<int64_t>(kRows, m1 - m)), __builtin_popcount(share), into_l2,
                      x + m * ldx, ldx, group, q0, q1, sums.data() + (m - m0) * kLine, q0 == 0, q1 == q_size,
                      out + m * n_size + n0, n_size, cols, group + steps * kLine + first_panel * kPanel);
          }
        }
      }
    }
  });
}
#endif

at::Tensor pair_linear(const at::Tensor& x, const at::Tensor& pairs, int64_t out_features) {
  TORCH_CHECK(PDSERVE_PAIR_PANELS, "pair_linear: built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "pair_linear: x must be a 2-D bfloat16 tensor");
  const int64_t count = pairs.dim() == 4 ? pairs.size(0) : 0, q_size = pairs.dim() == 4 ? pairs.size(1) : 0;
  const int64_t m_size = x.size(0), k_size = x.size(1);
  const pdserve_parts::Fit fit = pdserve_parts::pair_groups_fit(pairs, k_size, out_features);
  TORCH_CHECK(fit.layout, "pair_linear: the weight must be contiguous bfloat16 pairs [groups, ceil(in / 2), 48, 2]");
  TORCH_CHECK(fit.inputs, "pair_linear: x has ", k_size, " columns, the weight ", 2 * q_size);
  TORCH_CHECK(fit.outputs, "pair_linear: ", count, " groups cannot hold ", out_features, " output features");
  at::Tensor out = at::empty({m_size, out_features}, x.options());
  if (m_size == 0 || out_features == 0) return out;
  if (q_size == 0) return out.zero_();
#if PDSERVE_PAIR_PANELS
  // x is read a pair of bf16 at a time: rows of whole pairs, so an odd width is padded with a zero.
  at::Tensor xc = x;
  if (k_size % 2 != 0 || x.stride(1) != 1 || x.stride(0) % 2 != 0 ||
      reinterpret_cast<uintptr_t>(x.data_ptr()) % sizeof(uint32_t) != 0) {
    xc = at::zeros({m_size, 2 * q_size}, x.options());
    xc.narrow(1, 0, k_size).copy_(x);
  }
  pairs_times(reinterpret_cast<const uint32_t*>(xc.data_ptr<at::BFloat16>()), xc.stride(0) / 2,
              reinterpret_cast<const uint32_t*>(pairs.data_ptr<at::BFloat16>()), count, m_size, q_size,
              out_features, out.data_ptr<at::BFloat16>());
#endif
  return out;
}

bool pair_linear_available() { return PDSERVE_PAIR_PANELS; }

}  // namespace

bool pdserve_parts::pairs_ready() { return pair_linear_available(); }

pdserve_parts::Fit pdserve_parts::pair_groups_fit(const at::Tensor& pairs, int64_t k_size, int64_t out_features) {
  Fit fit;
  fit.layout = pairs.dim() == 4 && pairs.is_contiguous() && pairs.scalar_type() == at::kBFloat16 &&
               pairs.size(2) == kGroup * kPanel && pairs.size(3) == 2;
  if (!fit.layout) return fit;
  const int64_t count = pairs.size(0), q_size = pairs.size(1);
  fit.inputs = k_size == 2 * q_size || k_size + 1 == 2 * q_size;
  fit.outputs = out_features > (count - 1) * kGroup * kPanel && out_features <= count * kGroup * kPanel;
  return fit;
}

void pdserve_parts::pair_linear(const at::BFloat16* x, int64_t ldx, int64_t rows, const at::BFloat16* pairs,
                                int64_t groups, int64_t k_size, at::BFloat16* y, int64_t out_features) {
#if PDSERVE_PAIR_PANELS
  pairs_times(reinterpret_cast<const uint32_t*>(x), ldx / 2, reinterpret_cast<const uint32_t*>(pairs), groups, rows,
              k_size / 2, out_features, y);
#else
  (void)x, (void)ldx, (void)rows, (void)pairs, (void)groups, (void)k_size, (void)y, (void)out_features;
#endif
}

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("pair_linear(Tensor x, Tensor pairs, int out_features) -> Tensor");
  m.def("pair_linear_available() -> bool");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("pair_linear", &pair_linear); }
TORCH_LIBRARY_IMPL(pdserve_cpu, CatchAll, m) { m.impl("pair_linear_available", &pair_linear_available); }
