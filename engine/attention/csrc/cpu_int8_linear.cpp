// y = x Wᵀ for a few rows of x (decode steps), where reading the weight from memory is the cost:
// - `int8_linear`: an int8 weight with one float scale per output row (`quantization="int8"`) or
//   one per group of consecutive weights in a row (`quantization="q8_0"`, GGUF's Q8_0 blocks),
//   widened to float32 in registers, so int8 reads about a quarter of float32's bytes; x is never
//   rounded (weight-only quantization). With groups, each weight is widened and multiplied by its
//   scale before the FMA: that product is exactly the dequantized float32 weight, so the result
//   equals `float_linear` on the dequantized weight to the bit;
// - `float_linear`: a float32 weight (AVX2), or a bfloat16 one (AVX512-BF16, or AVX2 widening it),
//   for one row where this streams the weight faster than MKL's gemv or oneDNN's packed layout
//   (engine/model/linear_tuning.py times them per shape). bfloat16 products are summed in float32
//   (vdpbf16ps, or FMAs on the widened values) and the result rounded to bfloat16 once, as oneDNN
//   does, in another order.
//
// Each task takes a block of output rows; within it, a tile of NR weight rows times MR rows of x
// is accumulated in AVX2 registers over the whole reduction, so the weight block is read from
// memory once and from L1 for each further tile of x rows.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_INT8_AVX2 1
#else
#define PDSERVE_INT8_AVX2 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define PDSERVE_BF16_AVX512 1
#else
#define PDSERVE_BF16_AVX512 0
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

// 8 bfloat16 weights widened to 8 floats (the high halves of float32).
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
#endif

// int8 rows are short (a 576-wide row is 9 cache lines), and at one to a few rows of x the kernel
// waits on memory more than it computes, at under half the bandwidth float32 reaches with its 4x
// longer rows. So the weight rows kPrefetchTiles tiles ahead are asked for early. Measured on the
// matmuls of one SmolLM2-135M decode step (2 threads, the two builds alternated, three rounds):
// row scales 10-11 -> 6.5-8 ms at one row and 12-15 -> 9-13 ms at four; group scales (which also
// multiply each weight) 11-13 -> 7-11 ms at one row and two, no better at three and worse at four,
// where they compute more than they wait. Past those rows the loops are compiled without it.
// On the AVX-512 Xeon (a step's 48 matmuls of the bench model, 2 threads, in one process) asking
// early still paid at more rows: row scales 1.33-1.39x at 2-4 rows, 1.16-1.21x at 5-6, 1.09x at 8;
// group scales 1.25-1.36x at 2-4, 1.13-1.15x at 5-6, 1.00-1.14x at 8 (the register kernel's most
// there, quant.SMALL_ROWS_AVX512).
constexpr int kPrefetchTiles = 2;
#if defined(__AVX512F__)
constexpr int64_t kPrefetchMaxRows = 8;
constexpr int64_t kPrefetchMaxRowsGrouped = 8;
#else
constexpr int64_t kPrefetchMaxRows = 4;
constexpr int64_t kPrefetchMaxRowsGrouped = 2;
#endif

template <int NR>
inline void prefetch_rows(const int8_t* w, int64_t ldw, int64_t k) {
#if PDSERVE_INT8_AVX2
  for (int j = 0; j < NR; ++j)
    _mm_prefetch(reinterpret_cast<const char*>(w + (j + kPrefetchTiles * NR) * ldw + k), _MM_HINT_T0);
#endif
}

#if PDSERVE_INT8_AVX2
// The accumulator tile, shared by both kernels; forced inline, or the tile leaves the registers.
// acc[i][j] += x[i][k..k+8] * wv[j], for the MR rows of x and NR weight vectors of one step.
template <int NR, int MR>
__attribute__((always_inline)) inline void fma_step(const float* x, int64_t ldx, int64_t k, const __m256 (&wv)[NR],
                                                    __m256 (&acc)[MR][NR]) {
  for (int i = 0; i < MR; ++i) {
    __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
  }
}

template <int NR, int MR>
__attribute__((always_inline)) inline void zero(__m256 (&acc)[MR][NR]) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
}

template <int NR, int MR>
__attribute__((always_inline)) inline void reduce(const __m256 (&acc)[MR][NR], float (&sums)[MR][NR]) {
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) sums[i][j] = hsum(acc[i][j]);
}
#endif

