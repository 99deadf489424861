// Decode attention on the CPU, read straight from the paged KV cache.
//
// One query token per request. Each task handles one (request, KV head) pair: the query heads
// that share that KV head (GQA) are processed together, so every key and value row is read
// from memory once. There is no gather into a padded copy and no GQA expansion: this op is
// bound by reading the cache, and reads it once per layer.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_amx.h"
#include "cpu_parallel.h"
#include "cpu_simd.h"
#include "cpu_step_parts.h"

namespace {

using namespace pdserve_simd;

#if defined(PDSERVE_SIMD)
// Ask for the next block's rows of this head while the current block is computed: blocks sit
// anywhere in the cache and a head is a strided part of each row, which the hardware
// prefetcher does not follow, so without this every block starts with a round trip to DRAM.
// Into L2, not L1: asked into L1, 32 lines a block, the requests outran what the core keeps in
// flight and decode batches of 16 and 64 read the cache at 12-13 GB/s on a Zen 4 EPYC; into L2,
// 17-20 GB/s (batch 16: 7.1 -> 4.8 ms of attention per step of 30 layers).
template <typename scalar_t, int D>
inline void prefetch_block(const scalar_t* block, int64_t rows, int64_t c_slot) {
  constexpr int64_t lines = (D * static_cast<int64_t>(sizeof(scalar_t)) + 63) / 64;
  for (int64_t s = 0; s < rows; ++s)
    for (int64_t l = 0; l < lines; ++l)
      _mm_prefetch(reinterpret_cast<const char*>(block + s * c_slot) + 64 * l, _MM_HINT_T1);
}

#if PDSERVE_AMX
// bfloat16 scores on AMX. The vector loop below spends most of its time not on its FMAs but on
// summing each (key row, query head) product across the vector's lanes: three horizontal sums
// per key row for SmolLM2's groups of three, on the one port that also widens bf16. On a 2-core
// Xeon that made a bfloat16 decode batch compute-bound (16 requests of 256 tokens: the cache read
// at 0.6-0.67 of the machine's bandwidth; with it in cache the kernel took as long as float32).
// The tile unit computes 16 key rows against the group's queries in one instruction per 32 dims,
// with no horizontal sums: C[s][g] = sum over d of K[s][d] q[g][d], A = 16 key rows read straight
// from the cache (a row stride apart), B = the queries in AMX's pair-interleaved form. There, 12
// layers of 16 requests x 256 tokens: 2.3 -> 1.3 ms with the cache in L2, 3.2-3.9 -> 2.6-2.8 ms from
// memory (0.59-0.71 -> 0.85-0.87 of the bandwidth a sum reads); whole decode steps 1.04x at 16
// requests, 1.06x at 64 and at 16 of 1024 tokens, level at 1 and 4.
//
// Arithmetic: products of the bf16 key and query are exact in float32 and summed in float32 (in
// the tile unit's order), then scaled; the vector loop scales the query first. They differ only
// in float32 rounding, and a request's scores still never depend on the other requests.
constexpr int kKeyRows = 16;  // key rows per A tile
constexpr int kDims = 32;     // head dims per A tile row (64 bytes of bf16)

// Tile 0: scores of 16 key rows x G heads; tiles 1 and 6: key rows (alternating, so a load need
// not wait for the product that reads the other); tiles 2-5: the queries, 32 dims each.
inline void configure_score_tiles(int group) {
  pdserve_amx::TileConfig cfg{};
  cfg.palette_id = 1;
  for (int t = 0; t < 7; ++t) {
    cfg.rows[t] = kKeyRows;
    cfg.colsb[t] = (t == 1 || t == 6) ? 64 : static_cast<uint16_t>(4 * group);
  }
  pdserve_amx::load_tile_config(cfg);
}

template <int NC>
inline void load_query_tiles(const uint16_t* qb) {
  _tile_loadd(2, qb, 64);
  if constexpr (NC > 1) _tile_loadd(3, qb + kKeyRows * kDims, 64);
  if constexpr (NC > 2) _tile_loadd(4, qb + 2 * kKeyRows * kDims, 64);
  if constexpr (NC > 3) _tile_loadd(5, qb + 3 * kKeyRows * kDims, 64);
}

// Tile 0 = 16 key rows (row r at k + r * stride elements) times the queries, over NC x 32 dims.
template <int NC>
inline void key_rows_times_queries(const uint16_t* k, int64_t stride) {
  const int64_t bytes = stride * 2;
  _tile_zero(0);
  _tile_loadd(1, k, bytes);
  _tile_dpbf16ps(0, 1, 2);
  if constexpr (NC > 1) {
    _tile_loadd(6, k + kDims, bytes);
    _tile_dpbf16ps(0, 6, 3);
  }
  if constexpr (NC > 2) {
    _tile_loadd(1, k + 2 * kDims, bytes);
    _tile_dpbf16ps(0, 1, 4);
  }
  if constexpr (NC > 3) {
    _tile_loadd(6, k + 3 * kDims, bytes);
    _tile_dpbf16ps(0, 6, 5);
  }
}

// Head sizes whose queries fit the four B tiles; the rest take the vector loop.
constexpr bool amx_scores_fit(int D, int G) { return D % kDims == 0 && D / kDims <= 4 && G <= 16; }

// The G queries of one KV head as the B tiles read them: tile c, row r, column g holds the pair
// q_g[32c + 2r], q_g[32c + 2r + 1].
template <int D, int G>
inline void query_tiles(const at::BFloat16* q, int64_t q_head, uint16_t* qb) {
  constexpr int NC = D / kDims;
  const uint16_t* qbits = reinterpret_cast<const uint16_t*>(q);
  std::fill(qb, qb + NC * kKeyRows * kDims, uint16_t{0});
  for (int c = 0; c < NC; ++c)
    for (int r = 0; r < kKeyRows; ++r)
      for (int g = 0; g < G; ++g)
        for (int h = 0; h < 2; ++h)
          qb[(c * kKeyRows + r) * kDims + 2 * g + h] = qbits[g * q_head + kDims * c + 2 * r + h];
}

// scores[g * len + s] = scale * q_g · k_s for the `rows` key rows of one block (row s at k + s * c_slot),
// with the queries' tiles loaded. Whichever loop calls it, a request's scores are the same tile products.
template <int D, int G>
inline void amx_block_scores(const uint16_t* kb, int64_t rows, int64_t block_size, int64_t c_slot, float scale,
                             float* scores, int64_t len) {
  constexpr int NC = D / kDims;
  alignas(64) float c[kKeyRows * 16];
  alignas(64) uint16_t spill[kKeyRows * D];  // rows of a block shorter than a tile, zero-padded
  const __m512i column = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t r0 = 0; r0 < rows; r0 += kKeyRows) {
    const int64_t n = std::min<int64_t>(kKeyRows, rows - r0);
    const uint16_t* a = kb + r0 * c_slot;
    int64_t stride = c_slot;
    // A tile reads 16 rows; past the positions in use it reads the block's other slots (their
    // scores are dropped), but never past the block itself.
    if (r0 + kKeyRows > block_size) {
      std::fill(spill, spill + kKeyRows * D, uint16_t{0});
      for (int64_t r = 0; r < n; ++r) std::copy(a + r * c_slot, a + r * c_slot + D, spill + r * D);
      a = spill;
      stride = D;
    }
    key_rows_times_queries<NC>(a, stride);
    _tile_stored(0, c, 64);
    const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
    for (int g = 0; g < G; ++g) {
      const __m512 sc = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), keep, column, c + g, 4);
      _mm512_mask_storeu_ps(scores + g * len + r0, keep, _mm512_mul_ps(sc, vscale));
    }
  }
}

