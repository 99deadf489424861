"""The CPU attention backend: decode rows and prefills through our C++ kernels (prefills through
SDPA for head sizes the prefill kernel does not take)."""

from __future__ import annotations

import torch

from pdserve.engine.attention import cpu_kernels, torch_paged
from pdserve.engine.attention.metadata import AttentionMetadata


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
                                  kernel=True)
    return out