// out[m][n] = scale[n] * sum_k x[m][k] * w[n][k] for NR rows of w from n and MR rows of x from m
// (no scale: a float32 weight).
template <int NR, int MR, bool PF, typename W>
inline void tile(const float* x, int64_t ldx, const W* w, int64_t ldw, const float* scale, float* out,
                 int64_t ldo, int64_t k_size) {
  float sums[MR][NR];
  int64_t k = 0;
#if PDSERVE_INT8_AVX2
  __m256 acc[MR][NR];
  zero(acc);
  for (; k + 8 <= k_size; k += 8) {
    if constexpr (PF && sizeof(W) == 1) {
      if ((k & 63) == 0) prefetch_rows<NR>(w, ldw, k);
    }
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = load8(w + j * ldw + k);
    fma_step(x, ldx, k, wv, acc);
  }
  reduce(acc, sums);
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

// The grouped form of `tile`: row j's weights k..k+group share the scale gs[j * ldg + k / group].
// Accumulation runs over k in the same order as `tile`, so a float32 weight equal to q * scale
// gives the same sums to the bit.
template <int NR, int MR, bool PF>
inline void tile_grouped(const float* x, int64_t ldx, const int8_t* w, int64_t ldw, const float* gs, int64_t ldg,
                         int64_t group, float* out, int64_t ldo, int64_t k_size) {
  float sums[MR][NR];
#if PDSERVE_INT8_AVX2
  __m256 acc[MR][NR];
  zero(acc);
  for (int64_t g = 0, k = 0; k < k_size; ++g) {
    __m256 s[NR];
    for (int j = 0; j < NR; ++j) s[j] = _mm256_set1_ps(gs[j * ldg + g]);
    if constexpr (PF)  // one prefetch per 64 bytes of each row, however the groups fall
      for (int64_t line = (k + 63) & ~int64_t{63}; line < k + group; line += 64) prefetch_rows<NR>(w, ldw, line);
    for (const int64_t end = k + group; k < end; k += 8) {
      __m256 wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = _mm256_mul_ps(load8(w + j * ldw + k), s[j]);
      fma_step(x, ldx, k, wv, acc);
    }
  }
  reduce(acc, sums);
#else
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) sums[i][j] = 0.f;
  for (int64_t k = 0; k < k_size; ++k)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j)
        sums[i][j] += x[i * ldx + k] * (static_cast<float>(w[j * ldw + k]) * gs[j * ldg + k / group]);
#endif
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i * ldo + j] = sums[i][j];
}

// f(std::integral_constant<int, MR>{}, m) for the last tile of x, `rows` (< MaxRows) rows from m.
template <int MaxRows, typename F>
inline void last_x_tile(int64_t rows, int64_t m, const F& f) {
  if constexpr (MaxRows > 1) {
    if (rows == MaxRows - 1) return f(std::integral_constant<int, MaxRows - 1>{}, m);
    last_x_tile<MaxRows - 1>(rows, m, f);
  }
}

// f(std::integral_constant<int, MR>{}, m) for the tiles of up to MaxRows rows of x, first row m, in order.
template <int MaxRows = 4, typename F>
inline void over_x_tiles(int64_t m_size, const F& f) {
  int64_t m = 0;
  for (; m + MaxRows <= m_size; m += MaxRows) f(std::integral_constant<int, MaxRows>{}, m);
  last_x_tile<MaxRows>(m_size - m, m, f);
}

// Rows of x per tile of the widening kernels. AVX-512's 32 vector registers hold a tile of 8 rows
// (16 accumulators beside the 2 weight vectors), so each weight is widened once for 8 rows, not
// twice: on the AMX Xeon (a step's 48 int8 matmuls, 2 threads, paired) 1.13-1.34x at 5-6 rows,
// 1.06-1.11x at 7-8, the same bits (each output is still one accumulator over k in order).
#if defined(__AVX512F__)
constexpr int kXTileRows = 8;
#else
constexpr int kXTileRows = 4;
#endif

// Every row of x (in tiles of up to kXTileRows) against one tile of weight rows, by `Tile<MR>`.
template <template <int> class Tile, typename... Args>
void rows_of_x(const float* x, int64_t m_size, int64_t ldx, float* out, int64_t ldo, Args... args) {
  over_x_tiles<kXTileRows>(m_size, [&](auto mr, int64_t m) {
    Tile<decltype(mr)::value>::run(x + m * ldx, ldx, out + m * ldo, ldo, args...);
  });
}

