// Causal attention of one request's prompt chunk on the CPU (flash attention: scores a block of
// keys at a time, softmax kept running per row, never the whole score matrix).
//
// q [L, heads, D] holds the chunk's queries at positions S-L .. S-1; k and v [S, kv_heads, D] all
// keys up to the chunk's end (earlier context first). Each task takes one KV head and a block of
// kBlockQ queries, with every query head that shares the KV head (GQA), so one task's rows are
// kBlockQ x group. Per block of keys:
// - the keys are widened to float32 and turned d-major in a small panel (a vector holds one d of
//   L consecutive keys), and each row's scores come out of broadcast-FMAs, as in a GEMM;
// - the running softmax rescales the row and exponentiates the block's scores;
// - the values (widened to float32) are summed into the row's output with broadcast-FMAs.
// All arithmetic is float32, for every input dtype. ATen's flash kernel reached about 70 GFLOP/s
// on a Zen 4 EPYC (2 threads) at SmolLM2's shapes; its blocks are smaller and its exp scalar-ish.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_simd.h"

namespace {

using namespace pdserve_simd;

#if defined(PDSERVE_SIMD)
constexpr int kAcc = Vec::L == 16 ? 24 : 12;  // accumulators a tile keeps in registers
constexpr int kKeyVecs = 4;                   // a block of keys: 4 vectors' worth (64 or 32)
constexpr int64_t kBlockK = kKeyVecs * Vec::L;
// A scores tile covers kTileKeyVecs of the block's key vectors: all 4 with AVX-512 (24 accumulators), 2 with
// AVX2, whose 16 registers hold 6 x 2 accumulators, the 2 key vectors and a broadcast. The AVX2 tile was
// 3 rows x 4 key vectors, which leaves no register for the keys: GCC loaded each key vector once per row,
// 15 loads per 12 FMAs. With the 6 x 2 tiles here (and values in 6 x 2 tiles too) the kernel ran 1.39x
// faster at 256 tokens and 1.43x at 512 on a Zen 3 (SmolLM2's heads, 2 threads, 30 alternated pairs,
// outputs bit-identical: each score and output is still one FMA chain in the same order).
constexpr int kTileKeyVecs = Vec::L == 16 ? kKeyVecs : 2;
constexpr int kScoreRows = kAcc / kTileKeyVecs;  // rows per scores tile: 6
constexpr int64_t kBlockQ = 64;  // queries per task: fewer panel builds per row, still many tasks

// s[r][0..kBlockK) = sum_d q[r][d] * kt[d][0..kBlockK) for RT rows, kTileKeyVecs key vectors at a time.
template <int RT>
void scores_tile(const float* q, int64_t ldq, const float* kt, int64_t d_size, float* s) {
  for (int j0 = 0; j0 < kKeyVecs; j0 += kTileKeyVecs) {
    Vec::T acc[RT][kTileKeyVecs];
    for (int r = 0; r < RT; ++r)
      for (int j = 0; j < kTileKeyVecs; ++j) acc[r][j] = Vec::zero();
    for (int64_t d = 0; d < d_size; ++d) {
      Vec::T kv[kTileKeyVecs];
      for (int j = 0; j < kTileKeyVecs; ++j) kv[j] = Vec::load(kt + d * kBlockK + (j0 + j) * Vec::L);
      keep_in_registers(kv);
      for (int r = 0; r < RT; ++r) {
        const Vec::T b = Vec::set1(q[r * ldq + d]);
        for (int j = 0; j < kTileKeyVecs; ++j) acc[r][j] = Vec::fmadd(b, kv[j], acc[r][j]);
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int j = 0; j < kTileKeyVecs; ++j) Vec::store(s + r * kBlockK + (j0 + j) * Vec::L, acc[r][j]);
  }
}

// o[r][0..NC*L) = o[r] * alpha[r] + sum_j p[r][j] * v[j][0..NC*L) for RT rows and `keys` keys.
template <int RT, int NC>
void values_tile(const float* p, int64_t keys, const float* v, int64_t ldv, const float* alpha, float* o,
                 int64_t ldo) {
  Vec::T acc[RT][NC];
  for (int r = 0; r < RT; ++r) {
    const Vec::T a = Vec::set1(alpha[r]);
    for (int c = 0; c < NC; ++c) acc[r][c] = Vec::mul(Vec::load(o + r * ldo + c * Vec::L), a);
  }
  for (int64_t j = 0; j < keys; ++j) {
    Vec::T vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = Vec::load(v + j * ldv + c * Vec::L);
    keep_in_registers(vv);
    for (int r = 0; r < RT; ++r) {
      const Vec::T b = Vec::set1(p[r * kBlockK + j]);
      for (int c = 0; c < NC; ++c) acc[r][c] = Vec::fmadd(b, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < NC; ++c) Vec::store(o + r * ldo + c * Vec::L, acc[r][c]);
}

// The tiles for a row count chosen at run time (a block's last rows).
template <int RT = kScoreRows>
void scores_rows(int rows, const float* q, int64_t ldq, const float* kt, int64_t d_size, float* s) {
  if constexpr (RT > 0) {
    if (rows == RT) return scores_tile<RT>(q, ldq, kt, d_size, s);
    scores_rows<RT - 1>(rows, q, ldq, kt, d_size, s);
  }
}

template <int NC, int RT = kAcc / NC>
void values_rows(int rows, const float* p, int64_t keys, const float* v, int64_t ldv, const float* alpha, float* o,
                 int64_t ldo) {
  if constexpr (RT > 0) {
    if (rows == RT) return values_tile<RT, NC>(p, keys, v, ldv, alpha, o, ldo);
    values_rows<NC, RT - 1>(rows, p, keys, v, ldv, alpha, o, ldo);
  }
}

// All rows' outputs, NC vectors of d at a time.
template <int NC>
void values_all(int64_t n_rows, const float* p, int64_t keys, const float* v, int64_t ldv, const float* alpha,
                float* o, int64_t d_size) {
  constexpr int RT = kAcc / NC;
  for (int64_t c0 = 0; c0 < d_size; c0 += NC * Vec::L)
    for (int64_t r = 0; r < n_rows; r += RT) {
      const int rows = static_cast<int>(std::min<int64_t>(RT, n_rows - r));
      values_rows<NC>(rows, p + r * kBlockK, keys, v + c0, ldv, alpha + r, o + r * d_size + c0, d_size);
    }
}

template <typename scalar_t>
struct Task {
  const scalar_t *q, *k, *v;
  scalar_t* out;
  int64_t q_row, k_row, v_row, o_row;  // strides of a position
  int64_t length, seq_len, group, d_size;
  float scale;

  // Queries i0..i1 of KV head h, with the group's query heads.
  void run(int64_t h, int64_t i0, int64_t i1, std::vector<float>& buf) const {
    const int64_t rows = (i1 - i0) * group, ctx = seq_len - length;
    buf.resize(rows * d_size * 2 + rows * kBlockK + 2 * d_size * kBlockK + 3 * rows);
    float* qs = buf.data();            // [rows][d], scaled
    float* o = qs + rows * d_size;     // [rows][d]
    float* s = o + rows * d_size;      // [rows][kBlockK]: scores, then their exponentials
    float* kt = s + rows * kBlockK;    // [d][kBlockK]
    float* vs = kt + d_size * kBlockK;  // [kBlockK][d]
    float* m = vs + kBlockK * d_size;  // running max per row
    float* l = m + rows;               // running sum per row
    float* alpha = l + rows;           // this block's rescaling per row
    const Vec::T sv = Vec::set1(scale);
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t g = 0; g < group; ++g) {
        float* row = qs + ((i - i0) * group + g) * d_size;
        load_row(q + i * q_row + (h * group + g) * d_size, row, d_size);
        for (int64_t d = 0; d < d_size; d += Vec::L) Vec::store(row + d, Vec::mul(Vec::load(row + d), sv));
      }
    std::fill(o, o + rows * d_size, 0.f);
    std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
    std::fill(l, l + rows, 0.f);
    const int64_t last_key = ctx + i1;  // keys [0, last_key) are seen by some row of the task
    for (int64_t k0 = 0; k0 < last_key; k0 += kBlockK) {
      const int64_t nk = std::min(kBlockK, last_key - k0);
      for (int64_t j = 0; j < kBlockK; ++j) {
        float* vrow = vs + j * d_size;
        if (j >= nk) {
          for (int64_t d = 0; d < d_size; ++d) kt[d * kBlockK + j] = 0.f;
          std::fill(vrow, vrow + d_size, 0.f);
          continue;
        }
        load_row(k + (k0 + j) * k_row + h * d_size, vrow, d_size);  // the key, through vs as scratch
        for (int64_t d = 0; d < d_size; ++d) kt[d * kBlockK + j] = vrow[d];
      }
      for (int64_t j = 0; j < nk; ++j) load_row(v + (k0 + j) * v_row + h * d_size, vs + j * d_size, d_size);
      for (int64_t r = 0; r < rows; r += kScoreRows) {
        const int n = static_cast<int>(std::min<int64_t>(kScoreRows, rows - r));
        scores_rows(n, qs + r * d_size, d_size, kt, d_size, s + r * kBlockK);
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* sr = s + r * kBlockK;
        // Keys past this row's position (and past the block's end) take no part.
        const int64_t visible = std::min(nk, ctx + i0 + r / group + 1 - k0);
        if (visible <= 0) {
          alpha[r] = 1.f;
          std::fill(sr, sr + kBlockK, 0.f);
          continue;
        }
        float mx = m[r];
        int64_t j = 0;
        if (visible == kBlockK) {  // a whole block (all but the diagonal ones): vectors only
          Vec::T mv = Vec::load(sr);
          for (j = Vec::L; j < kBlockK; j += Vec::L) mv = Vec::max(mv, Vec::load(sr + j));
          mx = std::max(mx, Vec::reduce_max(mv));
        }
        for (; j < visible; ++j) mx = std::max(mx, sr[j]);
        const Vec::T mv = Vec::set1(mx);
        Vec::T total = Vec::zero();
        for (j = 0; j < kBlockK; j += Vec::L) Vec::store(sr + j, vexp(Vec::sub(Vec::load(sr + j), mv)));
        std::fill(sr + visible, sr + kBlockK, 0.f);
        for (j = 0; j < kBlockK; j += Vec::L) total = Vec::add(total, Vec::load(sr + j));
        alpha[r] = std::exp(m[r] - mx);  // 0 on the first block, where m is -inf
        l[r] = l[r] * alpha[r] + Vec::reduce_add(total);
        m[r] = mx;
      }
      const int64_t nv = d_size / Vec::L;
      // 4 vectors x 6 rows with AVX-512; with AVX2, 2 x 6, as the scores tile, for the same reason.
      if (nv % 4 == 0 && Vec::L == 16) values_all<4>(rows, s, nk, vs, d_size, alpha, o, d_size);
      else if (nv % 2 == 0) values_all<2>(rows, s, nk, vs, d_size, alpha, o, d_size);
      else values_all<1>(rows, s, nk, vs, d_size, alpha, o, d_size);
    }
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = (i - i0) * group + g;
        float* row = o + r * d_size;
        const Vec::T inv = Vec::set1(1.f / l[r]);
        for (int64_t d = 0; d < d_size; d += Vec::L) Vec::store(row + d, Vec::mul(Vec::load(row + d), inv));
        store_row(row, out + i * o_row + (h * group + g) * d_size, d_size);
      }
  }
};

template <typename scalar_t>
void run_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor& out) {
  const int64_t length = q.size(0), heads = q.size(1), d_size = q.size(2), kv_heads = k.size(1);
  const Task<scalar_t> task{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), q.stride(0), k.stride(0), v.stride(0), out.stride(0),
                            length, k.size(0), heads / kv_heads, d_size, static_cast<float>(scale)};
  const int64_t q_blocks = (length + kBlockQ - 1) / kBlockQ;
  // Later query blocks see more keys. Threads take contiguous ranges of tasks, so blocks go in the
  // order first, last, second, second to last...: any contiguous half holds about half the work.
  at::parallel_for(0, kv_heads * q_blocks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t h = t % kv_heads, n = t / kv_heads;
      const int64_t b = n % 2 == 0 ? n / 2 : q_blocks - 1 - n / 2;
      task.run(h, b * kBlockQ, std::min(length, (b + 1) * kBlockQ), buf);
    }
  });
}
#endif  // PDSERVE_SIMD

