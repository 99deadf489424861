"""The KV store's memory on its own: LRU order, capacity, refusals, counters; and the wire header checks."""

from __future__ import annotations

import random

import msgspec
import pytest

from pdserve.kvstore import protocol
from pdserve.kvstore.protocol import Limits, ProtocolError, RequestHeader
from pdserve.kvstore.store import ENTRY_OVERHEAD_BYTES, BlockStore, ValueTooLarge, entry_size

# What a one-byte key with a value of n bytes is charged.
def cost(n: int) -> int:
    return 1 + n + ENTRY_OVERHEAD_BYTES


def test_get_refreshes_so_the_least_recently_used_goes_first():
    store = BlockStore(capacity_bytes=3 * cost(100))
    for key in (b"a", b"b", b"c"):
        store.put(key, bytes(100))
    assert store.get(b"a") is not None  # a is now the most recent: b is the oldest
    store.put(b"d", bytes(100))
    assert b"b" not in store and {b"a", b"c", b"d"} == set(store.keys())
    assert store.keys() == [b"c", b"a", b"d"]
    assert store.stats.evictions == 1


def test_put_refreshes_and_an_overwrite_replaces_the_size():
    store = BlockStore(capacity_bytes=3 * cost(100))
    store.put(b"a", bytes(100))
    store.put(b"b", bytes(100))
    store.put(b"a", bytes(150))  # overwrite: a is now the most recent
    assert store.keys() == [b"b", b"a"] and store.stats.bytes_stored == cost(100) + cost(150)
    assert store.stats.entries == 2
    store.put(b"c", bytes(200))  # over the capacity: b goes, a stays
    assert store.keys() == [b"a", b"c"] and store.stats.bytes_stored == cost(150) + cost(200)
    assert bytes(store.get(b"a")) == bytes(150)


def test_prefix_length_asks_without_refreshing():
    store = BlockStore(capacity_bytes=2 * cost(100))
    store.put(b"a", bytes(100))
    store.put(b"b", bytes(100))
    assert store.prefix_length([b"a", b"b", b"x", b"a"]) == 2
    assert store.prefix_length([b"x", b"a"]) == 0
    assert store.prefix_length([]) == 0
    store.put(b"c", bytes(100))  # a was only asked about, so it is still the oldest
    assert b"a" not in store and store.stats.hits == 0 and store.stats.misses == 0


def test_capacity_holds_under_a_stream_of_puts_oldest_first():
    capacity = 10_000
    store = BlockStore(capacity_bytes=capacity)
    rng = random.Random(3)
    written: list[tuple[bytes, int]] = []
    for index in range(2000):
        key, size = f"k{index}".encode(), rng.randrange(1, 3000)
        store.put(key, bytes([index % 256]) * size)
        written.append((key, size))
        assert store.stats.bytes_stored <= capacity
        assert store.stats.bytes_stored == sum(entry_size(k, store._entries[k]) for k in store.keys())
        # What is left is exactly the newest puts that fit, in order: nothing younger was evicted.
        kept, total = [], 0
        for k, s in reversed(written):
            if total + entry_size(k, bytes(s)) > capacity:
                break
            kept.append(k)
            total += entry_size(k, bytes(s))
        assert store.keys() == kept[::-1]
    assert store.stats.entries == len(store) and store.stats.evictions == 2000 - len(store)
    assert store.stats.puts == 2000 and store.stats.bytes_in == sum(s for _, s in written)


def test_a_value_larger_than_the_store_is_refused_and_changes_nothing():
    capacity = cost(100)
    store = BlockStore(capacity_bytes=capacity)
    store.put(b"a", bytes(60))
    with pytest.raises(ValueTooLarge, match=f"101 bytes .* is larger than the store's capacity of {capacity}"):
        store.put(b"b", bytes(101))
    with pytest.raises(ValueTooLarge):  # the key counts too
        store.put(b"bb", bytes(100))
    store.put(b"e", bytes(100))  # exactly the capacity fits (after evicting a)
    assert store.keys() == [b"e"] and store.stats.refused == 2
    # A batch with one oversize value stores none of it.
    with pytest.raises(ValueTooLarge):
        store.put_all([b"x", b"y"], [bytes(10), bytes(500)])
    assert store.keys() == [b"e"] and store.stats.refused == 3
    with pytest.raises(ValueError, match="capacity must be more than zero"):
        BlockStore(capacity_bytes=0)