template <int NR, bool PF, typename W>
struct RowScaled {
  template <int MR>
  struct T {
    static void run(const float* x, int64_t ldx, float* out, int64_t ldo, const W* w, int64_t ldw,
                    const float* scale, int64_t k_size) {
      tile<NR, MR, PF>(x, ldx, w, ldw, scale, out, ldo, k_size);
    }
  };
};

template <int NR, bool PF>
struct GroupScaled {
  template <int MR>
  struct T {
    static void run(const float* x, int64_t ldx, float* out, int64_t ldo, const int8_t* w, int64_t ldw,
                    const float* gs, int64_t ldg, int64_t group, int64_t k_size) {
      tile_grouped<NR, MR, PF>(x, ldx, w, ldw, gs, ldg, group, out, ldo, k_size);
    }
  };
};

constexpr int64_t kRowsPerTile = 2;

// block(n0, n1) for blocks of output rows, split over threads unless `serial`.
template <typename Block>
void over_row_blocks(int64_t n_size, bool serial, const Block& block) {
  // Blocks of 16 output rows: enough work per task to hide the scheduling, and fine enough that
  // the last tasks do not leave a core idle.
  constexpr int64_t kBlock = 16;
  const int64_t blocks = (n_size + kBlock - 1) / kBlock;
  // Serial: a grain of every block keeps the loop on the calling thread. Where OpenMP's idle
  // threads sleep (OMP_WAIT_POLICY=PASSIVE, as `pdserve up` sets for prefill engines), waking
  // them costs more than a small weight takes to read.
  at::parallel_for(0, blocks, serial ? blocks : 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) block(b * kBlock, std::min(n_size, (b + 1) * kBlock));
  });
}

// out = x wᵀ (times the row scales, if any).
template <bool PF, typename W>
void small_linear_with(const at::Tensor& xc, const W* wp, const float* sp, int64_t n_size, int64_t k_size,
                       at::Tensor& out, bool serial) {
  const int64_t m_size = xc.size(0), ldx = xc.stride(0);
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // A float32 weight is read one row after another: a single sequential stream per thread, which
  // the prefetchers follow. Two rows interleaved read SmolLM2's float32 weights at 16-18 GB/s on a
  // Zen 4 EPYC (2 threads), one at a time at 25 (a plain sum of the bytes: 31). int8 rows keep
  // their pairs: a single FMA chain widening a quarter of the bytes per step is what limits them.
  // Each output's sum runs over k in the same order either way, so results do not change.
  constexpr int64_t tile_rows = sizeof(W) == 1 ? kRowsPerTile : 1;
  over_row_blocks(n_size, serial, [&](int64_t n0, int64_t n1) {
    auto scale_at = [&](int64_t n) { return sp != nullptr ? sp + n : nullptr; };
    int64_t n = n0;
    for (; n + tile_rows <= n1; n += tile_rows)
      rows_of_x<RowScaled<tile_rows, PF, W>::template T>(xp, m_size, ldx, op + n, n_size, wp + n * k_size, k_size,
                                                          scale_at(n), k_size);
    for (; n < n1; ++n)
      rows_of_x<RowScaled<1, PF, W>::template T>(xp, m_size, ldx, op + n, n_size, wp + n * k_size, k_size,
                                                 scale_at(n), k_size);
  });
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
// One row of x (a lone decode) where the CPU has AVX-512: each weight row is read start to end, 16
// products per FMA, in kChains chains (chunk j of 16 goes to chain j % kChains) summed once at the
// end. An int8 weight row widened 8 at a time in one chain kept a core waiting on that chain, at
// about half the memory's bandwidth. float32 and int8
// weights share this order at one row, so a Q8_0 layer still gives what float32 gives on its
// dequantized weight, to the bit.
constexpr int kChains = 4;
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const int8_t* p, __mmask16 m) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// The scales of weights k..k+16 of a row: each 8 share one (groups are whole multiples of 8).
inline __m512 group_scales16(const float* gs, int64_t k, int64_t group, int64_t k_size) {
  const float lo = gs[k / group];
  const float hi = k + 8 < k_size ? gs[(k + 8) / group] : lo;
  return _mm512_insertf32x8(_mm512_set1_ps(lo), _mm256_set1_ps(hi), 1);
}