// scores[g * len + p] = scale * q_g · k_p for every cached position p, as attend_group's loop does.
// Tiles configured by configure_score_tiles(G) on this thread.
template <int D, int G>
void amx_scores(const at::BFloat16* q, int64_t q_head, const at::BFloat16* kc, const int32_t* table, int64_t len,
                int64_t block_size, int64_t c_block, int64_t c_slot, float scale, float* scores) {
  constexpr int NC = D / kDims;
  alignas(64) uint16_t qb[NC * kKeyRows * kDims];
  query_tiles<D, G>(q, q_head, qb);
  load_query_tiles<NC>(qb);
  const uint16_t* kbits = reinterpret_cast<const uint16_t*>(kc);
  int64_t p = 0;
  for (int64_t b = 0; p < len; ++b) {
    const int64_t rows = std::min(block_size, len - p);
    if (p + rows < len)
      prefetch_block<at::BFloat16, D>(kc + table[b + 1] * c_block, std::min(block_size, len - p - rows), c_slot);
    amx_block_scores<D, G>(kbits + table[b] * c_block, rows, block_size, c_slot, scale, scores + p, len);
    p += rows;
  }
}
#endif  // PDSERVE_AMX

// Part i of `parts` near-equal parts of [0, n): [n i / parts, n (i + 1) / parts).
inline std::pair<int64_t, int64_t> part_of(int64_t n, int64_t i, int64_t parts) {
  return {n * i / parts, n * (i + 1) / parts};
}

// Vector registers the loops below may fill with accumulators and operands.
constexpr int kRegisters = Vec::L == 16 ? 32 : 16;

// The weighted sum of values runs over a slice of VC vectors of the head at a time, so that G x VC
// accumulators stay in registers (with AVX2, 3 query heads x 8 vectors of a 64-wide head would
// spill, and every FMA would then load and store its accumulator). The widest slice that fits.
template <int V, int G>
constexpr int value_slice() {
  int vc = V;
  while (vc > 1 && (G * vc > kRegisters * 3 / 4 || V % vc != 0)) vc /= 2;
  return vc;
}

// Whether bfloat16 scores of this head size are products of bfloat16 pairs (vdpbf16ps) summed across
// the lanes of 16 key rows at once, rather than rows widened to float32 and summed one at a time.
template <typename scalar_t, int D>
constexpr bool pair_scores() {
#if defined(__AVX512BF16__)
  return std::is_same_v<scalar_t, at::BFloat16> && D % 32 == 0;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
// Lane i of the result is the sum of the lanes of vector i, for 16 vectors, by a tree of shuffles:
// about 3 shuffles and adds per vector where a horizontal sum of one vector is 8. Widening each
// row to float32 and summing it alone had made a bfloat16 decode batch bound by those sums (three
// per key row for groups of three query heads) rather than by reading the cache. Each row's lanes
// are added in the same order wherever the row sits among the 16, so a score does not depend on
// its position or on the rows beside it.
inline __m512 fold_quarters(__m512 a, __m512 b) {  // [a0+a2, a1+a3, b0+b2, b1+b3] by 128-bit quarters
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
inline __m512 fold_halves(__m512 x, __m512 y) {  // quarter k: the four-lane sum of row k of x, y
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}
inline __m512 fold_pairs(__m512 z, __m512 w) {  // within each quarter: two lanes of z's row, two of w's
  return _mm512_add_ps(_mm512_shuffle_ps(z, w, 0x44), _mm512_shuffle_ps(z, w, 0xEE));
}
inline __m512 fold_lanes(__m512 u, __m512 v) {  // within each quarter: one lane per row
  return _mm512_add_ps(_mm512_shuffle_ps(u, v, 0x88), _mm512_shuffle_ps(u, v, 0xDD));
}

// q · k by pairs of bfloat16 (products exact in float32, summed in float32), lane by lane; zero for
// a row past the block's rows in use, which is not read.
template <int NB>
inline __m512 pair_products(const __m512bh (&q)[NB], const uint16_t* k, bool used) {
  if (!used) return _mm512_setzero_ps();
  __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[0], (__m512bh)_mm512_loadu_si512(k));
#pragma GCC unroll 8
  for (int c = 1; c < NB; ++c) acc = _mm512_dpbf16_ps(acc, q[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
  return acc;
}

// out[i] = scale * q · k_i for the first n (at most 16) key rows, c_slot elements apart.
template <int NB>
inline void pair_scores16(const __m512bh (&q)[NB], const uint16_t* k, int64_t c_slot, int64_t n, __m512 scale,
                          float* out) {
  __m512 rows4[4];
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const uint16_t* kj = k + 4 * j * c_slot;
    const __m512 a =
        fold_quarters(pair_products<NB>(q, kj, 4 * j < n), pair_products<NB>(q, kj + c_slot, 4 * j + 1 < n));
    const __m512 b = fold_quarters(pair_products<NB>(q, kj + 2 * c_slot, 4 * j + 2 < n),
                                   pair_products<NB>(q, kj + 3 * c_slot, 4 * j + 3 < n));
    rows4[j] = fold_halves(a, b);
  }
  // Lane 4k + j holds row 4j + k.
  const __m512 mixed = fold_lanes(fold_pairs(rows4[0], rows4[1]), fold_pairs(rows4[2], rows4[3]));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << n) - 1),
                        _mm512_mul_ps(_mm512_permutexvar_ps(order, mixed), scale));
}
#endif  // __AVX512BF16__

