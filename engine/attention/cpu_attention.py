"""The CPU attention backend: decode rows and prefills through our C++ kernels (prefills through
SDPA for head sizes the prefill kernel does not take, and in bfloat16 on CPUs with AMX)."""

from __future__ import annotations

import functools

import torch

from pdserve.engine.attention import cpu_kernels, torch_paged
from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.engine.config import cpu_has_amx_bf16


# SDPA widens a chunk's boolean mask (a chunk after cached tokens) to a float one of the same
# shape: past this many elements (64 MiB of floats, a 2048-token chunk after 6k cached tokens) our
# kernel, which needs no mask, takes the step's prefills instead.
SDPA_MASK_MAX_ELEMENTS = 16 << 20


def prefill_through_sdpa(dtype: torch.dtype, amx_bf16: bool, mask_elements: int = 0) -> bool:
    """Whether prefills go through torch's SDPA instead of our kernel: in bfloat16 where the CPU has
    AMX, whose tiles torch's CPU flash attention multiplies in. Measured on an Intel Xeon with AMX
    (SmolLM2's 9/3 heads of 64, 2 threads, alternated): SDPA 1.28x our kernel at 256 tokens, 1.29x
    at 512, 1.44-1.66x for chunks of 256-512 after 512-1792 cached tokens, 1.94-2.15x at 2048, level
    at 128. float32 keeps our kernel: there SDPA ran 0.56-0.83x of it. `mask_elements`: the largest
    mask of the step's prefills (see SDPA_MASK_MAX_ELEMENTS)."""
    return dtype == torch.bfloat16 and amx_bf16 and mask_elements <= SDPA_MASK_MAX_ELEMENTS


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
    prefills_plan = meta.backend_plan
    largest_mask = max((pf.mask.numel() for pf in prefills_plan.prefills if pf.mask is not None), default=0)
    torch_paged.prefill_attention(query, key_cache, value_cache, meta, prefills_plan, scale, key, value, out,
                                  kernel=not prefill_through_sdpa(query.dtype, _amx_bf16(), largest_mask))
    return out