// sum_k x[k] * w[k] (* its group's scale where gs is given).
template <typename W>
inline float row_dot16(const float* x, const W* w, int64_t k_size, const float* gs, int64_t group) {
  constexpr __mmask16 all = 0xFFFF;
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_setzero_ps();
  // Power-of-two groups (Q8_0's 32) find their scale by a shift, not a division per chunk.
  const int shift = (gs != nullptr && group >= 16 && (group & (group - 1)) == 0) ? __builtin_ctzll(group) : -1;
  auto chunk = [&](int64_t k, __mmask16 m, int chain) {
    __m512 wv = load16(w + k, m);
    if (gs != nullptr)
      wv = _mm512_mul_ps(wv, shift >= 0 ? _mm512_set1_ps(gs[k >> shift]) : group_scales16(gs, k, group, k_size));
    acc[chain] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + k), wv, acc[chain]);
  };
  int64_t k = 0;
  for (; k + 16 * kChains <= k_size; k += 16 * kChains)
    for (int c = 0; c < kChains; ++c) chunk(k + 16 * c, all, c);
  int chain = 0;
  for (; k + 16 <= k_size; k += 16) chunk(k, all, chain++);
  if (k < k_size) chunk(k, static_cast<__mmask16>((1u << (k_size - k)) - 1), chain);
  __m512 total = acc[0];
  for (int c = 1; c < kChains; ++c) total = _mm512_add_ps(total, acc[c]);
  return _mm512_reduce_add_ps(total);
}

template <typename W>
inline float row_dot(const float* x, const W* w, int64_t k_size, const float* gs, int64_t group) {
  return row_dot16(x, w, k_size, gs, group);
}
#define PDSERVE_ONE_ROW 1
#elif PDSERVE_INT8_AVX2
// One row of x (a lone decode) with AVX2: the same reading as row_dot16, 8 products per FMA, chunk j
// of 8 into chain j % kChains8, the chains summed once, then the row's tail in order. The tiles'
// single chain per output waits on the FMA latency (4 cycles per 32 bytes of weight on a Zen 3):
// about 40 GB/s over 2 cores, under what L3 and even DRAM give. SmolLM2-135M's decode matmuls,
// float32, 2 threads: 23.9 -> 27.5 GB/s with the weights from memory, 36.7 -> 60.1 from L3.
// float32 and int8 weights share this order at one row, so a Q8_0 layer still gives what float32
// gives on its dequantized weight, to the bit. Q8_0 rows (576 bytes for SmolLM2) end before the
// prefetchers get going: without asking for the rows 8 ahead this order read them 15% slower than
// the tiles did (which ask 4 ahead); with it, level (median of 40 alternated pairs 0.99x, float32
// 1.10x on the same run).
constexpr int kChains8 = 4;
constexpr int64_t kRowsAhead8 = 8;

template <typename W>
inline float row_dot(const float* x, const W* w, int64_t k_size, const float* gs, int64_t group) {
  __m256 acc[kChains8];
  for (int c = 0; c < kChains8; ++c) acc[c] = _mm256_setzero_ps();
  // Power-of-two groups (Q8_0's 32) find their scale by a shift; groups are whole chunks of 8.
  const int shift = (gs != nullptr && (group & (group - 1)) == 0) ? __builtin_ctzll(group) : -1;
  auto scale_at = [&](int64_t k) { return shift >= 0 ? gs[k >> shift] : gs[k / group]; };
  // int8 rows are short: ask for the row kRowsAhead8 on, a line per 64 weights (no fault past the end).
  auto ask_ahead = [&](int64_t k) {
    if constexpr (sizeof(W) == 1) {
      if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + kRowsAhead8 * k_size + k), _MM_HINT_T0);
    }
  };
  auto chunk = [&](int64_t k, int chain) {
    ask_ahead(k);
    __m256 wv = load8(w + k);
    if (gs != nullptr) wv = _mm256_mul_ps(wv, _mm256_set1_ps(scale_at(k)));
    acc[chain] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), wv, acc[chain]);
  };
  int64_t k = 0;
  if (gs != nullptr && shift >= 5) {
    // Groups of 32 or more (Q8_0): a step's four chunks share one scale, loaded and broadcast once,
    // the same products as `chunk` makes, so the same sums. Q8_0 at one row, SmolLM2's decode
    // shapes from memory, 40 alternated pairs: 1.21-1.24x (per-chunk scales kept the core busy).
    for (; k + 8 * kChains8 <= k_size; k += 8 * kChains8) {
      ask_ahead(k);
      const __m256 s = _mm256_set1_ps(gs[k >> shift]);
      for (int c = 0; c < kChains8; ++c)
        acc[c] = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8 * c), _mm256_mul_ps(load8(w + k + 8 * c), s), acc[c]);
    }
  }
  for (; k + 8 * kChains8 <= k_size; k += 8 * kChains8)
    for (int c = 0; c < kChains8; ++c) chunk(k + 8 * c, c);
  for (int chain = 0; k + 8 <= k_size; k += 8) chunk(k, chain++);
  float sum = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  for (; k < k_size; ++k) {
    const float wk = gs != nullptr ? static_cast<float>(w[k]) * scale_at(k) : static_cast<float>(w[k]);
    sum += x[k] * wk;
  }
  return sum;
}
#define PDSERVE_ONE_ROW 1
#else
#define PDSERVE_ONE_ROW 0
#endif

