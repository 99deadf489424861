"""The elementwise parts of a decoder layer, fused: RMSNorm with the residual add, SiLU·mul, rotary,
and the KV cache write.

Each op has one reference expression here (`*_reference`: the eager PyTorch the model ran before,
kept as the definition the fused kernels are tested against) and an entry point that picks, per
call, the fastest implementation the tensors allow:

- on the CPU, our C++ kernels (engine/attention/csrc/cpu_fused_ops.cpp and cpu_kv_write.cpp,
  built with the decode attention by cpu_kernels) for float32 and bfloat16;
- on CUDA, the Triton kernels of engine/attention/triton_fused.py when triton is importable;
- anywhere else (float16 on the CPU, no compiler, PDSERVE_DISABLE_CPU_KERNELS=1), the reference.

The fused versions work in place where the eager code made a fresh tensor (the normalised
activations overwrite `x`, the rotated q and k overwrite the projection's output): callers hand
over tensors nobody else reads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KERNEL_DTYPES = (torch.float32, torch.bfloat16)

# Decided on first use: loading the CPU kernels may compile them, and triton imports slowly.
_cpu_ready: bool | None = None
_triton = None  # the triton_fused module, or False when triton is not importable
_reference_only = False  # set by use_reference(): every op runs its reference expression


# -- reference expressions -------------------------------------------------------------------------

def rms_norm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * norm(x + residual), x + residual): normalised in float32, cast back, then scaled."""
    if residual is not None:
        x = x + residual
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU of the first half of the last dimension times the second half."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Rotate-half rotary embedding of x [tokens, heads, dim]'s first rotary_dim values, in float32;
    cos/sin are [tokens, 1, rotary_dim] rows of the tables."""
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    x32 = rot.float()
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    out = (x32 * cos + rotated * sin).to(x.dtype)
    return out if rest.numel() == 0 else torch.cat([out, rest], dim=-1)


def rotate_qk_reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
                        sin_table: torch.Tensor, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos_table[positions].unsqueeze(1)
    sin = sin_table[positions].unsqueeze(1)
    return rotate_reference(q, cos, sin, rotary_dim), rotate_reference(k, cos, sin, rotary_dim)


def write_kv_reference(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


# -- dispatch ---------------------------------------------------------------------------------------

def cpu_kernels_ready() -> bool:
    global _cpu_ready
    if _cpu_ready is None:
        from pdserve.engine.attention import cpu_kernels

        _cpu_ready = cpu_kernels.load()
    return _cpu_ready


def triton_module():
    """engine/attention/triton_fused.py, or None when triton cannot be imported."""
    global _triton
    if _triton is None:
        try:
            from pdserve.engine.attention import triton_fused
        except ImportError:
            _triton = False
        else:
            _triton = triton_fused
    return _triton or None


def use_reference(enabled: bool = True) -> None:
    """Run every op as its reference expression from now on (or again the kernels): lets a
    benchmark or a test compare both paths in one process."""
    global _reference_only
    _reference_only = enabled


def reference_only() -> bool:
    return _reference_only


def _path(t: torch.Tensor) -> str:
    """'cpu', 'triton' or 'eager' for an op on t."""
    if _reference_only or t.dtype not in KERNEL_DTYPES:
        return "eager"
    if t.device.type == "cpu":
        return "cpu" if cpu_kernels_ready() else "eager"
    if t.device.type == "cuda":
        return "triton" if triton_module() is not None else "eager"
    return "eager"


def _rows_ok(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(-1) == 1


def cpu_kernel_takes_rows(t: torch.Tensor) -> bool:
    """Whether an op on t, 2-D with contiguous rows, goes to our CPU kernels (as this module's ops decide)."""
    return _path(t) == "cpu" and _rows_ok(t)


# -- entry points -----------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * norm(x + residual), x + residual), as rms_norm_reference. With a residual, both
    results are written over x and residual; without one, x is left as it is (it is the residual)."""
    path = _path(x)
    if (path == "eager" or not _rows_ok(x) or weight.dtype != x.dtype
            or (residual is not None and (not _rows_ok(residual) or residual.dtype != x.dtype))):
        return rms_norm_reference(x, residual, weight, eps)
    if path == "triton":
        return triton_module().rms_norm(x, residual, weight, eps)
    if residual is None:
        out = torch.empty_like(x)
        torch.ops.pdserve_cpu.rms_norm(x, weight, eps, out)
        return out, x
    torch.ops.pdserve_cpu.fused_add_rms_norm(x, residual, weight, eps)
    return x, residual


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a merged [tokens, 2 * intermediate] projection, read in place."""
    path = _path(gate_up)
    if path == "eager" or not _rows_ok(gate_up):
        return silu_mul_reference(gate_up)
    if path == "triton":
        return triton_module().silu_mul(gate_up)
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype, device=gate_up.device)
    torch.ops.pdserve_cpu.silu_and_mul(gate_up, out)
    return out


def rotate_qk(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_table: torch.Tensor,
              sin_table: torch.Tensor, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q [tokens, heads, dim] and k [tokens, kv_heads, dim] at `positions`,
    from float32 cos/sin tables [max_positions, rotary_dim]. The fused paths rotate in place."""
    path = _path(q)
    if (path == "eager" or k.dtype != q.dtype or q.stride(-1) != 1 or k.stride(-1) != 1
            or positions.dtype != torch.int64 or not positions.is_contiguous()):
        return rotate_qk_reference(positions, q, k, cos_table, sin_table, rotary_dim)
    if path == "triton":
        return triton_module().rotate_qk(positions, q, k, cos_table, sin_table, rotary_dim)
    torch.ops.pdserve_cpu.rotary_embedding(positions, q, k, cos_table, sin_table, rotary_dim)
    return q, k


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store keys and values [tokens, kv_heads, head_dim] at their flat cache slots, as
    write_kv_reference; the CPU kernel copies both in one pass (the GPU has triton_paged.write_kv)."""
    if (_path(key) != "cpu" or key.stride(-1) != 1 or value.stride(-1) != 1 or value.dtype != key.dtype
            or key_cache.dtype != key.dtype or not key_cache.is_contiguous() or not value_cache.is_contiguous()
            or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()):
        write_kv_reference(key, value, key_cache, value_cache, slot_mapping)
        return
    torch.ops.pdserve_cpu.write_kv(key, value, key_cache, value_cache, slot_mapping)
