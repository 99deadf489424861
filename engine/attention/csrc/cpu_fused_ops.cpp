// The small elementwise parts of a decoder layer on the CPU, one pass over memory each:
// residual add + RMSNorm, SiLU(gate) * up, and rotary embedding of q and k in place.
//
// Eager PyTorch runs each of these as 3 to 12 separate ops, every one a dispatch, an allocation
// and a full read and write of the activations. Here each is one loop per row, with the same
// roundings as the reference expressions in pdserve/engine/model/fused.py: math in float32,
// results rounded to the tensor's dtype exactly where the eager code rounds them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_step_parts.h"

// Eager torch rounds every multiply and add on its own; a fused multiply-add would round once
// and make rotary differ from the reference in the last bit. Applies to the functions below.
#pragma GCC optimize("fp-contract=off")

namespace {

// Helpers are forced inline: a call left in a loop stops the compiler from vectorizing it.
#define PDSERVE_INLINE inline __attribute__((always_inline))

PDSERVE_INLINE float widen(float x) { return x; }
// bfloat16 is the high half of a float32.
PDSERVE_INLINE float widen(at::BFloat16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x.x) << 16); }

template <typename scalar_t>
PDSERVE_INLINE scalar_t narrow(float x);

template <>
PDSERVE_INLINE float narrow<float>(float x) {
  return x;
}

// Round to nearest even as c10::BFloat16 does, NaN to the quiet NaN, without a branch.
template <>
PDSERVE_INLINE at::BFloat16 narrow<at::BFloat16>(float x) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, x);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;  // an integer test: vectorizes where x != x does not
  return at::BFloat16(static_cast<uint16_t>(nan ? 0x7FC0u : rounded), at::BFloat16::from_bits());
}

// p[i] = x rounded to the dtype; bfloat16 is written as its bits, which vectorizes where a
// struct copy does not.
PDSERVE_INLINE void store(float* p, int64_t i, float x) { p[i] = x; }
PDSERVE_INLINE void store(at::BFloat16* p, int64_t i, float x) {
  reinterpret_cast<uint16_t*>(p)[i] = narrow<at::BFloat16>(x).x;
}

// Round to the storage dtype and back, as an eager op's output would be.
template <typename scalar_t>
PDSERVE_INLINE float round_to(float x) {
  return widen(narrow<scalar_t>(x));
}

using pdserve_parallel::grain;

// ---- RMSNorm ----------------------------------------------------------------------------------

// x <- weight * norm(x + residual), residual <- x + residual; without a residual, out <- weight * norm(x).
template <typename scalar_t>
void rms_norm_rows(scalar_t* x, int64_t x_row, scalar_t* residual, int64_t r_row, const scalar_t* weight,
                   scalar_t* out, int64_t o_row, int64_t rows, int64_t hidden, float eps) {
  pdserve_parallel::parallel_for(0, rows, grain(hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> sum(hidden);
    float* s = sum.data();
    for (int64_t t = begin; t < end; ++t) {
      scalar_t* xr = x + t * x_row;
      if (residual != nullptr) {
        scalar_t* rr = residual + t * r_row;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) {
          const float v = round_to<scalar_t>(widen(xr[i]) + widen(rr[i]));
          store(rr, i, v);
          s[i] = v;
        }
      } else {
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) s[i] = widen(xr[i]);
      }
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < hidden; ++i) squares += s[i] * s[i];
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
      scalar_t* orow = residual != nullptr ? xr : out + t * o_row;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i)
        store(orow, i, widen(weight[i]) * round_to<scalar_t>(s[i] * inv));
    }
  });
}

void check_rows(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [tokens, hidden] with contiguous rows");
  TORCH_CHECK(t.sizes() == like.sizes() && t.scalar_type() == like.scalar_type(), name, " must match x");
}

void check_norm_weight(const at::Tensor& weight, const at::Tensor& x) {
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [hidden] tensor of x's dtype");
}

template <typename F>
void dispatch_float_bf16(at::ScalarType type, const char* op, F&& f) {
  switch (type) {
    case at::kFloat:
      return f(float{});
    case at::kBFloat16:
      return f(at::BFloat16{});
    default:
      TORCH_CHECK(false, op, " supports float32 and bfloat16, not ", type);
  }
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, x, "x");
  check_rows(residual, x, "residual");
  check_norm_weight(weight, x);
  dispatch_float_bf16(x.scalar_type(), "fused_add_rms_norm", [&](auto zero) {
    using scalar_t = decltype(zero);
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), residual.data_ptr<scalar_t>(), residual.stride(0),
                            weight.data_ptr<scalar_t>(), nullptr, 0, x.size(0), x.size(1), static_cast<float>(eps));
  });
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  check_rows(x, x, "x");
  check_rows(out, x, "out");
  check_norm_weight(weight, x);
  dispatch_float_bf16(x.scalar_type(), "rms_norm", [&](auto zero) {
    using scalar_t = decltype(zero);
    rms_norm_rows<scalar_t>(const_cast<scalar_t*>(x.data_ptr<scalar_t>()), x.stride(0), nullptr, 0,
                            weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), out.stride(0), x.size(0), x.size(1),
                            static_cast<float>(eps));
  });
}