#if PDSERVE_ONE_ROW
// out = x wᵀ for one row of x: row scales `sp` (per output) or group scales `gs` (ldg per row).
template <typename W>
void one_row_linear(const float* xp, const W* wp, const float* sp, const float* gs, int64_t ldg, int64_t group,
                    int64_t n_size, int64_t k_size, float* op, bool serial) {
  over_row_blocks(n_size, serial, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const float sum = row_dot(xp, wp + n * k_size, k_size, gs != nullptr ? gs + n * ldg : nullptr, group);
      op[n] = sp != nullptr ? sum * sp[n] : sum;
    }
  });
}
#endif

// Prefetching is compiled into its own instances, so the loops without it stay as they were.
template <typename W>
void small_linear(const at::Tensor& xc, const W* wp, const float* sp, int64_t n_size, int64_t k_size, at::Tensor& out,
                  bool serial = false) {
#if PDSERVE_ONE_ROW
  if (xc.size(0) == 1)
    return one_row_linear(xc.data_ptr<float>(), wp, sp, static_cast<const float*>(nullptr), 0, 1, n_size, k_size,
                          out.data_ptr<float>(), serial);
#endif
  if (sizeof(W) == 1 && xc.size(0) <= kPrefetchMaxRows)
    small_linear_with<true>(xc, wp, sp, n_size, k_size, out, serial);
  else
    small_linear_with<false>(xc, wp, sp, n_size, k_size, out, serial);
}

// out = x (q * group scales)ᵀ.
template <bool PF>
void grouped_linear_with(const at::Tensor& xc, const int8_t* wp, const float* gp, int64_t group, int64_t n_size,
                         int64_t k_size, at::Tensor& out) {
  const int64_t m_size = xc.size(0), ldx = xc.stride(0), ldg = k_size / group;
  const float* xp = xc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  over_row_blocks(n_size, false, [&](int64_t n0, int64_t n1) {
    int64_t n = n0;
    for (; n + kRowsPerTile <= n1; n += kRowsPerTile)
      rows_of_x<GroupScaled<kRowsPerTile, PF>::template T>(xp, m_size, ldx, op + n, n_size, wp + n * k_size, k_size,
                                                            gp + n * ldg, ldg, group, k_size);
    for (; n < n1; ++n)
      rows_of_x<GroupScaled<1, PF>::template T>(xp, m_size, ldx, op + n, n_size, wp + n * k_size, k_size,
                                                gp + n * ldg, ldg, group, k_size);
  });
}

