"""Triton twins of the fused CPU ops (csrc/cpu_fused_ops.cpp) for CUDA tensors.

RMSNorm with the residual add, SiLU·mul and rotary embedding, each one launch with the same
roundings as the reference expressions in pdserve/engine/model/fused.py: float32 math, results
rounded to the tensor's dtype where the eager code rounds them. Checked against those references
in the Triton interpreter on the CPU (tests/engine/test_fused_ops.py); on a GPU the compiler may
fuse a multiply and an add, so results can differ from eager in the last float32 bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SILU_BLOCK = 1024


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # The sum is rounded to the storage dtype first: it is the next layer's residual.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / hidden
    inv = tl.div_rn(1.0, tl.sqrt_rn(mean_square + eps))
    normed = (x32 * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # silu is rounded to the dtype before the product, as F.silu(gate) * up rounds it.
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh, q_heads,
                   stride_table, HALF: tl.constexpr, HALF_P: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < q_heads:
        base = q_ptr + token * stride_qt + head * stride_qh
    else:
        base = k_ptr + token * stride_kt + (head - q_heads) * stride_kh
    pos = tl.load(pos_ptr + token)
    i = tl.arange(0, HALF_P)
    mask = i < HALF
    a = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(base + HALF + i, mask=mask, other=0.0).to(tl.float32)
    table = pos * stride_table
    cos_lo = tl.load(cos_ptr + table + i, mask=mask, other=0.0)
    sin_lo = tl.load(sin_ptr + table + i, mask=mask, other=0.0)
    cos_hi = tl.load(cos_ptr + table + HALF + i, mask=mask, other=0.0)
    sin_hi = tl.load(sin_ptr + table + HALF + i, mask=mask, other=0.0)
    lo = a * cos_lo + (-b) * sin_lo
    hi = b * cos_hi + a * sin_hi
    tl.store(base + i, lo.to(base.dtype.element_ty), mask=mask)
    tl.store(base + HALF + i, hi.to(base.dtype.element_ty), mask=mask)


def _check_rows(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2 or t.stride(-1) != 1:
        raise ValueError(f"{name} must be [tokens, features] with contiguous rows, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """As fused.rms_norm_reference; with a residual both results overwrite x and residual."""
    _check_rows(x, "x")
    tokens, hidden = x.shape
    out = x if residual is not None else torch.empty_like(x)
    if residual is not None:
        _check_rows(residual, "residual")
    if tokens:
        block = triton.next_power_of_2(hidden)
        res = residual if residual is not None else x
        _rms_norm_kernel[(tokens,)](x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), hidden, eps,
                                    HAS_RESIDUAL=residual is not None, BLOCK=block,
                                    num_warps=8 if block >= 4096 else 4)
    return (out, residual) if residual is not None else (out, x)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    _check_rows(gate_up, "gate_up")
    tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        _silu_mul_kernel[(tokens, triton.cdiv(inter, SILU_BLOCK))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                                   inter, BLOCK=SILU_BLOCK, num_warps=4)
    return out


def rotate_qk(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
              sin_table: torch.Tensor, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [tokens, heads, dim] and k [tokens, kv_heads, dim] in place."""
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k need a contiguous head dimension")
    if not (cos_table.is_contiguous() and sin_table.is_contiguous() and cos_table.shape[1] == rotary_dim):
        raise ValueError("cos/sin must be contiguous [positions, rotary_dim] tables")
    tokens = q.shape[0]
    if tokens:
        half = rotary_dim // 2
        _rotary_kernel[(tokens, q.shape[1] + k.shape[1])](
            positions, q, k, cos_table, sin_table, q.stride(0), q.stride(1), k.stride(0), k.stride(1), q.shape[1],
            cos_table.stride(0), HALF=half, HALF_P=triton.next_power_of_2(half), num_warps=1)
    return q, k


__all__ = ["rms_norm", "rotate_qk", "silu_mul"]
