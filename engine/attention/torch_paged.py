"""Paged attention in plain torch: the reference, and the CPU path.

Decodes (one query each) run as one batched SDPA call over their context gathered into a padded
tensor; prefills run one SDPA call per request (the CPU backend passes them to its C++ kernel). Gather indices are planned once per step and
shared by all layers, so each layer pays only the gather and the attention itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.engine.model import fused


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys/values ([tokens, kv_heads, head_dim]) at their cache slots (one fused
    copy on the CPU where our kernels are built, else two index_copy_)."""
    fused.write_kv(key, value, key_cache, value_cache, slot_mapping)


def context_slots(block_table: np.ndarray, length: int, block_size: int) -> np.ndarray:
    """Flat cache slots of positions 0..length-1 for one request."""
    num_blocks = -(-length // block_size)
    blocks = block_table[:num_blocks].astype(np.int64)
    return (blocks[:, None] * block_size + np.arange(block_size)).reshape(-1)[:length]


@dataclass
class PrefillPlan:
    query_start: int
    query_end: int
    # None when the request has no earlier context: attend to this step's keys directly.
    slots: torch.Tensor | None
    mask: torch.Tensor | None  # [query_len, seq_len] bool, True = may attend


@dataclass
class TorchAttentionPlan:
    decode_slots: torch.Tensor | None  # [num_decodes, max_len] int64 (padding points at slot 0)
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_len] bool
    prefills: list[PrefillPlan]


def plan(meta: AttentionMetadata, gather_decodes: bool = True) -> TorchAttentionPlan:
    """Precompute gather indices and masks for one step. With `gather_decodes=False` only the
    prefills are planned: the decode rows go to a kernel that reads the blocks itself."""
    device = meta.slot_mapping.device
    qsl, seq_lens, tables, bs = meta.query_start_loc_np, meta.seq_lens_np, meta.block_tables_np, meta.block_size
    decode_slots = decode_mask = None
    nd = meta.num_decodes
    if nd and gather_decodes:
        lens = seq_lens[:nd].astype(np.int64)
        max_len = int(lens.max())
        num_blocks = -(-max_len // bs)
        slots = (tables[:nd, :num_blocks].astype(np.int64)[:, :, None] * bs + np.arange(bs)).reshape(nd, -1)[:, :max_len]
        valid = np.arange(max_len)[None, :] < lens[:, None]
        decode_slots = torch.from_numpy(np.where(valid, slots, 0)).to(device)
        decode_mask = torch.from_numpy(valid).to(device).view(nd, 1, 1, max_len)
    prefills = []
    for r in range(nd, meta.num_reqs):
        start, end = int(qsl[r]), int(qsl[r + 1])
        query_len, seq_len = end - start, int(seq_lens[r])
        if seq_len == query_len:
            prefills.append(PrefillPlan(start, end, None, None))
            continue
        slots = torch.from_numpy(context_slots(tables[r], seq_len, bs)).to(device)
        query_pos = torch.arange(seq_len - query_len, seq_len, device=device)
        mask = torch.arange(seq_len, device=device)[None, :] <= query_pos[:, None]
        prefills.append(PrefillPlan(start, end, slots, mask))
    return TorchAttentionPlan(decode_slots, decode_mask, prefills)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, key: torch.Tensor | None = None, value: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of `query` [tokens, heads, head_dim] over the paged cache (already holding this
    step's keys). `key`/`value`, when given, let prompts without earlier context skip the gather."""
    p: TorchAttentionPlan = meta.backend_plan if isinstance(meta.backend_plan, TorchAttentionPlan) else plan(meta)
    out = torch.empty_like(query) if out is None else out
    nd = meta.num_decodes
    if nd:
        num_kv_heads, head_dim = key_cache.shape[-2], key_cache.shape[-1]
        k = key_cache.view(-1, num_kv_heads, head_dim)[p.decode_slots].transpose(1, 2)  # [nd, kv_heads, len, dim]
        v = value_cache.view(-1, num_kv_heads, head_dim)[p.decode_slots].transpose(1, 2)
        q = query[:nd].unsqueeze(2)  # [nd, heads, 1, dim]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.decode_mask, scale=scale,
                                           enable_gqa=query.shape[1] != num_kv_heads)
        out[:nd] = o.squeeze(2)
    prefill_attention(query, key_cache, value_cache, meta, p, scale, key, value, out)
    return out


def prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                      p: TorchAttentionPlan, scale: float, key: torch.Tensor | None, value: torch.Tensor | None,
                      out: torch.Tensor, kernel: bool = False) -> None:
    """The rows of requests with more than one query token, one call per request: our C++ kernel
    with `kernel` (the CPU backend, for head sizes it takes), else SDPA.

    SDPA's inputs go in as 4-D [1, heads, len, dim]: on CPU only then does SDPA take its flash
    kernel (with grouped KV heads too); 3-D inputs fall to the unfused math path, 2-3x slower at
    512 tokens.
    """
    num_kv_heads, head_dim = key_cache.shape[-2], key_cache.shape[-1]
    k_flat = key_cache.view(-1, num_kv_heads, head_dim)
    v_flat = value_cache.view(-1, num_kv_heads, head_dim)
    gqa = query.shape[1] != num_kv_heads
    kernel = kernel and bool(torch.ops.pdserve_cpu.prefill_attention_takes(head_dim))
    for pf in p.prefills:
        rows = slice(pf.query_start, pf.query_end)
        if pf.slots is None:
            k_src = key[rows] if key is not None else k_flat[_own_slots(meta, pf)]
            v_src = value[rows] if value is not None else v_flat[_own_slots(meta, pf)]
        else:
            k_src, v_src = k_flat[pf.slots], v_flat[pf.slots]
        if kernel:  # causal with the chunk's queries at the end of its keys, as pf.mask says
            torch.ops.pdserve_cpu.prefill_attention(query[rows], k_src, v_src, scale, out[rows])
            continue
        q = _heads_first(query[rows])
        if pf.slots is None:
            o = F.scaled_dot_product_attention(q, _heads_first(k_src), _heads_first(v_src), is_causal=True,
                                               scale=scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(q, _heads_first(k_src), _heads_first(v_src), attn_mask=pf.mask,
                                               scale=scale, enable_gqa=gqa)
        out[rows] = o[0].transpose(0, 1)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[len, heads, dim] -> [1, heads, len, dim], a view."""
    return x.transpose(0, 1).unsqueeze(0)


def _own_slots(meta: AttentionMetadata, pf: PrefillPlan) -> torch.Tensor:
    return meta.slot_mapping[pf.query_start:pf.query_end]


def naive_paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          query_start_loc: list[int], seq_lens: list[int], block_tables: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Token-by-token definition of paged attention, in float32; for tests of faster paths."""
    bs = key_cache.shape[1]
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float32)
    for r in range(len(seq_lens)):
        start, end, seq_len = query_start_loc[r], query_start_loc[r + 1], seq_lens[r]
        positions = torch.arange(seq_len)
        blocks = block_tables[r, positions // bs].long()
        keys = key_cache[blocks, positions % bs].float()  # [seq_len, kv_heads, dim]
        values = value_cache[blocks, positions % bs].float()
        for i in range(end - start):
            limit = seq_len - (end - start) + i + 1
            for h in range(num_heads):
                scores = (keys[:limit, h // group] @ query[start + i, h].float()) * scale
                out[start + i, h] = torch.softmax(scores, dim=0) @ values[:limit, h // group]
    return out