def test_counters():
    capacity = cost(300) + cost(200) + cost(100)
    store = BlockStore(capacity_bytes=capacity)
    store.put_all([b"a", b"b"], [bytes(300), memoryview(bytes(200))])
    assert store.get(b"a") is not None and store.get(b"b") is not None and store.get(b"zz") is None
    store.put(b"c", bytes(600))  # evicts a (b was read more recently)
    stats = store.stats.as_dict()
    assert stats == {"capacity_bytes": capacity, "bytes_stored": cost(200) + cost(600), "entries": 2,
                     "hits": 2, "misses": 1,
                     "bytes_in": 1100, "bytes_out": 500, "evictions": 1, "puts": 3, "refused": 0}


def test_stored_values_are_never_aliased_by_a_later_overwrite():
    store = BlockStore(capacity_bytes=10 * cost(10))
    store.put(b"a", b"\x01" * 10)
    first = store.get(b"a")
    store.put(b"a", b"\x02" * 10)
    assert bytes(first) == b"\x01" * 10 and bytes(store.get(b"a")) == b"\x02" * 10


def test_keys_count_toward_the_capacity_so_tiny_values_cannot_pile_up():
    # The attack: a 1 KiB store kept 200,000 one-KB keys, as only value bytes were counted.
    store = BlockStore(capacity_bytes=2**10)
    for i in range(2_000):
        with pytest.raises(ValueTooLarge):  # each entry alone is over 1 KiB
            store.put(f"{i:06d}".encode() + bytes(1000), b"")
    assert len(store) == 0 and store.stats.refused == 2_000 and store.stats.bytes_stored == 0
    store = BlockStore(capacity_bytes=64 * 2**10)
    for i in range(20_000):
        store.put(f"{i:06d}".encode() + bytes(500), b"x")
    held = sum(len(k) + 1 for k in store.keys())
    assert store.stats.bytes_stored <= 64 * 2**10 and held < 64 * 2**10
    assert len(store) == 64 * 2**10 // entry_size(bytes(506), b"x")


# --- header checks (the service answers each ProtocolError with an error reply) ---

LIMITS = Limits(max_frame_bytes=1000, max_keys=4)


def header(*fields) -> bytes:
    return msgspec.msgpack.encode(list(fields))


@pytest.mark.parametrize("frame, sizes, message", [
    (header("drop", 1, "m", [b"k"]), [], "unknown op 'drop'"),
    (b"\xc1not msgpack", [], "not msgpack"),
    (header("get", "one", "m", []), [], "malformed request header"),
    (msgspec.msgpack.encode({"op": "get"}), [], "malformed request header"),
    (header("get", 1, "m", ["text-key"]), [], "malformed request header"),
    (header("put", 1, "m", [b"a", b"b"]), [10], "put needs one value frame per key: 2 keys, 1 value frames"),
    (header("get", 1, "m", [b"a"]), [10], "get takes no value frames, got 1"),
    (header("put", 1, "m", [b"a"]), [1001], "value 0 is 1001 bytes, over the frame limit of 1000"),
    (header("get", 1, "m", [b"k"] * 5), [], "5 keys in one request exceed the limit of 4"),
    (header("get", 1, "m", [b"k" * 2000]), [], "key of 2000 bytes"),
    (header("get", 1, "n" * 2000, [b"k"]), [], "namespace longer than"),
])
def test_bad_headers_are_refused_with_a_reason(frame, sizes, message):
    with pytest.raises(ProtocolError, match=message):
        protocol.decode_request(frame, sizes, LIMITS)


def test_good_header_round_trip_and_request_id_of_a_bad_one():
    frame = protocol.encode(RequestHeader("put", 9, "m", [b"a", b"b"]))
    assert protocol.decode_request(frame, [1000, 0], LIMITS) == RequestHeader("put", 9, "m", [b"a", b"b"])
    assert protocol.guess_request_id(header("drop", 42, "m", [])) == 42
    assert protocol.guess_request_id(b"\xc1") == 0 and protocol.guess_request_id(header("x")) == 0


def test_store_keys_of_different_namespaces_never_collide():
    assert protocol.store_key("ab", b"c") != protocol.store_key("a", b"bc")
    assert protocol.store_key("m", b"k") == protocol.store_key("m", b"k")