// The G query heads of one KV head as the score loop reads them: on the pair path straight from the
// query (bfloat16, the scale applied to each score), on the vector path widened and scaled into
// `scaled` (G x D floats the caller owns: a request's heads would otherwise cost an allocation each).
template <typename scalar_t, int D, int G>
struct GroupQueries {
  float* scaled;
  void prepare(const scalar_t* q, int64_t q_head, float scale) const {
    if constexpr (!pair_scores<scalar_t, D>()) {
      constexpr int V = D / Vec::L;
      for (int g = 0; g < G; ++g)
        for (int v = 0; v < V; ++v)
          Vec::store(scaled + g * D + Vec::L * v, Vec::mul(Vec::load(q + g * q_head + Vec::L * v), Vec::set1(scale)));
    }
  }
};

// scores[g * len + s] = scale * q_g · k_s for the `rows` key rows of one block of one KV head (row s at
// k + s * c_slot). The same arithmetic whichever loop calls it, so a request's scores never depend on
// how the batch around it was split among threads.
template <typename scalar_t, int D, int G>
inline void score_block(const scalar_t* q, int64_t q_head, const GroupQueries<scalar_t, D, G>& qs, const scalar_t* k,
                        int64_t c_slot, int64_t rows, float scale, float* scores, int64_t len) {
#if defined(__AVX512BF16__)
  if constexpr (pair_scores<scalar_t, D>()) {
    constexpr int NB = D / 32;
    const __m512 vscale = _mm512_set1_ps(scale);
    const uint16_t* kbits = reinterpret_cast<const uint16_t*>(k);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      __m512bh qv[NB];
#pragma GCC unroll 8
      for (int c = 0; c < NB; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + g * q_head + 32 * c);
      for (int64_t r0 = 0; r0 < rows; r0 += 16)
        pair_scores16<NB>(qv, kbits + r0 * c_slot, c_slot, std::min<int64_t>(16, rows - r0), vscale,
                          scores + g * len + r0);
    }
    return;
  }
#endif
  (void)q, (void)q_head, (void)scale;
  constexpr int V = D / Vec::L;
  // Two FMA chains per query head where their accumulators and the key row fit in registers:
  // one chain of V dependent FMAs would wait on the FMA latency at each step.
  constexpr int kChains = 2 * G + V + 1 <= kRegisters && V % 2 == 0 ? 2 : 1;
  // Each chain starts with an FMA onto zero, not a multiply: GCC contracts a multiply followed by an add
  // into one FMA (it does so under -std=c++20 too) where it sees fit, and it saw fit in one caller and
  // not in the other, so a float32 head of 32 (two vectors: product, product, sum) scored differently
  // in attend_heads than in attend_group. Intrinsic FMAs are never re-contracted.
  for (int64_t s = 0; s < rows; ++s) {
    Vec::T kv[V];
#pragma GCC unroll 64
    for (int v = 0; v < V; ++v) kv[v] = Vec::load(k + s * c_slot + Vec::L * v);
    Vec::T sum[G][kChains];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 2
      for (int c = 0; c < kChains; ++c)  // not a mul: see above
        sum[g][c] = Vec::fmadd(Vec::load(qs.scaled + g * D + Vec::L * c), kv[c], Vec::zero());
#pragma GCC unroll 64
    for (int v = kChains; v < V; v += kChains)
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g)
#pragma GCC unroll 2
        for (int c = 0; c < kChains; ++c)
          sum[g][c] = Vec::fmadd(Vec::load(qs.scaled + g * D + Vec::L * (v + c)), kv[v + c], sum[g][c]);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
      scores[g * len + s] = Vec::reduce_add(kChains == 2 ? Vec::add(sum[g][0], sum[g][kChains - 1]) : sum[g][0]);
  }
}