void grouped_linear(const at::Tensor& xc, const int8_t* wp, const float* gp, int64_t group, int64_t n_size,
                    int64_t k_size, at::Tensor& out) {
#if PDSERVE_ONE_ROW
  if (xc.size(0) == 1)
    return one_row_linear(xc.data_ptr<float>(), wp, static_cast<const float*>(nullptr), gp, k_size / group, group,
                          n_size, k_size, out.data_ptr<float>(), false);
#endif
  if (xc.size(0) <= kPrefetchMaxRowsGrouped)
    grouped_linear_with<true>(xc, wp, gp, group, n_size, k_size, out);
  else
    grouped_linear_with<false>(xc, wp, gp, group, n_size, k_size, out);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_linear: x must be a 2-D float32 tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "int8_linear: weight must be a contiguous 2-D int8 tensor");
  TORCH_CHECK(x.size(1) == weight.size(1), "int8_linear: x has ", x.size(1), " columns, weight ", weight.size(1));
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == weight.size(0) &&
                  (scales.dim() == 1 || scales.dim() == 2),
              "int8_linear: scales must be float32, one per weight row (1-D) or per group of each row (2-D)");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({xc.size(0), weight.size(0)}, x.options());
  if (scales.dim() == 1) {
    small_linear(xc, weight.data_ptr<int8_t>(), scales.data_ptr<float>(), weight.size(0), weight.size(1), out);
    return out;
  }
  const int64_t groups = scales.size(1), k_size = weight.size(1);
  TORCH_CHECK(groups > 0 && k_size % groups == 0 && (k_size / groups) % 8 == 0, "int8_linear: ", groups,
              " groups do not split a row of ", k_size, " into equal groups of a multiple of 8");
  grouped_linear(xc, weight.data_ptr<int8_t>(), scales.data_ptr<float>(), k_size / groups, weight.size(0), k_size,
                 out);
  return out;
}

// --- int8 activations (`int8_activations`: W8A8, the dot product llama.cpp's Q8_0 path takes) ---
// Each row of x is rounded to int8 in blocks of kActBlock values, one float scale per block
// (amax / 127, round half to even), and each block's products are summed exactly in integers:
// 32 weights cost one vpmaddubsw, one vpmaddwd and one conversion, where widening each weight to
// float32 costs a conversion, a multiply by its group scale and an FMA per 8. At one row this reads
// the weights at memory speed where widening stays below it. The error added is x's rounding: at
// most half a step of its block per value (tests/engine/test_int8_activations.py states the bound).
constexpr int64_t kActBlock = 32;
constexpr float kActQmax = 127.f;  // symmetric, as the weights (quant.QMAX)
constexpr int64_t kActPrefetchBytes = 1024;  // a weight row's stream, read ahead (measured: 512-4096 alike)
constexpr int64_t kActPrefetchMaxRows = 4;

// One row of x to int8 in blocks of kActBlock: xq = round(x / d) with d = amax / 127 per block.
// Vector and scalar forms give the same bits: x * (1 / d) rounded half to even either way.
void quantize_row(const float* x, int64_t k_size, int8_t* xq, float* xd) {
  for (int64_t b = 0; b < k_size / kActBlock; ++b) {
    const float* xb = x + b * kActBlock;
#if PDSERVE_INT8_AVX2
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = _mm_cvtss_f32(m) / kActQmax, id = d > 0.f ? 1.f / d : 0.f;
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));  // half to even
    // packs work within 128-bit lanes: the permute puts the 32 bytes back in order.
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * kActBlock),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
#else
    float amax = 0.f;
    for (int i = 0; i < kActBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / kActQmax, id = d > 0.f ? 1.f / d : 0.f;
    for (int i = 0; i < kActBlock; ++i) xq[b * kActBlock + i] = static_cast<int8_t>(std::nearbyint(xb[i] * id));
#endif
    xd[b] = d;
  }
}

// out[i * ldo] = sum over blocks b of (x row i's scale for b * the weight's scale for b) * the
// block's integer dot, for MR rows of x against one weight row (gs: its group scales, one per
// 2^shift weights; G false: a row scale the caller applies). Each weight block is loaded once for
// all MR rows. A row's sum runs over the blocks in order in one accumulator whatever MR is, so its
// result does not depend on the rows batched with it.
template <int MR, bool PF, bool G>
inline void tile_a8(const int8_t* xq, const float* xd, int64_t ldq, int64_t ldd, const int8_t* w, int64_t blocks,
                    const float* gs, int shift, float* out, int64_t ldo) {
#if PDSERVE_INT8_AVX2
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < blocks; ++b) {
    if constexpr (PF)  // one prefetch per 64 bytes of the weight row
      if ((b & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + b * kActBlock + kActPrefetchBytes), _MM_HINT_T0);
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kActBlock));
    float w_scale = 1.f;
    if constexpr (G) w_scale = gs[(b * kActBlock) >> shift];
    for (int i = 0; i < MR; ++i) {
      // vpmaddubsw multiplies unsigned by signed bytes, so x's sign moves onto w (|x| <= 127: a
      // pair's sum fits int16); vpmaddwd then sums the pairs exactly into 8 int32 lanes.
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * ldq + b * kActBlock));
      const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(wv, xv));
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
      acc[i] = _mm256_fmadd_ps(dot, _mm256_set1_ps(G ? xd[i * ldd + b] * w_scale : xd[i * ldd + b]), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) out[i * ldo] = hsum(acc[i]);