// ---- SiLU(gate) * up --------------------------------------------------------------------------

// exp(x) for x <= 0, vectorizable by the compiler (no library call): exp(x) = 2^n e^r with
// n = round(x / ln 2) and |r| <= ln 2 / 2 from a two-part ln 2 (Cody-Waite), e^r by its Taylor
// series to degree 7 (truncation below 1e-8), its Horner steps fused multiply-adds (spelled out:
// this file turns contraction off; SiLU ran 1.2-1.35x faster with them). Within about 2 float32
// ulps of expf; below -87 it returns about 2^-126 (1e-38) instead of a denormal, which no caller
// can tell from 0.
PDSERVE_INLINE float exp_nonpositive(float x) {
  // Adding and subtracting 1.5 * 2^23 rounds to the nearest integer without a library call.
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.f / 5040.f;
  p = __builtin_fmaf(p, r, 1.f / 720.f);
  p = __builtin_fmaf(p, r, 1.f / 120.f);
  p = __builtin_fmaf(p, r, 1.f / 24.f);
  p = __builtin_fmaf(p, r, 1.f / 6.f);
  p = __builtin_fmaf(p, r, 0.5f);
  p = __builtin_fmaf(p, r, 1.f);
  p = __builtin_fmaf(p, r, 1.f);
  // 2^n from the exponent bits, n kept to normal floats. The bound is an integer compare: a
  // float compare may trap, and then the compiler will not vectorize the loop around it.
  const int32_t ni = static_cast<int32_t>(n);
  const int32_t bits = ((ni < -126 ? -126 : ni) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

// x * sigmoid(x), with exp of a non-positive argument only so nothing overflows.
PDSERVE_INLINE float silu(float x) {
  const float e = exp_nonpositive(-std::fabs(x));
  const float sig = (x >= 0.f ? 1.f : e) / (1.f + e);
  return x * sig;
}

template <typename scalar_t>
void silu_mul_rows(const scalar_t* gate_up, int64_t in_row, scalar_t* out, int64_t out_row, int64_t rows,
                   int64_t inter) {
  pdserve_parallel::parallel_for(0, rows, grain(inter), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* gate = gate_up + t * in_row;
      const scalar_t* up = gate + inter;
      scalar_t* o = out + t * out_row;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i)
        store(o, i, round_to<scalar_t>(silu(widen(gate[i]))) * widen(up[i]));
    }
  });
}

void silu_and_mul(const at::Tensor& gate_up, at::Tensor& out) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [tokens, 2 * intermediate] with contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.size(0) == gate_up.size(0) &&
                  out.size(1) * 2 == gate_up.size(1) && out.scalar_type() == gate_up.scalar_type(),
              "out must be [tokens, intermediate] of gate_up's dtype with contiguous rows");
  dispatch_float_bf16(gate_up.scalar_type(), "silu_and_mul", [&](auto zero) {
    using scalar_t = decltype(zero);
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), gate_up.stride(0), out.data_ptr<scalar_t>(), out.stride(0),
                            gate_up.size(0), out.size(1));
  });
}

// ---- Rotary embedding -------------------------------------------------------------------------

// Rotate-half (GPT-NeoX layout) of the first rotary_dim values of one head, in place:
// out = x * cos + cat(-x2, x1) * sin, each product and the sum rounded as eager float32 does.
template <typename scalar_t>
PDSERVE_INLINE void rotate_head(scalar_t* x, const float* cos, const float* sin, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float a = widen(x[i]), b = widen(x[i + half]);
    const float lo = a * cos[i] + (-b) * sin[i];
    const float hi = b * cos[i + half] + a * sin[i + half];
    store(x, i, lo);
    store(x, i + half, hi);
  }
}

template <typename scalar_t>
void rotary_rows(const int64_t* positions, scalar_t* q, int64_t q_tok, int64_t q_head, int64_t q_heads, scalar_t* k,
                 int64_t k_tok, int64_t k_head, int64_t k_heads, const float* cos, const float* sin,
                 int64_t table_row, int64_t rotary_dim, int64_t tokens) {
  const int64_t heads = q_heads + k_heads, half = rotary_dim / 2;
  pdserve_parallel::parallel_for(0, tokens * heads, grain(rotary_dim), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / heads, h = task % heads;
      const int64_t pos = positions[t];
      scalar_t* row = h < q_heads ? q + t * q_tok + h * q_head : k + t * k_tok + (h - q_heads) * k_head;
      rotate_head(row, cos + pos * table_row, sin + pos * table_row, half);
    }
  });
}