// Softmax of one row of scores in place, a vector at a time; the ragged tail in scalars.
inline void softmax_row(float* s, int64_t len) {
  Vec::T mx = Vec::set1(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + Vec::L <= len; i += Vec::L) mx = Vec::max(mx, Vec::load(s + i));
  float m = Vec::reduce_max(mx);
  for (; i < len; ++i) m = std::max(m, s[i]);
  Vec::T total = Vec::zero();
  const Vec::T mv = Vec::set1(m);
  for (i = 0; i + Vec::L <= len; i += Vec::L) {
    const Vec::T e = vexp(Vec::sub(Vec::load(s + i), mv));
    Vec::store(s + i, e);
    total = Vec::add(total, e);
  }
  float sum = Vec::reduce_add(total);
  for (; i < len; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  const float inv = 1.f / sum;
  for (i = 0; i < len; ++i) s[i] *= inv;
}

// out[g] += weights[g * len + s] * v_s over the `rows` value rows of one block (row s at v + s * c_slot),
// for a slice of VC vectors of the head.
template <typename scalar_t, int G, int VC>
inline void weigh_values(Vec::T (&out)[G][VC], const scalar_t* v, int64_t c_slot, int64_t rows, const float* weights,
                         int64_t len) {
  for (int64_t s = 0; s < rows; ++s) {
    Vec::T val[VC];
#pragma GCC unroll 64
    for (int c = 0; c < VC; ++c) val[c] = Vec::load(v + s * c_slot + Vec::L * c);
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      const Vec::T w = Vec::set1(weights[g * len + s]);
#pragma GCC unroll 64
      for (int c = 0; c < VC; ++c) out[g][c] = Vec::fmadd(w, val[c], out[g][c]);
    }
  }
}

// One (request, KV head): its G query heads against `len` cached positions. The head size D and
// the group size G are fixed at compile time, so the loops over them unroll and their
// accumulators live in registers (with G a run-time count, every accumulator went through
// memory: the kernel ran 1.45x slower on a cache in L2, on a Zen 3).
template <typename scalar_t, int D, int G>
void attend_group(const scalar_t* q, int64_t q_head, const scalar_t* kc, const scalar_t* vc, const int32_t* table,
                  int64_t len, int64_t block_size, int64_t c_block, int64_t c_slot, float scale, float* scores,
                  float* acc, scalar_t* o, int64_t o_head, bool amx) {
  constexpr int V = D / Vec::L;
  static_assert(V * Vec::L == D, "head size must be whole vectors");
  int64_t p = 0;
#if PDSERVE_AMX
  if constexpr (std::is_same_v<scalar_t, at::BFloat16> && amx_scores_fit(D, G)) {
    if (amx) {
      amx_scores<D, G>(q, q_head, kc, table, len, block_size, c_block, c_slot, scale, scores);
      p = len;
    }
  }
#endif
  alignas(64) float scaled[G * D];
  const GroupQueries<scalar_t, D, G> qs{scaled};
  if (p < len) qs.prepare(q, q_head, scale);
  // Scores, block by block: no division per position. The next block's rows are fetched in `pieces`
  // parts, each before the matching part of this block is read: on the vector path one row at a time.
  // Asked for all at once, the burst stalled the loop: with the cache in memory (a 96 MB read between
  // calls), float32 heads of 64 read it 1.12-1.15x faster spread so on a Zen 5 EPYC (16 and 64 requests
  // of 300 tokens), and whole float32 decode steps ran 1.04x at 16 requests, 1.05x at 64. The bfloat16
  // pair path scores 16 rows at a time and keeps the whole-block fetch: spread, it and the values ran
  // 0.92-0.98x at one and two requests.
  constexpr int64_t pieces = pair_scores<scalar_t, D>() ? 1 : 16;
  for (int64_t b = 0; p < len; ++b) {
    const int64_t rows = std::min(block_size, len - p);
    const int64_t next_rows = p + rows < len ? std::min(block_size, len - p - rows) : 0;
    const scalar_t* kb = kc + table[b] * c_block;
    for (int64_t i = 0; i < pieces; ++i) {
      const auto [s0, s1] = part_of(rows, i, pieces);
      const auto [f0, f1] = part_of(next_rows, i, pieces);
      if (f1 > f0) prefetch_block<scalar_t, D>(kc + table[b + 1] * c_block + f0 * c_slot, f1 - f0, c_slot);
      if (s1 > s0)
        score_block<scalar_t, D, G>(q, q_head, qs, kb + s0 * c_slot, c_slot, s1 - s0, scale, scores + p + s0, len);
    }
    p += rows;
  }
  for (int g = 0; g < G; ++g) softmax_row(scores + g * len, len);

  // Weighted sum of values, a slice of the head at a time with its accumulators in registers. The
  // first slice's pass fetches the blocks ahead; the later ones find them in L2.
  constexpr int VC = value_slice<V, G>();
  for (int v0 = 0; v0 < V; v0 += VC) {
    if (v0 == 0) prefetch_block<scalar_t, D>(vc + table[0] * c_block, std::min(block_size, len), c_slot);
    Vec::T out[G][VC];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 64
      for (int v = 0; v < VC; ++v) out[g][v] = Vec::zero();
    p = 0;
    for (int64_t b = 0; p < len; ++b) {
      const int64_t rows = std::min(block_size, len - p);
      const int64_t next_rows = v0 == 0 && p + rows < len ? std::min(block_size, len - p - rows) : 0;
      const scalar_t* vb = vc + table[b] * c_block + Vec::L * v0;
      for (int64_t i = 0; i < pieces; ++i) {  // rows in order: the sums are those of one pass
        const auto [s0, s1] = part_of(rows, i, pieces);
        const auto [f0, f1] = part_of(next_rows, i, pieces);
        if (f1 > f0) prefetch_block<scalar_t, D>(vc + table[b + 1] * c_block + f0 * c_slot, f1 - f0, c_slot);
        if (s1 > s0) weigh_values<scalar_t, G, VC>(out, vb + s0 * c_slot, c_slot, s1 - s0, scores + p + s0, len);
      }
      p += rows;
    }
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 64
      for (int v = 0; v < VC; ++v) Vec::store(acc + g * D + Vec::L * (v0 + v), out[g][v]);
  }
  for (int g = 0; g < G; ++g) store_row(acc + g * D, o + g * o_head, D);
}

