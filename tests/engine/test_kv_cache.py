"""The block pool and KV cache manager as plain data structures."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.core.block_pool import BlockPool
from pdserve.engine.core.kv_cache_manager import KVCacheManager
from pdserve.engine.core.kv_cache_utils import hash_block_tokens, make_block_hasher
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams

BS = 4


def make_request(req_id: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=8), eos_token_id=0, cache_salt=salt,
                   block_hasher=make_block_hasher(BS))


def in_use(pool: BlockPool) -> int:
    return sum(1 for b in pool.blocks if b.ref_cnt > 0)


def test_hashes_chain_prefixes():
    a = hash_block_tokens([1, 2, 3, 4, 5, 6, 7, 8], BS)
    b = hash_block_tokens([1, 2, 3, 4, 9, 9, 9, 9], BS)
    c = hash_block_tokens([0, 2, 3, 4, 5, 6, 7, 8], BS)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert c[0] != a[0] and c[1] != a[1]  # same tokens after a different prefix hash differently
    assert hash_block_tokens([1, 2, 3, 4], BS, salt="tenant")[0] != a[0]
    assert hash_block_tokens([1, 2, 3], BS) == []


def test_request_hashes_grow_with_generated_tokens():
    req = make_request("r", [1, 2, 3, 4, 5, 6])
    assert len(req.block_hashes) == 1
    req.append_output_token_ids([7])
    assert len(req.block_hashes) == 1
    req.append_output_token_ids([8])
    assert req.block_hashes == hash_block_tokens([1, 2, 3, 4, 5, 6, 7, 8], BS)


def test_free_queue_evicts_least_recently_freed_first():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks([blocks[2], blocks[0]])
    pool.free_blocks([blocks[3]])
    assert [b.block_id for b in pool.free_queue] == [2, 0, 3]
    pool.touch([blocks[0]])  # a cache hit takes a free block out of the middle
    assert [b.block_id for b in pool.free_queue] == [2, 3]
    assert pool.get_new_blocks(1)[0].block_id == 2
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)


def test_prefix_hit_reuses_blocks_and_eviction_forgets_them():
    kv = KVCacheManager(num_blocks=6, block_size=BS, max_model_len=64, enable_caching=True)
    first = make_request("a", list(range(10, 20)))  # 2 full blocks + 2 tokens
    assert kv.allocate_slots(first, first.num_tokens) is not None
    first.num_computed_tokens = first.num_tokens
    kv.free(first)

    second = make_request("b", list(range(10, 18)) + [99, 98, 97])
    hits, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 8
    assert hits[0] is kv.pool.get_cached_block(second.block_hashes[0])
    assert [b.block_hash for b in hits] == second.block_hashes[:2]
    assert kv.allocate_slots(second, second.num_tokens - num_hit, num_hit, hits) is not None
    assert kv.get_block_ids("b")[:2] == [b.block_id for b in hits]
    assert kv.prefix_cache_hits == 8 and kv.prefix_cache_queries == 11

    # Taking every free block evicts the cached ones that no request holds any more.
    kv.free(second)
    kv.pool.get_new_blocks(6)
    assert kv.pool.cached == {}


def test_full_prompt_hit_still_leaves_a_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=BS, max_model_len=64, enable_caching=True)
    req = make_request("a", list(range(8)))
    kv.allocate_slots(req, 8)
    kv.free(req)
    again = make_request("b", list(range(8)))
    _, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 4  # the last block is recomputed so its last position yields logits


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS, max_model_len=64, enable_caching=True)
    req = make_request("a", list(range(20)))
    assert kv.allocate_slots(req, 20) is None
    assert kv.pool.num_free_blocks == 3 and kv.get_block_ids("a") == []


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 7), st.integers(1, 40)),
                min_size=1, max_size=60))
def test_blocks_in_use_plus_free_always_equal_total(ops):
    kv = KVCacheManager(num_blocks=16, block_size=BS, max_model_len=256, enable_caching=True)
    live: dict[int, Request] = {}
    for op, slot, n in ops:
        if op == "add" and slot not in live:
            # Shared prefixes make prefix hits (and shared ref counts) common.
            req = make_request(f"r{slot}-{len(ops)}-{n}", [slot % 3] * 8 + list(range(n)))
            hits, num_hit = kv.get_computed_blocks(req)
            if kv.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits) is not None:
                req.num_computed_tokens = req.num_tokens
                live[slot] = req
            else:
                kv.free(req)
        elif op == "grow" and slot in live:
            req = live[slot]
            req.append_output_token_ids([n])
            if kv.allocate_slots(req, 1) is not None:
                req.num_computed_tokens += 1
        elif op == "free" and slot in live:
            kv.free(live.pop(slot))
        assert in_use(kv.pool) + kv.pool.num_free_blocks == 16
        held = sum(len(kv.req_to_blocks.get(r.request_id, [])) for r in live.values())
        assert sum(b.ref_cnt for b in kv.pool.blocks) == held
    for req in live.values():
        kv.free(req)
    assert kv.pool.num_free_blocks == 16 and in_use(kv.pool) == 0
