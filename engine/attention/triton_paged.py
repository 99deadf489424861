"""Paged attention in Triton: the CUDA path.

One kernel serves every request shape in a step. A program owns one query tile of one request and
one KV head: the tile's rows are (query token, query head of that KV head's group) pairs, so the
keys and values of a GQA group are loaded once and multiplied against all its query heads in one
`tl.dot`. Keys are walked in tiles of TILE_N positions, each position finding its cache slot
through the request's block table, with an online softmax in float32 (base 2, the scale folded in).

Each step is two launches of that kernel:
- decodes (requests [0, num_decodes), one query each): grid (num_decodes, kv_heads, segments).
  With few decodes and long contexts the grid is too small to fill the GPU, so the key range is
  split into segments whose partial results a second small kernel merges (flash-decoding).
- prefills (the rest, with or without earlier context): grid (query tiles, kv_heads), the tile ->
  (request, first query) map planned on the host once per step and shared by all layers through
  `meta.backend_plan`.

Cache layout: key_cache/value_cache [num_blocks, block_size, kv_heads, head_dim], query/out
[tokens, heads, head_dim]; head_dim must be contiguous. Block table entries past a request's
blocks are never read.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import numpy as np
import torch
import triton
import triton.language as tl

from pdserve.engine.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # query rows per program: BLOCK_Q tokens x the padded GQA group
    tile_n: int  # keys per inner iteration
    num_warps: int
    num_stages: int


# Tile shapes per (dtype width, head_dim, decode or prefill). Not timed on a GPU yet: chosen by
# compiling for sm_90 and reading the compiled kernels' register, spill and shared-memory use
# (`tests/engine/triton_cases.py --compile`), so that none spills and 16-bit tiles keep 2 programs per SM.
# - tl.dot on tensor cores needs 16 rows, so a decode pads its one token's GQA group to 16 rows;
#   decode is bound by K/V bandwidth and gets wide key tiles and 3 stages of loads in flight.
# - prefill takes 64 rows (one Hopper warpgroup's MMA height): each K/V tile serves many queries,
#   without wasting much on the short chunks a continuous batch is full of.
# - head_dim 256 halves the key tile to stay within registers and shared memory.
# - fp32 (exact "ieee" products, no tensor cores) needs far smaller tiles or it spills.
_CONFIGS_16BIT = {
    # (decode, large head): config
    (True, False): LaunchConfig(block_m=16, tile_n=64, num_warps=4, num_stages=3),
    (True, True): LaunchConfig(block_m=16, tile_n=32, num_warps=4, num_stages=2),
    (False, False): LaunchConfig(block_m=64, tile_n=64, num_warps=4, num_stages=3),
    (False, True): LaunchConfig(block_m=64, tile_n=32, num_warps=8, num_stages=2),
}
_CONFIG_FP32_DECODE = LaunchConfig(block_m=16, tile_n=16, num_warps=4, num_stages=2)
_CONFIG_FP32_PREFILL = LaunchConfig(block_m=32, tile_n=16, num_warps=8, num_stages=2)
WRITE_KV_NUM_WARPS = 4
# Split decode keys only while the grid would leave SMs idle: aim for this many programs per SM,
# never below this many keys per segment, and at most this many segments (power of two).
DECODE_PROGRAMS_PER_SM = 2
MIN_KEYS_PER_SEGMENT = 256
MAX_DECODE_SEGMENTS = 16
# Finite start for the running max: a row whose first key tile is entirely masked must not compute
# (-inf) - (-inf).
_NEG_START = tl.constexpr(-1.0e30)
_LOG2E = 1.4426950408889634
# Read as triton.jit does, when the kernels are defined.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        # The interpreter multiplies bfloat16 operands as their raw uint16 bits (Triton 3.9);
        # products of 16-bit values are exact in fp32, so upcasting gives what tensor cores compute.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


# The tile count changes every step; specialising on it would only add compiles.
@triton.jit(do_not_specialize=["num_tiles"])
def _paged_attention_kernel(
    out_ptr, query_ptr, key_cache_ptr, value_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, tile_map_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    scale_log2, num_tiles, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    USE_TILE_MAP: tl.constexpr, NUM_SEGMENTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    if USE_TILE_MAP:
        req = tl.load(tile_map_ptr + tile)
        q_first = tl.load(tile_map_ptr + num_tiles + tile)
    else:
        # Decode launch: program i is request i and its only query.
        req = tile
        q_first = 0
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len

    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    rows = tl.arange(0, BLOCK_M)
    q_tok = q_first + rows // GROUP_P
    g = rows % GROUP_P
    row_valid = (q_tok < query_len) & (g < GROUP)
    head = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM_P)
    d_valid = d < HEAD_DIM
    token = (q_start + q_tok).to(tl.int64)
    q_mask = row_valid[:, None] & d_valid[None, :]
    q = tl.load(query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    q = q.to(key_cache_ptr.dtype.element_ty)
    q_pos = context_len + q_tok

    # Keys up to the tile's last real query; later ones are invisible to every row.
    kv_end = context_len + tl.minimum(q_first + BLOCK_Q, query_len)
    if NUM_SEGMENTS > 1:
        segment = tl.program_id(2)
        tiles_per_segment = ((kv_end + TILE_N - 1) // TILE_N + NUM_SEGMENTS - 1) // NUM_SEGMENTS
        kv_lo = segment * tiles_per_segment * TILE_N
        kv_hi = tl.minimum(kv_end, kv_lo + tiles_per_segment * TILE_N)
    else:
        kv_lo = 0
        kv_hi = kv_end

    m_i = tl.full([BLOCK_M], _NEG_START, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], dtype=tl.float32)
    n = tl.arange(0, TILE_N)
    table_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, TILE_N):
        pos = start + n
        pos_valid = pos < kv_hi
        block = tl.load(table_row + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
        in_block = pos % BLOCK_SIZE
        k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh
        # K as [head_dim, keys], ready to be the right operand of Q @ K^T.
        k = tl.load(key_cache_ptr + k_off[None, :] + d[:, None], mask=pos_valid[None, :] & d_valid[:, None],
                    other=0.0)
        s = _dot(q, k, DOT_PRECISION, DOT_UPCAST) * scale_log2
        visible = (pos[None, :] <= q_pos[:, None]) & pos_valid[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
        v = tl.load(value_cache_ptr + v_off[:, None] + d[None, :], mask=pos_valid[:, None] & d_valid[None, :],
                    other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    if NUM_SEGMENTS > 1:
        part = (token * num_heads + head) * NUM_SEGMENTS + tl.program_id(2)
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_P + d[None, :], acc, mask=q_mask)
    else:
        # Padding rows saw no keys; keep them finite (they are never stored).
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _merge_segments_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, num_heads, stride_ot, stride_oh,
    NUM_SEGMENTS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (token * num_heads + head) * NUM_SEGMENTS + tl.arange(0, NUM_SEGMENTS)
    d = tl.arange(0, HEAD_DIM_P)
    m = tl.load(part_max_ptr + part)
    l = tl.load(part_sum_ptr + part)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_P + d[None, :])
    # Segment 0 always holds key 0, so m_max is a real score and empty segments weigh exp2(-huge) = 0.
    weight = tl.exp2(m - tl.max(m, 0))
    o = tl.sum(acc * weight[:, None], 0) / tl.sum(l * weight, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr, num_kv_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    BLOCK_SIZE: tl.constexpr, HEADS_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    # A negative slot marks a padding token with nowhere to go.
    if slot >= 0:
        h = tl.arange(0, HEADS_P)
        d = tl.arange(0, HEAD_DIM_P)
        mask = (h[:, None] < num_kv_heads) & (d[None, :] < HEAD_DIM)
        block = slot // BLOCK_SIZE
        in_block = slot % BLOCK_SIZE
        k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        tl.store(key_cache_ptr + block * stride_kcb + in_block * stride_kcs + h[:, None] * stride_kch + d[None, :],
                 k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        tl.store(value_cache_ptr + block * stride_vcb + in_block * stride_vcs + h[:, None] * stride_vch + d[None, :],
                 v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@dataclass
class TritonAttentionPlan:
    """Host-side planning of one step, shared by all layers."""

    num_decodes: int
    max_decode_seq_len: int
    # Prefill requests' indices, query lengths and key ends, for building tile maps.
    prefill_reqs: np.ndarray
    prefill_query_lens: np.ndarray
    prefill_seq_lens: np.ndarray
    device: torch.device
    # BLOCK_Q -> ([2, tiles] int32 on the device: request, first query; tile count)
    _tile_maps: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)

    def tile_map(self, block_q: int) -> tuple[torch.Tensor, int]:
        if block_q not in self._tile_maps:
            self._tile_maps[block_q] = self._build_tile_map(block_q)
        return self._tile_maps[block_q]

    def _build_tile_map(self, block_q: int) -> tuple[torch.Tensor, int]:
        counts = -(-self.prefill_query_lens // block_q)
        total = int(counts.sum())
        reqs = np.repeat(self.prefill_reqs, counts)
        first_tile = np.repeat(np.cumsum(counts) - counts, counts)
        q_first = (np.arange(total) - first_tile) * block_q
        # Tiles reading the most keys first, so the longest programs do not start last.
        context = np.repeat(self.prefill_seq_lens - self.prefill_query_lens, counts)
        order = np.argsort(-(context + q_first), kind="stable")
        tiles = np.stack([reqs[order], q_first[order]]).astype(np.int32)
        return torch.from_numpy(tiles).to(self.device), total


def plan(meta: AttentionMetadata) -> TritonAttentionPlan:
    nd = meta.num_decodes
    qsl = np.asarray(meta.query_start_loc_np, dtype=np.int64)
    seq_lens = np.asarray(meta.seq_lens_np, dtype=np.int64)
    reqs = np.arange(nd, meta.num_reqs, dtype=np.int64)
    return TritonAttentionPlan(
        num_decodes=nd,
        max_decode_seq_len=int(seq_lens[:nd].max()) if nd else 0,
        prefill_reqs=reqs,
        prefill_query_lens=qsl[reqs + 1] - qsl[reqs],
        prefill_seq_lens=seq_lens[reqs],
        device=meta.query_start_loc.device,
    )


def _plan_of(meta: AttentionMetadata) -> TritonAttentionPlan:
    if isinstance(meta.backend_plan, TritonAttentionPlan):
        return meta.backend_plan
    p = plan(meta)
    # Keep it for the other layers, unless another backend's plan lives there.
    if meta.backend_plan is None:
        meta.backend_plan = p
    return p


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_segments(num_decodes: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many key segments each decode is split into (a power of two)."""
    programs = num_decodes * num_kv_heads
    if programs == 0:
        return 1
    want = min(-(-DECODE_PROGRAMS_PER_SM * num_sms // programs), max_seq_len // MIN_KEYS_PER_SEGMENT,
               MAX_DECODE_SEGMENTS)
    return 1 << (max(want, 1).bit_length() - 1)


def launch_config(head_dim_p: int, dtype: torch.dtype, decode: bool) -> LaunchConfig:
    if dtype == torch.float32:
        return _CONFIG_FP32_DECODE if decode else _CONFIG_FP32_PREFILL
    return _CONFIGS_16BIT[(decode, head_dim_p > 128)]


def kernel_constexprs(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                      decode: bool, num_segments: int = 1) -> tuple[dict, LaunchConfig]:
    """Compile-time arguments of `_paged_attention_kernel` for one launch, and its launch config."""
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    head_dim_p = max(triton.next_power_of_2(head_dim), 16)
    cfg = launch_config(head_dim_p, dtype, decode)
    return dict(
        GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p, BLOCK_SIZE=block_size,
        BLOCK_Q=max(1, cfg.block_m // group_p), TILE_N=cfg.tile_n, USE_TILE_MAP=not decode,
        NUM_SEGMENTS=num_segments,
        # fp32 inputs get exact fp32 products, as the reference has; 16-bit inputs ignore this.
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        DOT_UPCAST=_INTERPRETED and dtype == torch.bfloat16,
    ), cfg


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, out: torch.Tensor | None = None, *, num_segments: int | None = None) -> torch.Tensor:
    """Attention of `query` [tokens, heads, head_dim] over the paged cache, which already holds
    this step's keys and values. `num_segments` forces the decode key split (default: chosen from
    the batch and the device)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if num_heads % num_kv_heads or key_cache.shape[3] != head_dim:
        raise ValueError(f"query {tuple(query.shape)} does not fit key cache {tuple(key_cache.shape)}")
    if key_cache.shape[1] != meta.block_size:
        raise ValueError(f"cache block size {key_cache.shape[1]} != metadata block size {meta.block_size}")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("KV cache head_dim must be contiguous")
    if meta.block_tables.stride(-1) != 1:
        raise ValueError("block table rows must be contiguous")
    out = torch.empty_like(query) if out is None else out
    if out.stride(-1) != 1:
        raise ValueError("out head_dim must be contiguous")
    if meta.num_tokens == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    p = _plan_of(meta)
    shape = (num_heads, num_kv_heads, head_dim, meta.block_size, key_cache.dtype)
    runtime = dict(
        scale_log2=scale * _LOG2E, num_heads=num_heads,
        stride_qt=query.stride(0), stride_qh=query.stride(1), stride_ot=out.stride(0), stride_oh=out.stride(1),
        stride_kb=key_cache.stride(0), stride_ks=key_cache.stride(1), stride_kh=key_cache.stride(2),
        stride_vb=value_cache.stride(0), stride_vs=value_cache.stride(1), stride_vh=value_cache.stride(2),
        stride_bt=meta.block_tables.stride(0),
    )
    tensors = (out, query, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc)

    nd = p.num_decodes
    if nd:
        if num_segments is None:
            num_segments = 1 if query.device.type != "cuda" else decode_segments(
                nd, num_kv_heads, p.max_decode_seq_len, _num_sms(query.device))
        if num_segments < 1 or num_segments & (num_segments - 1):
            raise ValueError(f"num_segments must be a power of two, got {num_segments}")
        consts, cfg = kernel_constexprs(*shape, decode=True, num_segments=num_segments)
        if num_segments > 1:
            part_acc = torch.empty((nd, num_heads, num_segments, consts["HEAD_DIM_P"]), dtype=torch.float32,
                                   device=query.device)
            part_max = torch.empty((nd, num_heads, num_segments), dtype=torch.float32, device=query.device)
            part_sum = torch.empty_like(part_max)
        else:
            part_acc = part_max = part_sum = out
        # The tile map argument is unused by decode launches; any pointer will do.
        _paged_attention_kernel[(nd, num_kv_heads, num_segments)](
            *tensors, meta.query_start_loc, part_acc, part_max, part_sum, num_tiles=0, **runtime, **consts,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if num_segments > 1:
            _merge_segments_kernel[(nd, num_heads)](
                out, part_acc, part_max, part_sum, num_heads, out.stride(0), out.stride(1),
                NUM_SEGMENTS=num_segments, HEAD_DIM=head_dim, HEAD_DIM_P=consts["HEAD_DIM_P"])

    if len(p.prefill_reqs):
        consts, cfg = kernel_constexprs(*shape, decode=False)
        tile_map, num_tiles = p.tile_map(consts["BLOCK_Q"])
        _paged_attention_kernel[(num_tiles, num_kv_heads, 1)](
            *tensors, tile_map, out, out, out, num_tiles=num_tiles, **runtime, **consts,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store this step's keys/values ([tokens, kv_heads, head_dim]) at their cache slots; tokens
    with a negative slot are skipped."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("KV cache head_dim must be contiguous")
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping, num_kv_heads,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        BLOCK_SIZE=key_cache.shape[1], HEADS_P=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        HEAD_DIM_P=triton.next_power_of_2(head_dim), num_warps=WRITE_KV_NUM_WARPS,
    )


__all__ = ["LaunchConfig", "TritonAttentionPlan", "decode_segments", "kernel_constexprs", "launch_config",
           "paged_attention", "plan", "write_kv"]
