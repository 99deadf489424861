"""int8 linear weights with one scale per output channel (`quantization="int8"`).

A weight row w is stored as round(w / s) in [-127, 127] with s = max|w| / 127: a quarter of
float32's memory, and of the bytes a decode step streams from RAM. This is weight-only
quantization: activations stay float32 and the product is the float32 one with the rounded
weight, so the only error is the weight rounding (about 0.4% of a row's largest entry).

Kernels (measured on an AVX2-only EPYC, bench model shapes, one thread):
- up to SMALL_ROWS rows of x (decode): our AVX2 kernel (csrc/cpu_int8_linear.cpp), which widens
  the int8 weight in registers: 1.4-4x faster than float32 F.linear at 1 to 16 rows;
- more rows (prefill): the weight widened to float32 a slab of rows at a time and multiplied by
  MKL; the widening is paid once per slab for all rows, so this runs at float32's rate.
Rejected after measuring: ATen's `_weight_int8pack_mm` (a scalar loop without AVX-512: 10-50x
slower than float32 here) and `torch._int_mm` (slower still), and fbgemm's dynamic-quantized
linear (fast, but it rounds x to 7 bits with one scale per call: SmolLM2's outlier activations
then change the greedy output from the first token).

Quantization happens after loading, so each tensor-parallel rank quantizes its own shard.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger("pdserve.engine.quant")

QMAX = 127  # symmetric: -128 is left out so that w and -w round alike
SMALL_ROWS = 32  # at and below: the register kernel; above: float32 slabs (measured crossover ~64)
SLAB_ROWS = 512  # weight rows widened at a time: 512 x 4096 float32 = 8 MiB at most


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 rows, float32 scales) with weight ≈ q * scales[:, None]; an all-zero row gets scale 1."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scales


def kernel_available() -> bool:
    """Whether our vectorized int8 kernel is built and loaded here."""
    from pdserve.engine.attention import cpu_kernels

    return cpu_kernels.available() and bool(torch.ops.pdserve_cpu.int8_linear_vectorized())


def int8_matmul_slabs(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (float32, 2-D) times (q * scales)ᵀ, widening q to float32 one slab of rows at a time."""
    n = q.shape[0]
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    slab = torch.empty(min(SLAB_ROWS, n), q.shape[1], dtype=torch.float32)
    for start in range(0, n, SLAB_ROWS):
        w = slab[:min(SLAB_ROWS, n - start)]
        w.copy_(q[start:start + w.shape[0]])
        torch.mm(x, w.t(), out=out[:, start:start + w.shape[0]])
    return out.mul_(scales)


class Int8Linear:
    """One weight matrix (with its bias, if any) in int8, and the matmul by it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 use_kernel: bool | None = None) -> None:
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"int8 quantization takes a 2-D CPU weight, got {tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.qweight, self.scales = quantize_per_channel(weight)
        self.bias = None if bias is None else bias.detach().float().clone()
        self.use_kernel = kernel_available() if use_kernel is None else use_kernel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x Wᵀ + b in x's dtype, computed in float32."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()
        if self.use_kernel and x2.shape[0] <= SMALL_ROWS:
            y = torch.ops.pdserve_cpu.int8_linear(x2, self.qweight, self.scales)
        else:
            y = int8_matmul_slabs(x2, self.qweight, self.scales)
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype).reshape(*lead, self.out_features)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]

    @property
    def nbytes(self) -> int:
        """Bytes of weight storage: one per element, plus the scales and bias."""
        extra = self.scales.numel() * 4 + (0 if self.bias is None else self.bias.numel() * 4)
        return self.qweight.numel() + extra


def quantize_model(model: nn.Module, method: str, include_lm_head: bool = True) -> int:
    """Replace every linear layer's float weight by an int8 one; returns how many were quantized.

    The float weights are freed, except an lm_head tied to the embedding (the embedding still
    looks rows up in it). Biases of column-parallel layers move into the int8 kernel; a
    row-parallel layer adds its bias after the all-reduce, as before.
    """
    if method != "int8":
        raise ValueError(f"unknown quantization {method!r}")
    from pdserve.engine.model.layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                             VocabParallelEmbedding)

    embeddings = {id(m.weight) for m in model.modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    count = 0
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear):
            module.quantized = Int8Linear(module.weight, module.bias)
            module.bias = None  # now inside module.quantized
        elif isinstance(module, RowParallelLinear):
            module.quantized = Int8Linear(module.weight)
        elif isinstance(module, ParallelLMHead) and include_lm_head:
            module.quantized = Int8Linear(module.weight)
        else:
            continue
        if id(module.weight) not in embeddings:
            module.weight = None  # type: ignore[assignment]
        module.packed_weight = None
        count += 1
    return count


def weight_bytes(model: nn.Module) -> int:
    """Bytes held by the model's parameters and int8 weights, each stored tensor counted once."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    for m in model.modules():
        q = getattr(m, "quantized", None)
        if q is not None:
            total += q.nbytes
    return total
