"""Blocks of the paged KV cache, their LRU free list, and prefix hashing.

A block's hash chains its parent's hash with its own token ids (and, for the first block, any
extra keys such as a cache salt), so equal hashes mean equal prefixes. The hash is a SHA-256
digest: stable across processes and machines, since the KV store shares blocks between pods.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import TYPE_CHECKING, Callable, Iterator

if TYPE_CHECKING:
    from pdserve.engine.request import Request

BlockHash = bytes
ROOT_HASH: BlockHash = b"pdserve-kv-v1"


def hash_block(parent: BlockHash | None, token_ids: list[int] | tuple[int, ...], extra: bytes = b"") -> BlockHash:
    h = hashlib.sha256(parent or ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(extra)
    return h.digest()


def hash_block_tokens(token_ids: list[int], block_size: int, parent: BlockHash | None = None,
                      salt: str | None = None) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (a prefix that starts a sequence when parent is None)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = salt.encode() if (salt and parent is None) else b""
        parent = hash_block(parent, token_ids[start:start + block_size], extra)
        hashes.append(parent)
    return hashes


def make_block_hasher(block_size: int) -> Callable[["Request"], list[BlockHash]]:
    """Return a function giving the hashes of a request's full blocks not hashed yet."""

    def new_block_hashes(request: "Request") -> list[BlockHash]:
        known = len(request.block_hashes)
        start = known * block_size
        tokens = request.all_token_ids
        if len(tokens) - start < block_size:
            return []
        parent = request.block_hashes[-1] if known else None
        salt = request.cache_salt if known == 0 else None
        return hash_block_tokens(tokens[start:len(tokens) - (len(tokens) - start) % block_size], block_size,
                                 parent, salt)

    return new_block_hashes


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        # Links of the free list; None while the block is in use.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, least recently freed first.

    A list would make removing a block from the middle O(n); that happens on every prefix-cache
    hit on a free block, so the links live in the blocks themselves.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free
