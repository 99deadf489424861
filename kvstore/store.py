"""The KV store's memory: byte blobs under byte keys, least recently used evicted at capacity.

A pure data structure with no sockets and no locks: the service drives it from one thread, so
every put and get is atomic with respect to every other. Values are kept as the objects handed in
(the service hands in views of received ZMQ frames) and are never written to afterwards, so a
value returned by `get` stays exactly what was put even if the key is overwritten later.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Union

Value = Union[bytes, memoryview]


# What one entry costs beyond its key and value bytes: the dict slot, the key object and the
# value's view or bytes header. Charged so that a flood of tiny values cannot hold unbounded
# memory under a small capacity (200,000 one-byte values would otherwise "weigh" 200 KB).
ENTRY_OVERHEAD_BYTES = 256


class ValueTooLarge(ValueError):
    """A single entry is larger than the whole store."""


@dataclass
class StoreStats:
    capacity_bytes: int
    # Bytes charged against the capacity: keys, values and ENTRY_OVERHEAD_BYTES per entry.
    bytes_stored: int = 0
    entries: int = 0
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    puts: int = 0
    refused: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def value_size(value: Value) -> int:
    return value.nbytes if isinstance(value, memoryview) else len(value)


def entry_size(key: bytes, value: Value) -> int:
    """What an entry is charged against the capacity."""
    return len(key) + value_size(value) + ENTRY_OVERHEAD_BYTES


class BlockStore:
    """LRU store bounded by the total size of its entries (key + value + a fixed overhead each).

    Only `put` and `get` refresh a key's recency; `prefix_length` is a question about presence
    and leaves the order alone, so asking never keeps a block alive. Hits and misses count keys
    asked for with `get`.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity must be more than zero bytes, got {capacity_bytes}")
        self._entries: OrderedDict[bytes, Value] = OrderedDict()
        self.stats = StoreStats(capacity_bytes=capacity_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self.stats.capacity_bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def keys(self) -> list[bytes]:
        """Keys from least to most recently used."""
        return list(self._entries)

    def check_fits(self, key: bytes, value: Value) -> None:
        size = entry_size(key, value)
        if size > self.capacity_bytes:
            raise ValueTooLarge(f"a value of {value_size(value)} bytes ({size} bytes with its key and entry "
                                f"overhead) is larger than the store's capacity of {self.capacity_bytes} bytes")

    def put(self, key: bytes, value: Value) -> None:
        try:
            self.check_fits(key, value)
        except ValueTooLarge:
            self.stats.refused += 1
            raise
        stats = self.stats
        size = entry_size(key, value)
        old = self._entries.pop(key, None)
        if old is not None:
            stats.bytes_stored -= entry_size(key, old)
        while stats.bytes_stored + size > stats.capacity_bytes:
            evicted_key, evicted = self._entries.popitem(last=False)
            stats.bytes_stored -= entry_size(evicted_key, evicted)
            stats.evictions += 1
        self._entries[key] = value
        stats.bytes_stored += size
        stats.bytes_in += value_size(value)
        stats.puts += 1
        stats.entries = len(self._entries)

    def put_all(self, keys: list[bytes], values: list[Value]) -> None:
        """Store every pair, or none of them if any value is too large."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        for key, value in zip(keys, values):
            try:
                self.check_fits(key, value)
            except ValueTooLarge:
                self.stats.refused += 1
                raise
        for key, value in zip(keys, values):
            self.put(key, value)

    def get(self, key: bytes) -> Value | None:
        value = self._entries.get(key)
        if value is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        self.stats.bytes_out += value_size(value)
        return value

    def prefix_length(self, keys: list[bytes]) -> int:
        """How many of `keys`, from the first, are all present."""
        for count, key in enumerate(keys):
            if key not in self._entries:
                return count
        return len(keys)