// fn(std::integral_constant<int, G>{}) for the run-time group size G; false for groups past 8 (the
// portable loop takes them), for which the vector loops are not compiled.
template <typename Fn>
bool with_group(int64_t group, Fn&& fn) {
  switch (group) {
#define PDSERVE_GROUP(G)                  \
  case G:                                 \
    fn(std::integral_constant<int, G>{}); \
    return true;
    PDSERVE_GROUP(1) PDSERVE_GROUP(2) PDSERVE_GROUP(3) PDSERVE_GROUP(4) PDSERVE_GROUP(5) PDSERVE_GROUP(6)
    PDSERVE_GROUP(7) PDSERVE_GROUP(8)
#undef PDSERVE_GROUP
    default:
      return false;
  }
}

// attend_group for the run-time group size.
template <typename scalar_t, int D>
bool attend_group_of(int64_t group, const scalar_t* q, int64_t q_head, const scalar_t* kc, const scalar_t* vc,
                     const int32_t* table, int64_t len, int64_t block_size, int64_t c_block, int64_t c_slot,
                     float scale, float* scores, float* acc, scalar_t* o, int64_t o_head, bool amx) {
  return with_group(group, [&](auto g) {
    attend_group<scalar_t, D, decltype(g)::value>(q, q_head, kc, vc, table, len, block_size, c_block, c_slot, scale,
                                                  scores, acc, o, o_head, amx);
  });
}

// Request r's KV heads [h0, h1) among the (request, KV head) units [first, last), numbered r * kv_heads + h.
inline std::pair<int64_t, int64_t> heads_in(int64_t r, int64_t first, int64_t last, int64_t kv_heads) {
  return {std::max(first - r * kv_heads, int64_t{0}), std::min(last - r * kv_heads, kv_heads)};
}

// The cache lines one thread will read, in the order it reads them (per request, its key blocks, then
// its value blocks; of each slot, the bytes of the thread's KV heads), fetched a slot row at a time a
// fixed distance ahead of the reads (ahead_bytes, into the level fetch_into_l2 picks). Without it each
// block starts with a round trip to DRAM (blocks sit anywhere in the cache). Fetched a whole block at
// once, the requests outran what the core keeps in flight and stalled the loop behind them: on a Zen 5
// EPYC a bfloat16 decode batch ran 0.84-0.90x the speed of the per-head loop this replaces, and
// 1.36-1.53x with the fetch spread.
template <typename scalar_t>
struct AheadLines {
  const scalar_t* kc;
  const scalar_t* vc;
  const int32_t* tables;
  const int32_t* lens;
  int64_t max_blocks, block_size, c_block, c_slot, c_head, head_dim, kv_heads;
  int64_t unit, end;  // the (request, KV head) units left to fetch, numbered r * kv_heads + h: [unit, end)
  bool into_l2 = fetch_into_l2();
  int64_t item = 0, row = 0, rows = 0, lines = 0;  // of the block being fetched
  const char* at = nullptr;  // the first line of the block's rows to fetch, or null between blocks

  // The lines of a slot row that hold KV heads [h0, h1): [first, last) from the row's start.
  std::pair<int64_t, int64_t> span(int64_t h0, int64_t h1) const {
    const int64_t elem = static_cast<int64_t>(sizeof(scalar_t));
    return {elem * h0 * c_head / 64, (elem * ((h1 - 1) * c_head + head_dim) + 63) / 64};
  }

  // At least `count` more lines, a slot row at a time.
  void fetch(int64_t count) {
    const int64_t elem = static_cast<int64_t>(sizeof(scalar_t));
    while (count > 0 && unit < end) {
      if (at == nullptr) {
        const int64_t r = unit / kv_heads;
        const int64_t len = lens[r];
        const int64_t blocks = (len + block_size - 1) / block_size;
        if (item >= 2 * blocks) {
          unit = (r + 1) * kv_heads;
          item = 0;
          continue;
        }
        const auto [h0, h1] = heads_in(r, unit, end, kv_heads);
        const auto [from, to] = span(h0, h1);
        const int64_t b = item < blocks ? item : item - blocks;
        at = reinterpret_cast<const char*>((item < blocks ? kc : vc) +
                                           static_cast<int64_t>(tables[r * max_blocks + b]) * c_block) + 64 * from;
        lines = to - from;
        rows = std::min(block_size, len - b * block_size);
        row = 0;
      }
      const char* slot = at + elem * row * c_slot;
      for (int64_t l = 0; l < lines; ++l) fetch_line(slot + 64 * l, into_l2);
      count -= lines;
      if (++row == rows) {
        at = nullptr;
        ++item;
      }
    }
  }
};

// Head h's share (of heads [h0, h1)) of a block's n lines to fetch: spread over the heads, so that no
// burst of requests stalls the loop.
inline int64_t share_of(int64_t n, int64_t h, int64_t h0, int64_t h1) {
  const auto [from, to] = part_of(n, h - h0, h1 - h0);
  return to - from;
}