bool prefill_attention_takes(int64_t head_dim) {
#if defined(PDSERVE_SIMD)
  return head_dim > 0 && head_dim % Vec::L == 0;
#else
  return false;
#endif
}

void prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                       at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3,
              "prefill_attention: q, k, v and out must be [positions, heads, head_dim]");
  TORCH_CHECK(k.sizes() == v.sizes() && q.sizes() == out.sizes() && q.size(2) == k.size(2),
              "prefill_attention: k and v must match, and q, out and the head sizes");
  TORCH_CHECK(k.size(0) >= q.size(0), "prefill_attention: fewer keys (", k.size(0), ") than queries (", q.size(0),
              ")");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "prefill_attention: ", q.size(1),
              " query heads do not share ", k.size(1), " KV heads evenly");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "prefill_attention: q, k, v and out must share a dtype");
  for (const at::Tensor* t : {&q, &k, &v, const_cast<const at::Tensor*>(&out)})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == t->size(2),
                "prefill_attention: each position's heads must lie side by side, head_dim contiguous");
  TORCH_CHECK(prefill_attention_takes(q.size(2)), "prefill_attention: head_dim ", q.size(2),
              " is not whole vectors on this CPU");
#if defined(PDSERVE_SIMD)
  if (q.size(0) == 0) return;
  switch (q.scalar_type()) {
    case at::kFloat: return run_all<float>(q, k, v, scale, out);
    case at::kBFloat16: return run_all<at::BFloat16>(q, k, v, scale, out);
    case at::kHalf: return run_all<at::Half>(q, k, v, scale, out);
    default: TORCH_CHECK(false, "prefill_attention: float32, bfloat16 or float16 only, got ", q.scalar_type());
  }
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, Tensor(a!) out) -> ()");
  m.def("prefill_attention_takes(int head_dim) -> bool");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("prefill_attention", &prefill_attention); }

TORCH_LIBRARY_IMPL(pdserve_cpu, CatchAll, m) { m.impl("prefill_attention_takes", &prefill_attention_takes); }
