"""The CPU attention paths against the token-by-token definition of paged attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.engine.attention import cpu_attention, cpu_kernels, torch_paged
from pdserve.engine.attention.metadata import AttentionMetadata


def make_case(query_lens: list[int], context_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
              block_size: int, dtype: torch.dtype, seed: int):
    """Random cache and a batch (decodes first) whose requests own shuffled, scattered blocks."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for q, c in zip(query_lens, context_lens)]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 5
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_needed)
    tables = np.zeros((len(seq_lens), max_blocks), dtype=np.int32)
    cursor = 0
    for r, n in enumerate(blocks_needed):
        tables[r, :n] = perm[cursor:cursor + n]
        cursor += n
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int64)
    slots = []
    for r, (q, s) in enumerate(zip(query_lens, seq_lens)):
        for pos in range(s - q, s):
            slots.append(int(tables[r, pos // block_size]) * block_size + pos % block_size)
    meta = AttentionMetadata(
        num_reqs=len(seq_lens), num_decodes=sum(1 for q in query_lens if q == 1), num_tokens=num_tokens,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), block_size=block_size,
        query_start_loc=torch.from_numpy(qsl.astype(np.int32)), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.from_numpy(tables), slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc_np=qsl, seq_lens_np=np.array(seq_lens, dtype=np.int32), block_tables_np=tables,
    )
    return query, key_cache, value_cache, meta


CASES = [
    # (query_lens, context_lens, heads, kv_heads, head_dim, block_size)
    ([1, 1, 1, 1], [5, 16, 17, 40], 8, 2, 32, 16),
    ([1, 1, 7, 20], [63, 1, 0, 9], 4, 4, 64, 8),
    ([1, 1, 1, 5], [100, 3, 31, 12], 6, 3, 16, 32),
    ([1] * 9, [0, 1, 2, 15, 16, 17, 33, 64, 129], 12, 4, 64, 16),
    # Every query-head group the vector loop is compiled for (1-8; 5-8 here) and a group past it
    # (9: the portable loop), with head sizes whose value slices differ (96: 12 AVX2 vectors).
    ([1, 1, 1], [19, 33, 70], 10, 2, 16, 16),
    ([1, 1], [40, 17], 12, 2, 256, 16),
    ([1, 1, 1], [3, 48, 65], 14, 2, 96, 16),
    ([1, 1], [31, 90], 16, 2, 64, 16),
    ([1, 1], [25, 64], 18, 2, 64, 16),
    # Twelve query heads per KV head and a head size of 40: the kernel's portable loop, not SIMD.
    ([1, 1, 1], [20, 7, 50], 12, 1, 40, 16),
    # Prefills longer than the prefill kernel's blocks of queries and keys, with and without
    # earlier context, beside decodes; SmolLM2's heads (9 over 3 KV heads of 64).
    ([1, 150, 70], [10, 0, 130], 9, 3, 64, 16),
    ([200], [0], 4, 2, 32, 16),
    ([1, 65, 3], [3, 40, 0], 4, 1, 128, 16),
    ([30, 12], [5, 0], 4, 2, 24, 16),  # a head size of 24: not whole vectors, so SDPA takes it
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["torch", "cpu_kernel"])
def test_paged_attention_matches_definition_fp32(case, backend):
    query_lens, context_lens, heads, kv_heads, dim, bs = case
    query, kc, vc, meta = make_case(query_lens, context_lens, heads, kv_heads, dim, bs, torch.float32, seed=len(query_lens))
    scale = dim ** -0.5
    expected = torch_paged.naive_paged_attention(query, kc, vc, meta.query_start_loc_np.tolist(), meta.seq_lens_np.tolist(),
                                                 meta.block_tables, scale)
    if backend == "torch":
        meta.backend_plan = torch_paged.plan(meta)
        got = torch_paged.paged_attention(query, kc, vc, meta, scale)
    else:
        assert cpu_kernels.available(), "the C++ CPU kernel failed to build on this machine"
        meta.backend_plan = cpu_attention.plan(meta)
        got = cpu_attention.paged_attention(query, kc, vc, meta, scale)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.fixture
def sdpa_calls(monkeypatch) -> list[int]:
    """One entry per call of torch's SDPA from the attention paths, for this test."""
    calls: list[int] = []
    sdpa = torch_paged.F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch_paged.F, "scaled_dot_product_attention", counted)
    return calls


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("query_lens, context_lens", [([1] * 6, [7, 16, 30, 50, 1, 90]), ([1, 1, 90, 33], [7, 16, 0, 70])])
def test_cpu_kernel_low_precision_close_to_fp32(dtype, query_lens, context_lens, amx, monkeypatch, sdpa_calls):
    """Both prefill paths (our kernel; SDPA, which bfloat16 takes on CPUs with AMX) against the definition."""
    assert cpu_kernels.available()
    monkeypatch.setattr(cpu_attention, "_amx_bf16", lambda: amx)
    query, kc, vc, meta = make_case(query_lens, context_lens, 8, 2, 64, 16, dtype, seed=3)
    scale = 64 ** -0.5
    expected = torch_paged.naive_paged_attention(query, kc, vc, meta.query_start_loc_np.tolist(), meta.seq_lens_np.tolist(),
                                                 meta.block_tables, scale)
    meta.backend_plan = cpu_attention.plan(meta)
    got = cpu_attention.paged_attention(query, kc, vc, meta, scale)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)
    prefills = sum(1 for q in query_lens if q > 1)
    assert len(sdpa_calls) == (prefills if amx and dtype == torch.bfloat16 else 0)