#else
  for (int i = 0; i < MR; ++i) {
    float sum = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t dot = 0;
      for (int64_t k = b * kActBlock; k < (b + 1) * kActBlock; ++k) dot += int32_t{xq[i * ldq + k]} * int32_t{w[k]};
      sum += static_cast<float>(dot) * (G ? xd[i * ldd + b] * gs[(b * kActBlock) >> shift] : xd[i * ldd + b]);
    }
    out[i * ldo] = sum;
  }
#endif
}

at::Tensor int8_linear_a8(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "int8_linear_a8: x must be a 2-D float32 tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "int8_linear_a8: weight must be a contiguous 2-D int8 tensor");
  const int64_t m_size = x.size(0), n_size = weight.size(0), k_size = weight.size(1), blocks = k_size / kActBlock;
  TORCH_CHECK(x.size(1) == k_size, "int8_linear_a8: x has ", x.size(1), " columns, weight ", k_size);
  TORCH_CHECK(k_size % kActBlock == 0, "int8_linear_a8: rows of ", k_size, " do not split into blocks of ", kActBlock);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == n_size &&
                  (scales.dim() == 1 || scales.dim() == 2),
              "int8_linear_a8: scales must be float32, one per weight row (1-D) or per group of each row (2-D)");
  const bool grouped = scales.dim() == 2;
  const int64_t ldg = grouped ? scales.size(1) : 0, group = grouped ? k_size / std::max<int64_t>(ldg, 1) : 0;
  TORCH_CHECK(!grouped || (ldg > 0 && k_size % ldg == 0 && group >= kActBlock && group % kActBlock == 0 &&
                          (group & (group - 1)) == 0),
              "int8_linear_a8: ", ldg, " groups do not split a row of ", k_size,
              " into equal power-of-two groups of a multiple of ", kActBlock);
  const at::Tensor xc = x.contiguous();
  at::Tensor xq = at::empty({m_size, k_size}, x.options().dtype(at::kChar));
  at::Tensor xd = at::empty({m_size, blocks}, x.options());
  for (int64_t m = 0; m < m_size; ++m)
    quantize_row(xc.data_ptr<float>() + m * k_size, k_size, xq.data_ptr<int8_t>() + m * k_size,
                 xd.data_ptr<float>() + m * blocks);
  at::Tensor out = at::empty({m_size, n_size}, x.options());
  const int8_t* wp = weight.data_ptr<int8_t>();
  const int8_t* qp = xq.data_ptr<int8_t>();
  const float *dp = xd.data_ptr<float>(), *sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int shift = grouped ? __builtin_ctzll(group) : 0;
  auto run = [&](auto prefetch, auto group_scales) {
    constexpr bool PF = decltype(prefetch)::value, G = decltype(group_scales)::value;
    over_row_blocks(n_size, false, [&](int64_t n0, int64_t n1) {
      // Each weight row is read from memory once, then from L1 for every further tile of x rows.
      for (int64_t n = n0; n < n1; ++n) {
        const int8_t* w = wp + n * k_size;
        const float* g = G ? sp + n * ldg : nullptr;
        over_x_tiles(m_size, [&](auto mr, int64_t m) {
          tile_a8<decltype(mr)::value, PF, G>(qp + m * k_size, dp + m * blocks, k_size, blocks, w, blocks, g, shift,
                                              op + m * n_size + n, n_size);
        });
        if constexpr (!G)
          for (int64_t i = 0; i < m_size; ++i) op[i * n_size + n] *= sp[n];
      }
    });
  };
  const bool prefetch = m_size <= kActPrefetchMaxRows;
  if (grouped)
    prefetch ? run(std::true_type{}, std::true_type{}) : run(std::false_type{}, std::true_type{});
  else
    prefetch ? run(std::true_type{}, std::false_type{}) : run(std::false_type{}, std::false_type{});
  return out;
}

