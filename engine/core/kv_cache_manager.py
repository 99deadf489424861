"""Per-request block bookkeeping on top of the block pool: prefix hits, allocation, freeing."""

from __future__ import annotations

from pdserve.engine.core.block_pool import BlockPool
from pdserve.engine.core.kv_cache_utils import KVCacheBlock
from pdserve.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens, cumulative
        self.prefix_cache_hits = 0  # tokens, cumulative

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached blocks that starts the request, and how many tokens it covers.

        At least one token is always left to compute: the last position's logits are needed.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request`; None when the pool is too full.

        Nothing changes when it returns None, so the caller may preempt and retry.
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_after = min(num_computed + num_new_tokens, self.max_model_len)
        num_new_blocks = cdiv(num_tokens_after, self.block_size) - len(blocks) - len(new_computed_blocks)
        # Hit blocks that sit in the free queue stop being allocatable once touched.
        num_hits_on_free = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_hits_on_free:
            return None
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_new_blocks, 0))
        blocks.extend(new_blocks)
        if self.enable_caching and not delay_cache_blocks:
            self.cache_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the request's full blocks up to `num_tokens` (their KV is written this step)."""
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full > start:
            self.pool.cache_full_blocks(self.req_to_blocks[request.request_id], request.block_hashes, start, num_full)
            self.num_cached_blocks[request.request_id] = num_full

    def free(self, request: Request, num_written_tokens: int | None = None) -> None:
        """Release the request's blocks. The tail goes first into the free queue, so it is
        evicted before the prefix that other requests are more likely to share.

        `num_written_tokens`: how many tokens' KV the request really has, when its blocks were
        allocated (and so hashed) for a step it will not run in; full blocks past it are unhashed.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        if num_written_tokens is not None:
            self.pool.uncache_blocks(blocks[num_written_tokens // self.block_size:])
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
