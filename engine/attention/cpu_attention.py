"""The CPU attention backend: decode rows and prefills through our C++ kernels (prefills through
SDPA for head sizes the prefill kernel does not take, and in bfloat16 on CPUs with AMX)."""

from __future__ import annotations

import functools

import torch

from pdserve.engine.attention import cpu_kernels, torch_paged
from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.engine.config import cpu_has_amx_bf16


def prefill_through_sdpa(dtype: torch.dtype, amx_bf16: bool) -> bool:
    """Whether prefills go through torch's SDPA instead of our kernel: in bfloat16 where the CPU has
    AMX, whose tiles torch's CPU flash attention multiplies in. Measured on an Intel Xeon with AMX
    (SmolLM2's 9/3 heads of 64, 2 threads, alternated): SDPA 1.28x our kernel at 256 tokens, 1.29x
    at 512, 1.44-1.66x for chunks of 256-512 after 512-1792 cached tokens, 1.94-2.15x at 2048, level
    at 128. float32 keeps our kernel: there SDPA ran 0.56-0.83x of it."""
    return dtype == torch.bfloat16 and amx_bf16


@functools.cache
def _amx_bf16() -> bool:
    return cpu_has_amx_bf16()


def plan(meta: AttentionMetadata) -> torch_paged.TorchAttentionPlan:
    return torch_paged.plan(meta, gather_decodes=False)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty_like(query) if out is None else out
    nd = meta.num_decodes
    if nd:
        cpu_kernels.decode_attention(query[:nd], key_cache, value_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                                     scale, out[:nd])
    torch_paged.prefill_attention(query, key_cache, value_cache, meta, meta.backend_plan, scale, key, value, out,
                                  kernel=not prefill_through_sdpa(query.dtype, _amx_bf16()))
    return out