void rotary_embedding(const at::Tensor& positions, at::Tensor& q, at::Tensor& k, const at::Tensor& cos,
                      const at::Tensor& sin, int64_t rotary_dim) {
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "positions must be a contiguous int64 vector");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1,
              "q and k must be [tokens, heads, head_dim] with contiguous heads");
  TORCH_CHECK(q.size(0) == positions.size(0) && k.size(0) == positions.size(0), "one position per token");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.size(2) == k.size(2), "q and k must share dtype and head_dim");
  const pdserve_parts::RotaryFit fit = pdserve_parts::rotary_fit(cos, sin, rotary_dim, q.size(2));
  TORCH_CHECK(fit.dims, "rotary_dim must be even and at most head_dim");
  TORCH_CHECK(fit.tables, "cos and sin must be contiguous float32 [positions, rotary_dim] tables");
  if (positions.numel() == 0) return;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = *std::max_element(pos, pos + positions.numel());
  const int64_t min_pos = *std::min_element(pos, pos + positions.numel());
  TORCH_CHECK(min_pos >= 0 && max_pos < cos.size(0), "position ", max_pos, " is outside the rotary table of ",
              cos.size(0));
  dispatch_float_bf16(q.scalar_type(), "rotary_embedding", [&](auto zero) {
    using scalar_t = decltype(zero);
    rotary_rows<scalar_t>(pos, q.data_ptr<scalar_t>(), q.stride(0), q.stride(1), q.size(1), k.data_ptr<scalar_t>(),
                          k.stride(0), k.stride(1), k.size(1), cos.data_ptr<float>(), sin.data_ptr<float>(),
                          cos.size(1), rotary_dim, positions.size(0));
  });
}

}  // namespace

template <typename T>
void pdserve_parts::rms_norm(T* x, int64_t x_row, T* residual, int64_t r_row, const T* weight, T* out, int64_t o_row,
                             int64_t rows, int64_t hidden, float eps) {
  rms_norm_rows<T>(x, x_row, residual, r_row, weight, out, o_row, rows, hidden, eps);
}

template <typename T>
void pdserve_parts::silu_mul(const T* gate_up, int64_t in_row, T* out, int64_t out_row, int64_t rows, int64_t inter) {
  silu_mul_rows<T>(gate_up, in_row, out, out_row, rows, inter);
}

template <typename T>
void pdserve_parts::rotary(const int64_t* positions, T* q, int64_t q_tok, int64_t q_head, int64_t q_heads, T* k,
                           int64_t k_tok, int64_t k_head, int64_t k_heads, const float* cos, const float* sin,
                           int64_t table_row, int64_t rotary_dim, int64_t tokens) {
  rotary_rows<T>(positions, q, q_tok, q_head, q_heads, k, k_tok, k_head, k_heads, cos, sin, table_row, rotary_dim,
                 tokens);
}

// y += bias row by row, in float32 and rounded once, as torch's add of two tensors of the dtype.
template <typename T>
void pdserve_parts::add_bias(T* y, int64_t y_row, const T* bias, int64_t rows, int64_t n) {
  pdserve_parallel::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = y + t * y_row;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) store(row, i, widen(row[i]) + widen(bias[i]));
    }
  });
}

#define PDSERVE_PARTS(T)                                                                                      \
  template void pdserve_parts::rms_norm<T>(T*, int64_t, T*, int64_t, const T*, T*, int64_t, int64_t, int64_t,  \
                                           float);                                                            \
  template void pdserve_parts::silu_mul<T>(const T*, int64_t, T*, int64_t, int64_t, int64_t);                  \
  template void pdserve_parts::add_bias<T>(T*, int64_t, const T*, int64_t, int64_t);                             \
  template void pdserve_parts::rotary<T>(const int64_t*, T*, int64_t, int64_t, int64_t, T*, int64_t, int64_t,  \
                                         int64_t, const float*, const float*, int64_t, int64_t, int64_t);
PDSERVE_PARTS(float)
PDSERVE_PARTS(at::BFloat16)
#undef PDSERVE_PARTS

pdserve_parts::RotaryFit pdserve_parts::rotary_fit(const at::Tensor& cos, const at::Tensor& sin, int64_t rotary_dim,
                                                   int64_t head_dim) {
  RotaryFit fit;
  fit.dims = rotary_dim % 2 == 0 && rotary_dim <= head_dim;
  fit.tables = cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
               sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(1) == rotary_dim;
  return fit;
}

// Same namespace as the decode attention, one library: this file adds to it.
TORCH_LIBRARY_FRAGMENT(pdserve_cpu, m) {
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def("silu_and_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, int rotary_dim) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve_cpu, CPU, m) {
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
}