// How far ahead of its reads a thread keeps fetching, into the level pdserve_simd::fetch_into_l2 picks.
// On AMD into L1, 8 KiB ahead: with the cache truly in memory (a 96 MB read between calls, as a decode
// step's weights stream between one layer's calls from step to step), on a Zen 5 EPYC the lines
// fetched into L1 8 KiB ahead read the cache 1.24x faster than into L2 16 KiB ahead at 16 requests of
// 300 tokens, 1.29-1.5x at 8-64 requests of 64-1000 (4-16 KiB level, 32 KiB less; a second stream
// into L2 64-128 KiB ahead on top, 0.93-0.96x; none at all, 0.82x). Whole bfloat16 decode steps of the
// bench model, alternated in one process: 16 requests 1.08x, 64 1.13x, 4 1.03x. Measured with the
// cache left in L3 between calls, every distance and either level had looked alike. On Intel into L2,
// 16 KiB ahead: on a 2-core AMX Xeon (blocks shuffled through the cache, whole bfloat16 decode steps
// alternated in one process) 1.04x faster than into L1 8 KiB ahead at 16 requests, with AMX scores
// and with pair scores alike, 1.05x at 64 (4, 8 or 32 KiB about the same; into L3 level with L2).
inline int64_t ahead_bytes() { return fetch_into_l2() ? 16 * 1024 : 8 * 1024; }

// One request's KV heads [h0, h1), block by block: each block of the cache is read in order, every head
// of a slot together (a head is 128 bytes of a 512-byte slot in bfloat16 with four KV heads of 64; read
// a head at a time, the cache read at 33-36 GB/s on a Zen 5 EPYC where whole slots read at 45). Per
// head the arithmetic is fixed: the scores of score_block, each value accumulator carried through
// memory unchanged from block to block, so a request's output does not depend on which other
// requests or heads share its thread.
template <typename scalar_t, int D, int G>
void attend_heads(const scalar_t* q, int64_t q_head, const scalar_t* kc, const scalar_t* vc, const int32_t* table,
                  int64_t len, int64_t h0, int64_t h1, int64_t block_size, int64_t c_block, int64_t c_slot,
                  int64_t c_head, float scale, float* queries, float* scores, float* acc, scalar_t* o,
                  int64_t o_head, AheadLines<scalar_t>& ahead, bool amx) {
  constexpr int V = D / Vec::L;
  constexpr int VC = value_slice<V, G>();
#if PDSERVE_AMX
  constexpr bool amx_fits = std::is_same_v<scalar_t, at::BFloat16> && amx_scores_fit(D, G);
  constexpr int64_t qtile = amx_fits ? D / kDims * kKeyRows * kDims : 1;  // one head's B tiles, in uint16
  thread_local std::vector<uint16_t> qtiles;
  if constexpr (amx_fits) {
    if (amx) {
      if (qtiles.size() < static_cast<size_t>(h1 * qtile)) qtiles.resize(h1 * qtile);
      for (int64_t h = h0; h < h1 && len > 0; ++h)
        query_tiles<D, G>(q + h * G * q_head, q_head, qtiles.data() + h * qtile);
    }
  }
#else
  (void)amx;
#endif
  // Of head h: queries q + h G q_head (scaled: queries + h G D), scores at scores + h G len,
  // accumulators at acc + h G D.
  if (len == 0) std::fill(acc + h0 * G * D, acc + h1 * G * D, 0.f);
  for (int64_t h = h0; h < h1 && len > 0; ++h)
    GroupQueries<scalar_t, D, G>{queries + h * G * D}.prepare(q + h * G * q_head, q_head, scale);
  const auto [from, to] = ahead.span(h0, h1);
  const int64_t block_lines = block_size * (to - from);  // the stream moves on by a block of this request's
  int64_t p = 0;
  for (int64_t b = 0; p < len; ++b) {
    const int64_t rows = std::min(block_size, len - p);
    const scalar_t* kb = kc + table[b] * c_block;
    for (int64_t h = h0; h < h1; ++h) {
      ahead.fetch(share_of(block_lines, h, h0, h1));
#if PDSERVE_AMX
      if constexpr (amx_fits) {
        if (amx) {
          load_query_tiles<D / kDims>(qtiles.data() + h * qtile);
          amx_block_scores<D, G>(reinterpret_cast<const uint16_t*>(kb + h * c_head), rows, block_size, c_slot, scale,
                                 scores + h * G * len + p, len);
          continue;
        }
      }
#endif
      score_block<scalar_t, D, G>(q + h * G * q_head, q_head, {queries + h * G * D}, kb + h * c_head, c_slot, rows,
                                  scale, scores + h * G * len + p, len);
    }
    p += rows;
  }
  for (int64_t i = h0 * G; i < h1 * G; ++i) softmax_row(scores + i * len, len);
  p = 0;
  for (int64_t b = 0; p < len; ++b) {
    const int64_t rows = std::min(block_size, len - p);
    const scalar_t* vb = vc + table[b] * c_block;
    for (int64_t h = h0; h < h1; ++h) {
      ahead.fetch(share_of(block_lines, h, h0, h1));
      float* a = acc + h * G * D;
      for (int v0 = 0; v0 < V; v0 += VC) {
        Vec::T out[G][VC];
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g)
#pragma GCC unroll 64
          for (int v = 0; v < VC; ++v) out[g][v] = b == 0 ? Vec::zero() : Vec::load(a + g * D + Vec::L * (v0 + v));
        weigh_values<scalar_t, G, VC>(out, vb + h * c_head + Vec::L * v0, c_slot, rows, scores + h * G * len + p, len);
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g)
#pragma GCC unroll 64
          for (int v = 0; v < VC; ++v) Vec::store(a + g * D + Vec::L * (v0 + v), out[g][v]);
      }
    }
    p += rows;
  }
  for (int64_t i = h0 * G; i < h1 * G; ++i) store_row(acc + i * D, o + i * o_head, D);
}