def test_a_step_with_a_chunk_mask_past_the_limit_keeps_our_kernel(monkeypatch, sdpa_calls):
    monkeypatch.setattr(cpu_attention, "_amx_bf16", lambda: True)
    query, kc, vc, meta = make_case([1, 90, 33], [7, 0, 70], 8, 2, 64, 16, torch.bfloat16, seed=4)
    meta.backend_plan = cpu_attention.plan(meta)
    cpu_attention.paged_attention(query, kc, vc, meta, 64 ** -0.5)
    assert len(sdpa_calls) == 2  # both prefills: the 33-token chunk's mask (33 x 103) is within the limit
    monkeypatch.setattr(cpu_attention, "SDPA_MASK_MAX_ELEMENTS", 33 * 103 - 1)
    expected = torch_paged.naive_paged_attention(query, kc, vc, meta.query_start_loc_np.tolist(),
                                                 meta.seq_lens_np.tolist(), meta.block_tables, 64 ** -0.5)
    got = cpu_attention.paged_attention(query, kc, vc, meta, 64 ** -0.5)
    assert len(sdpa_calls) == 2  # no more: the whole step went to our kernel
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def test_prefills_take_sdpa_only_in_bfloat16_on_amx():
    assert cpu_attention.prefill_through_sdpa(torch.bfloat16, amx_bf16=True)
    assert not cpu_attention.prefill_through_sdpa(torch.bfloat16, amx_bf16=False)
    assert not cpu_attention.prefill_through_sdpa(torch.float32, amx_bf16=True)  # our kernel is faster there
    assert not cpu_attention.prefill_through_sdpa(torch.float16, amx_bf16=True)
    # a chunk after many cached tokens: SDPA would widen its boolean mask to floats
    limit = cpu_attention.SDPA_MASK_MAX_ELEMENTS
    assert cpu_attention.prefill_through_sdpa(torch.bfloat16, amx_bf16=True, mask_elements=limit)
    assert not cpu_attention.prefill_through_sdpa(torch.bfloat16, amx_bf16=True, mask_elements=limit + 1)


