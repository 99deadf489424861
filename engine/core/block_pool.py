"""The pool of KV cache blocks: allocation, reference counts, and the prefix-cache index."""

from __future__ import annotations

from typing import Iterable

from pdserve.engine.core.block_events import BlockEvents
from pdserve.engine.core.kv_cache_utils import BlockHash, FreeBlockQueue, KVCacheBlock


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # One block per hash: a second request computing the same prefix concurrently keeps its
        # own uncached copy, which is freed normally.
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        # Index changes for the coordinator; None (no cost) unless an engine reports its load.
        self.events: BlockEvents | None = None

    def enable_events(self) -> BlockEvents:
        if self.events is None:
            self.events = BlockEvents()
        return self.events

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` blocks from the free queue, evicting their cached contents (LRU first)."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash = None

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop blocks from the prefix-cache index: their hashes were set before their KV was written,
        and now it never will be."""
        for block in blocks:
            self._evict(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero join the tail in this order,
        so the caller lists the blocks it wants evicted first."""
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise RuntimeError(f"{block} freed more often than taken")
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash], start: int,
                          end: int) -> None:
        """Index blocks[start:end] by their hashes so later requests with the same prefix reuse them."""
        if not self.enable_caching:
            return
        events = self.events
        for block, block_hash in zip(blocks[start:end], block_hashes[start:end]):
            if block.block_hash is None:
                block.block_hash = block_hash
                if self.cached.setdefault(block_hash, block) is block and events is not None:
                    events.stored(block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Only possible while no request holds a block."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True