#if PDSERVE_BF16_AVX512
// sum_k x[k] * w[k] over one weight row: 32 bfloat16 pairs per vdpbf16ps, two accumulators to
// overlap their latency, a masked load for the tail.
//
// One row is read start to end before the next, so a thread's weight reads form one sequential
// stream. Interleaving four rows (as the float32 tiles do) kept four streams 1 KiB apart, which the
// hardware prefetchers follow worse: on a Zen 4 EPYC (2 threads, SmolLM2's weights past the
// last-level cache) that read 18-20 GB/s, this reads 28-35, what a plain sum over the same bytes does.
inline float bf16_row(const c10::BFloat16* x, const c10::BFloat16* w, int64_t k_size) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= k_size; k += 64) {
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
    a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(w + k + 32), (__m512bh)_mm512_loadu_si512(x + k + 32));
  }
  for (; k < k_size; k += 32) {
    const int64_t left = std::min<int64_t>(32, k_size - k);
    const __mmask32 mask = static_cast<__mmask32>((uint64_t{1} << left) - 1);
    a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k),
                          (__m512bh)_mm512_maskz_loadu_epi16(mask, x + k));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}
#endif

// One row of x at a time: bfloat16 serves decode steps of one request only (linear_path).
void bf16_linear(const at::Tensor& xc, const at::Tensor& weight, at::Tensor& out, bool serial) {
  const int64_t n_size = weight.size(0), k_size = weight.size(1);
  const c10::BFloat16* wp = weight.data_ptr<c10::BFloat16>();
#if PDSERVE_BF16_AVX512
  for (int64_t m = 0; m < xc.size(0); ++m) {
    const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>() + m * xc.stride(0);
    c10::BFloat16* op = out.data_ptr<c10::BFloat16>() + m * n_size;
    over_row_blocks(n_size, serial, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) op[n] = c10::BFloat16(bf16_row(xp, wp + n * k_size, k_size));  // nearest even
    });
  }
#elif PDSERVE_ONE_ROW
  // No bf16 arithmetic (AVX2): x and each weight are widened to float32 (exactly) and multiplied in
  // row_dot's float32 chains; the sum is rounded to bfloat16 once. Half of float32's bytes to read.
  const at::Tensor xf = xc.to(at::kFloat).contiguous();
  for (int64_t m = 0; m < xf.size(0); ++m) {
    const float* xp = xf.data_ptr<float>() + m * xf.stride(0);
    c10::BFloat16* op = out.data_ptr<c10::BFloat16>() + m * n_size;
    over_row_blocks(n_size, serial, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n)
        op[n] = c10::BFloat16(row_dot(xp, wp + n * k_size, k_size, static_cast<const float*>(nullptr), 1));
    });
  }
#else
  (void)n_size, (void)k_size, (void)wp;
  TORCH_CHECK(false, "float_linear: bfloat16 needs a CPU with AVX512-BF16 or AVX2 (this build has neither)");
#endif
}

at::Tensor float_linear(const at::Tensor& x, const at::Tensor& weight, bool serial) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "float_linear: weight must be float32 or bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype, "float_linear: x must be a 2-D tensor of the weight's dtype");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "float_linear: weight must be a contiguous 2-D tensor");
  TORCH_CHECK(x.size(1) == weight.size(1), "float_linear: x has ", x.size(1), " columns, weight ", weight.size(1));
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor out = at::empty({xc.size(0), weight.size(0)}, x.options());
  if (dtype == at::kBFloat16) {
    bf16_linear(xc, weight, out, serial);
    return out;
  }
  small_linear(xc, weight.data_ptr<float>(), static_cast<const float*>(nullptr), weight.size(0), weight.size(1), out,
               serial);
  return out;
}

bool int8_linear_vectorized() { return PDSERVE_INT8_AVX2; }

bool bf16_linear_available() { return PDSERVE_BF16_AVX512 || PDSERVE_ONE_ROW; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  m.def("int8_linear_a8(Tensor x, Tensor weight, Tensor scales) -> Tensor");
  m.def("float_linear(Tensor x, Tensor weight, bool serial=False) -> Tensor");
  m.def("int8_linear_vectorized() -> bool");
  m.def("bf16_linear_available() -> bool");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_linear_a8", &int8_linear_a8);
  m.impl("float_linear", &float_linear);
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CatchAll, m) {
  m.impl("int8_linear_vectorized", &int8_linear_vectorized);
  m.impl("bf16_linear_available", &bf16_linear_available);
}
