"""Views of paged KV cache blocks as raw bytes, in the one order every transport agrees on.

A layer's cache is a tensor [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]. The wire
order of a transfer of blocks B with heads [h0, h1) is: for each layer, for K then V, for each
block of B in the order given, the block's [block_size, h1 - h0, head_dim] slice. With all heads,
each block is one contiguous run of memory, and consecutive block ids merge into one run, so a
transfer of whole blocks needs no copy at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch


@dataclass(frozen=True)
class KVLayout:
    """What must match between two engines for their blocks to be interchangeable."""

    num_layers: int
    block_size: int
    num_kv_heads: int  # on this rank
    head_dim: int
    dtype: str

    @classmethod
    def of(cls, kv_caches: list[torch.Tensor]) -> "KVLayout":
        _, _, block_size, heads, head_dim = kv_caches[0].shape
        return cls(len(kv_caches), block_size, heads, head_dim, str(kv_caches[0].dtype).removeprefix("torch."))

    def block_bytes(self, num_heads: int | None = None) -> int:
        """Bytes of one block's K or V slice in one layer."""
        elem = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.block_size * (self.num_kv_heads if num_heads is None else num_heads) * self.head_dim * elem

    def transfer_bytes(self, num_blocks: int, num_heads: int | None = None) -> int:
        return self.num_layers * 2 * num_blocks * self.block_bytes(num_heads)

    def compatible(self, other: "KVLayout") -> str | None:
        """None when blocks can move between the two; else why not."""
        for name in ("num_layers", "block_size", "head_dim", "dtype"):
            if getattr(self, name) != getattr(other, name):
                return f"{name} differs: {getattr(self, name)} here, {getattr(other, name)} there"
        return None


def runs(block_ids: list[int]) -> Iterator[tuple[int, int, int]]:
    """(position in the list, first id, count) of each run of consecutive ids."""
    i = 0
    while i < len(block_ids):
        j = i + 1
        while j < len(block_ids) and block_ids[j] == block_ids[j - 1] + 1:
            j += 1
        yield i, block_ids[i], j - i
        i = j


def as_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor (bf16 included, which numpy cannot hold)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def whole_block_views(kv_caches: list[torch.Tensor], block_ids: list[int]) -> list[memoryview]:
    """Zero-copy byte views of the blocks, all heads, in wire order (runs merged).

    One view per K or V plane, then memoryview slices of it: slicing costs ~0.1 µs where a tensor
    view per run costs ~10 µs, which at 1024 scattered blocks x 64 planes was most of a transfer.
    """
    block_bytes = kv_caches[0][0, 0].numel() * kv_caches[0].element_size()
    spans = [(first * block_bytes, (first + count) * block_bytes) for _, first, count in runs(block_ids)]
    views = []
    for layer in kv_caches:
        for kv in (0, 1):
            plane = as_bytes(layer[kv])
            views.extend(plane[start:end] for start, end in spans)
    return views


def head_slice(kv_caches: list[torch.Tensor], layer: int, kv: int, block_ids: list[int], h0: int, h1: int
               ) -> torch.Tensor:
    """A contiguous copy of heads [h0, h1) of the blocks in one layer's K or V."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[layer].device)
    return kv_caches[layer][kv].index_select(0, index)[:, :, h0:h1, :].contiguous()


def write_head_slice(kv_caches: list[torch.Tensor], layer: int, kv: int, block_ids: list[int], h0: int, h1: int,
                     data: torch.Tensor) -> None:
    """Store `data` [len(block_ids), block_size, h1 - h0, head_dim] into heads [h0, h1) of the blocks."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[layer].device)
    target = kv_caches[layer][kv]
    target[index, :, h0:h1, :] = data.to(target.device)
