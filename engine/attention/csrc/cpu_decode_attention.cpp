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
#include <vector>

namespace {

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
  const int64_t max_len = seq_lens.max().item<int32_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_reqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), row(head_dim);
    std::vector<float> scores(group * std::max<int64_t>(max_len, 1));
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t len = lens[r];
      const int32_t* table = tables + r * max_blocks;
      for (int64_t g = 0; g < group; ++g) {
        load_row(q + r * q_req + (h * group + g) * q_head, qf.data() + g * head_dim, head_dim);
        for (int64_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] *= fscale;
      }
      // Scores: each key row is widened once and dotted with every query head of the group.
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
      for (int64_t g = 0; g < group; ++g)
        store_row(acc.data() + g * head_dim, o + r * o_req + (h * group + g) * o_head, head_dim);
    }
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

TORCH_LIBRARY(pdserve_cpu, m) {
  m.def("decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