// attend_heads for the run-time group size.
template <typename scalar_t, int D>
bool attend_heads_of(int64_t group, const scalar_t* q, int64_t q_head, const scalar_t* kc, const scalar_t* vc,
                     const int32_t* table, int64_t len, int64_t h0, int64_t h1, int64_t block_size, int64_t c_block,
                     int64_t c_slot, int64_t c_head, float scale, float* queries, float* scores, float* acc,
                     scalar_t* o, int64_t o_head, AheadLines<scalar_t>& ahead, bool amx) {
  return with_group(group, [&](auto g) {
    attend_heads<scalar_t, D, decltype(g)::value>(q, q_head, kc, vc, table, len, h0, h1, block_size, c_block, c_slot,
                                                  c_head, scale, queries, scores, acc, o, o_head, ahead, amx);
  });
}
#endif  // PDSERVE_SIMD

// Whether bfloat16 scores of this head size and query-head group run on AMX: where this build and
// the CPU have it, the queries fit its tiles and the group has a vector loop to finish the rest.
bool amx_scores_take(int64_t head_dim, int64_t group) {
#if PDSERVE_AMX && defined(PDSERVE_SIMD)
  return group >= 1 && group <= 8 && head_dim % Vec::L == 0 &&
         amx_scores_fit(static_cast<int>(head_dim), static_cast<int>(group)) && pdserve_amx::permitted();
#else
  return false;
#endif
}

// The (request, KV head) units [first, last), numbered r * kv_heads + h, of thread t of n: those whose
// first cached position, counted over all units, falls in the t-th n-th of the batch's, so the threads
// read about as much of the cache as each other whatever the requests' lengths.
std::pair<int64_t, int64_t> units_of_thread(const int32_t* lens, int64_t num_reqs, int64_t kv_heads, int64_t t,
                                            int64_t n) {
  int64_t total = 0;
  for (int64_t r = 0; r < num_reqs; ++r) total += lens[r];
  const int64_t units = num_reqs * kv_heads;
  const int64_t lo = total * kv_heads * t / n, hi = total * kv_heads * (t + 1) / n;
  int64_t first = units, last = units, start = 0;
  for (int64_t u = 0; u < units; ++u) {
    if (first == units && start >= lo) first = u;
    if (t + 1 < n && start >= hi) {
      last = u;
      break;
    }
    start += lens[u / kv_heads];
  }
  return {std::min(first, last), last};
}

// Whether a batch runs through attend_heads (the threads split it by KV heads of requests, each block
// read in order) rather than attend_group (a task per (request, KV head)): where a head is at most two
// cache lines of a slot (bfloat16 heads of 64: read a head at a time, 33-36 GB/s on a Zen 5 EPYC
// where whole slots read at 45; float32 heads of 64 ran 0.94-1.16x split so there, 1.02-1.03x on a
// 2-core AMX Xeon, not taken), with requests enough for every thread. With AMX scores too: on that
// Xeon, read a head at a time (2 of a slot's 8 lines) the blocks of a request shuffled through the
// cache read at 16-17 GB/s and whole slots at 19-21 (read alone, no arithmetic; a plain sum 25-31);
// whole bfloat16 decode steps of the bench model, the two loops alternated in one process: in one hour
// 1.09-1.13x at 16 requests of 256 tokens, 1.15-1.19x at 64, 1.22x at 16 of 1024, level at 4; in a
// later one level at 16 and 1.04x at 64 (the per-head loop's own time moved with the hour, the
// whole-slot loop's much less). Both loops give a head the same arithmetic (the same score tiles, the
// same value sums), so a request's output does not depend on which one ran.
bool heads_loop_takes(int64_t num_reqs, int64_t threads, int64_t group, int64_t head_dim, int64_t elem_bytes) {
  const bool compiled = head_dim == 16 || head_dim == 32 || head_dim == 64;
  return group >= 1 && group <= 8 && compiled && head_dim * elem_bytes <= 128 && num_reqs >= 2 * threads;
}

template <typename scalar_t>
void decode_attention_kernel(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                             at::Tensor& out) {
  const int64_t num_reqs = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);

  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* kc = key_cache.data_ptr<scalar_t>();
  const scalar_t* vc = value_cache.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t q_req = query.stride(0), q_head = query.stride(1);
  const int64_t o_req = out.stride(0), o_head = out.stride(1);
  const int64_t c_block = key_cache.stride(0), c_slot = key_cache.stride(1), c_head = key_cache.stride(2);
  const int64_t max_len = *std::max_element(lens, lens + num_reqs);
  const float fscale = static_cast<float>(scale);

  const bool amx = std::is_same_v<scalar_t, at::BFloat16> && amx_scores_take(head_dim, group);
#if defined(PDSERVE_SIMD)
  const int64_t threads = pdserve_parallel::threads();
  if (head_dim % Vec::L == 0 && heads_loop_takes(num_reqs, threads, group, head_dim, sizeof(scalar_t))) {
    pdserve_parallel::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
#if PDSERVE_AMX
      if (amx) configure_score_tiles(static_cast<int>(group));
#endif
      // Every head of a request at once: its scores are heads x len floats, 16 MB for 32 heads of a
      // 128K-token request. Kept from call to call on each (pool) thread and grown, never cleared (each
      // score is written before it is read), rather than allocated and zeroed per layer.
      thread_local std::vector<float> scores, acc, queries;
      const size_t heads = static_cast<size_t>(num_kv_heads * group);
      if (scores.size() < heads * std::max<int64_t>(max_len, 1)) scores.resize(heads * std::max<int64_t>(max_len, 1));
      if (acc.size() < heads * head_dim) acc.resize(heads * head_dim);
      if (queries.size() < heads * head_dim) queries.resize(heads * head_dim);
      for (int64_t t = t0; t < t1; ++t) {
        const auto [first, last] = units_of_thread(lens, num_reqs, num_kv_heads, t, threads);
        AheadLines<scalar_t> ahead{kc, vc, tables, lens, max_blocks, block_size, c_block, c_slot, c_head, head_dim,
                                   num_kv_heads, first, last};
        ahead.fetch(ahead_bytes() / 64);
        for (int64_t r = first / num_kv_heads; r * num_kv_heads < last; ++r) {
          const auto [h0, h1] = heads_in(r, first, last, num_kv_heads);
          bool done = false;
          switch (head_dim) {
#define PDSERVE_ATTEND(D)                                                                                         \
  case D:                                                                                                         \
    done = attend_heads_of<scalar_t, D>(group, q + r * q_req, q_head, kc, vc, tables + r * max_blocks, lens[r],   \
                                        h0, h1, block_size, c_block, c_slot, c_head, fscale, queries.data(),      \
                                        scores.data(), acc.data(), o + r * o_req, o_head, ahead, amx);            \
    break;
            PDSERVE_ATTEND(16) PDSERVE_ATTEND(32) PDSERVE_ATTEND(64)
#undef PDSERVE_ATTEND
            default:
              break;
          }
          TORCH_CHECK(done, "decode_attention: no vector loop for head size ", head_dim, " and group ", group);
        }
      }
#if PDSERVE_AMX
      if (amx) _tile_release();
#endif
    });
    return;
  }