def test_write_kv_places_tokens_at_their_slots():
    kc = torch.zeros(4, 4, 2, 8)
    vc = torch.zeros(4, 4, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    torch_paged.write_kv(key, value, kc, vc, torch.tensor([13, 2, 5]))
    assert torch.equal(kc[3, 1], key[0]) and torch.equal(kc[0, 2], key[1]) and torch.equal(vc[1, 1], value[2])
    assert int((kc != 0).any(-1).any(-1).sum()) == 3


def test_prefill_kernel_refuses_what_it_cannot_compute():
    assert cpu_kernels.available()
    q, kv = torch.randn(5, 4, 32), torch.randn(5, 2, 32)
    with pytest.raises(RuntimeError, match="fewer keys"):
        torch.ops.pdserve_cpu.prefill_attention(q, kv[:3], kv[:3], 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="do not share"):
        torch.ops.pdserve_cpu.prefill_attention(torch.randn(5, 3, 32), kv, kv, 1.0, torch.empty(5, 3, 32))
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.pdserve_cpu.prefill_attention(q, kv.bfloat16(), kv.bfloat16(), 1.0, torch.empty_like(q))
    with pytest.raises(RuntimeError, match="side by side"):
        # heads 64 floats apart, not 32: a head_dim slice of wider rows
        torch.ops.pdserve_cpu.prefill_attention(torch.randn(5, 4, 64)[..., :32], kv, kv, 1.0, torch.empty_like(q))


def reference_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, tables: torch.Tensor,
                     lens: list[int], scale: float) -> torch.Tensor:
    """One query per request against its cached positions, in float64 from the same inputs."""
    bs, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = query.shape[1] // kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for r, n in enumerate(lens):
        slots = [int(tables[r, p // bs]) * bs + p % bs for p in range(n)]
        k = key_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)  # [n, heads, D]
        v = value_cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
        probs = torch.softmax(torch.einsum("hd,nhd->hn", query[r].double(), k) * scale, dim=-1)
        out[r] = torch.einsum("hn,nhd->hd", probs, v)
    return out


def _nan_padded_case(heads: int, kv_heads: int, head_dim: int, block_size: int, lens: list[int], dtype: torch.dtype,
                     seed: int):
    """A cache whose slots no request uses hold NaN, requests on shuffled blocks, and query rows that are
    a wider buffer's first rows, strided as the runner passes them."""
    g = torch.Generator().manual_seed(seed)
    per = [-(-n // block_size) for n in lens]
    num_blocks = sum(per) + 3
    key_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"), dtype=dtype)
    value_cache = key_cache.clone()
    tables = torch.zeros(len(lens), max(per), dtype=torch.int32)
    order = torch.randperm(num_blocks, generator=g).tolist()
    for r, n in enumerate(lens):
        for p in range(n):
            b = order.pop() if p % block_size == 0 else int(tables[r, p // block_size])
            tables[r, p // block_size] = b
            key_cache[b, p % block_size] = torch.randn(kv_heads, head_dim, generator=g).to(dtype)
            value_cache[b, p % block_size] = torch.randn(kv_heads, head_dim, generator=g).to(dtype)
    query = (2 * torch.randn(len(lens) + 2, heads, head_dim, generator=g)).to(dtype)[: len(lens)]
    return query, key_cache, value_cache, tables


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size, lens", [
    (12, 4, 64, 16, [1, 15, 16, 17, 33, 257]),  # the bench model's groups of three
    (9, 3, 64, 16, [2, 31, 64, 130]),  # SmolLM2's
    (8, 8, 32, 8, [5, 8, 9, 40]),  # blocks shorter than a tile of 16 key rows
    (16, 2, 128, 32, [31, 32, 33, 100]),  # two tiles per block, groups of eight
    (6, 3, 96, 24, [23, 24, 25, 70]),  # blocks that end part way into their second tile
    (4, 1, 256, 16, [20, 50]),  # a head too wide for the tiles: the vector loop
])
def test_bfloat16_decode_attention_against_float64(heads, kv_heads, head_dim, block_size, lens):
    """bfloat16 decode attention (its scores on AMX on CPUs that have it) within a bfloat16 rounding
    of the float64 result. The slots no request uses hold NaN: a tile of 16 key rows reads past a
    request's last position, and nothing from there may reach an answer."""
    assert cpu_kernels.available()
    query, key_cache, value_cache, tables = _nan_padded_case(heads, kv_heads, head_dim, block_size, lens,
                                                             torch.bfloat16, seed=head_dim + block_size)
    out = torch.empty(len(lens), heads, head_dim, dtype=torch.bfloat16)
    scale = head_dim ** -0.5
    cpu_kernels.decode_attention(query, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32), scale,
                                 out)
    expected = reference_decode(query, key_cache, value_cache, tables, lens, scale)
    torch.testing.assert_close(out.double(), expected, rtol=4e-3, atol=1e-5)


def test_bfloat16_scores_run_on_amx_where_the_cpu_has_it():
    from pdserve.engine.config import cpu_has_amx_bf16

    assert cpu_kernels.available()
    amx = cpu_has_amx_bf16()
    for head_dim, group in [(64, 3), (32, 1), (128, 8), (96, 2)]:
        assert cpu_kernels.decode_attention_amx_scores(head_dim, group) == amx
    # A head too wide for the tiles, a group with no vector loop, a head of no whole tiles.
    for head_dim, group in [(256, 4), (64, 9), (40, 2)]:
        assert not cpu_kernels.decode_attention_amx_scores(head_dim, group)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [
    (12, 4, 64, 16), (9, 3, 64, 16), (8, 8, 32, 8), (4, 2, 16, 16), (16, 2, 64, 32),
    # Groups of two heads of 32: in float32 two vectors a head, where GCC once contracted the score's
    # multiply and add into an FMA in one loop and not in the other.
    (4, 2, 32, 16),
])
def test_a_requests_decode_attention_does_not_depend_on_its_batch_or_the_threads(dtype, heads, kv_heads, head_dim,
                                                                                  block_size):
    """A request's attention is the same to the bit alone and in a batch of nine, on one, two or three
    threads. The kernel splits a batch with requests enough for its threads by KV heads of requests
    (each block read in order) and a smaller one by (request, KV head): both loops must give a head the
    same arithmetic, or a request decoded alone would answer otherwise than in a batch."""
    assert cpu_kernels.available()
    lens = [1, 15, 16, 17, 33, 64, 130, 257, 5]
    query, kc, vc, tables = _nan_padded_case(heads, kv_heads, head_dim, block_size, lens, dtype, seed=head_dim)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    threads = torch.get_num_threads()

    def attend(rows: slice, num_threads: int) -> torch.Tensor:
        out = torch.empty(query[rows].shape, dtype=dtype)
        torch.set_num_threads(num_threads)
        try:
            cpu_kernels.decode_attention(query[rows], kc, vc, tables[rows], seq_lens[rows], scale, out)
        finally:
            torch.set_num_threads(threads)
        return out

    batch = attend(slice(None), 2)
    tolerance = dict(rtol=4e-3, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(batch.double(), reference_decode(query, kc, vc, tables, lens, scale), **tolerance)
    for num_threads in (1, 3):
        assert torch.equal(attend(slice(None), num_threads), batch)
    for r in range(len(lens)):
        assert torch.equal(attend(slice(r, r + 1), 2), batch[r:r + 1]), f"request {r} alone"
    # Two requests on one thread: the split by KV heads; on two threads, by (request, KV head).
    assert torch.equal(attend(slice(6, 8), 1), batch[6:8])
    assert torch.equal(attend(slice(6, 8), 2), batch[6:8])