#endif
  pdserve_parallel::parallel_for(0, num_reqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
#if PDSERVE_AMX
    if (amx) configure_score_tiles(static_cast<int>(group));
#endif
    std::vector<float> qf(group * head_dim), acc(group * head_dim), row(head_dim);
    std::vector<float> scores(group * std::max<int64_t>(max_len, 1));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t len = lens[r];
      const int32_t* table = tables + r * max_blocks;
      const scalar_t* q_rows = q + r * q_req + h * group * q_head;
      scalar_t* o_rows = o + r * o_req + h * group * o_head;
#if defined(PDSERVE_SIMD)
      if (group <= 8 && head_dim % Vec::L == 0) {
        const scalar_t* k_head = kc + h * c_head;
        const scalar_t* v_head = vc + h * c_head;
        switch (head_dim) {
#define PDSERVE_ATTEND(D)                                                                                      \
  case D:                                                                                                      \
    if (attend_group_of<scalar_t, D>(group, q_rows, q_head, k_head, v_head, table, len, block_size, c_block,   \
                                     c_slot, fscale, scores.data(), acc.data(), o_rows, o_head, amx))          \
      continue;                                                                                                \
    break;
          PDSERVE_ATTEND(16) PDSERVE_ATTEND(32) PDSERVE_ATTEND(64) PDSERVE_ATTEND(96) PDSERVE_ATTEND(128) PDSERVE_ATTEND(256)
#undef PDSERVE_ATTEND
          default:
            break;
        }
      }
#endif
      // Portable path: any head size, any group, any CPU.
      for (int64_t g = 0; g < group; ++g) {
        load_row(q_rows + g * q_head, qf.data() + g * head_dim, head_dim);
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] *= fscale;
      }
      for (int64_t p = 0; p < len; ++p) {
        const scalar_t* k = kc + table[p / block_size] * c_block + (p % block_size) * c_slot + h * c_head;
        load_row(k, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) scores[g * len + p] = dot(qf.data() + g * head_dim, row.data(), head_dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < len; ++p) m = std::max(m, s[p]);
        float sum = 0.f;
        for (int64_t p = 0; p < len; ++p) {
          s[p] = std::exp(s[p] - m);
          sum += s[p];
        }
        const float inv = 1.f / sum;
        for (int64_t p = 0; p < len; ++p) s[p] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p = 0; p < len; ++p) {
        const scalar_t* v = vc + table[p / block_size] * c_block + (p % block_size) * c_slot + h * c_head;
        load_row(v, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) axpy(scores[g * len + p], row.data(), acc.data() + g * head_dim, head_dim);
      }
      for (int64_t g = 0; g < group; ++g) store_row(acc.data() + g * head_dim, o_rows + g * o_head, head_dim);
    }
#if PDSERVE_AMX
    if (amx) _tile_release();
#endif
  });
}

void decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4, "bad ranks");
  TORCH_CHECK(query.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1 && out.stride(2) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(key_cache.strides() == value_cache.strides(), "key and value caches must share a layout");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt, "int32 tables");
  TORCH_CHECK(block_tables.is_contiguous() && seq_lens.is_contiguous(), "contiguous tables");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(query.size(0) == seq_lens.size(0) && query.size(0) == block_tables.size(0), "one query per request");
  if (query.size(0) == 0) return;
  switch (query.scalar_type()) {
    case at::kFloat:
      return decode_attention_kernel<float>(query, key_cache, value_cache, block_tables, seq_lens, scale, out);
    case at::kBFloat16:
      return decode_attention_kernel<at::BFloat16>(query, key_cache, value_cache, block_tables, seq_lens, scale, out);
    case at::kHalf:
      return decode_attention_kernel<at::Half>(query, key_cache, value_cache, block_tables, seq_lens, scale, out);
    default:
      TORCH_CHECK(false, "decode_attention supports float32, bfloat16 and float16, not ", query.scalar_type());
  }
}

}  // namespace

template <typename T>
void pdserve_parts::decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                     const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                     at::Tensor& out) {
  decode_attention_kernel<T>(query, key_cache, value_cache, block_tables, seq_lens, scale, out);
}

template void pdserve_parts::decode_attention<float>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                     const at::Tensor&, const at::Tensor&, double, at::Tensor&);
template void pdserve_parts::decode_attention<at::BFloat16>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                            const at::Tensor&, const at::Tensor&, double, at::Tensor&);

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def("decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
  m.def("decode_attention_amx_scores(int head_dim, int group) -> bool");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CatchAll, m) { m.impl("decode_attention_amx_scores", &amx_scores_take); }

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
