"""The KV cache starts zero without being written at start-up: resident memory follows use, and an
idle engine maps the rest ahead of its first writes."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import mmap
import os
import sys

import pytest
import torch

from pdserve.engine.worker.kv_memory import WARM_CHUNK, CacheWarmer, zeroed_cache


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_cache_is_zero_and_keeps_what_is_written(dtype):
    cache = zeroed_cache((2, 64, 16, 3, 8), dtype, "cpu")
    assert cache.shape == (2, 64, 16, 3, 8) and cache.dtype == dtype and cache.is_contiguous()
    assert not cache.any()
    gc.collect()  # only the tensor refers to the mapping now
    cache[1, 7].fill_(2.5)
    assert cache[1, 7].eq(2.5).all() and cache.sum().item() == 2.5 * 16 * 3 * 8


def test_a_large_cache_is_not_resident_until_written():
    size = 512 << 20
    before = resident_bytes()
    cache = zeroed_cache((2, size // (2 * 16 * 4 * 64 * 4), 16, 4, 64), torch.float32, "cpu")
    assert cache.numel() * 4 == size
    assert resident_bytes() - before < size // 8
    cache[0, :64].fill_(1.0)  # the blocks a few requests would use
    assert resident_bytes() - before < size // 4
    assert cache[0, :64].all() and not cache[1].any()


def test_an_empty_cache_is_a_plain_tensor():
    assert zeroed_cache((2, 0, 16, 1, 8), torch.float32, "cpu").numel() == 0


def mapped_pages(t: torch.Tensor, start: int, length: int) -> int:
    """How many pages of t's bytes [start, start + length) are mapped (mincore(2))."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    at = t.data_ptr() + start
    assert at % page == 0 and length % page == 0
    vec = ctypes.create_string_buffer(length // page)
    assert libc.mincore(at, length, vec) == 0, os.strerror(ctypes.get_errno())
    return sum(b & 1 for b in vec.raw)


def populate_supported() -> bool:
    probe = zeroed_cache((2, 1, 4096), torch.uint8, "cpu")
    CacheWarmer([probe]).run(1.0)
    return mapped_pages(probe, 0, 8192) == 2


needs_populate = pytest.mark.skipif(not sys.platform.startswith("linux") or not populate_supported(),
                                    reason="MADV_POPULATE_WRITE needs Linux 5.14 or later")


@needs_populate
def test_the_warmer_maps_every_layer_from_its_lowest_blocks_without_changing_a_byte():
    """Keys and values of every layer are mapped a chunk at a time from block 0 (the blocks the pool
    hands out first), and blocks already written, or being written, keep their contents."""
    layers = [zeroed_cache((2, 256, 16, 4, 64), torch.float32, "cpu") for _ in range(3)]  # 4 MiB a part
    part = layers[0][0].numel() * 4
    layers[1][1, 3].fill_(7.0)  # blocks in use: the values of one in the first chunk
    layers[2][0, 200].fill_(-0.0)  # keys in the second: even the sign of a zero is kept
    warmer = CacheWarmer(layers)
    assert warmer.fraction() == 0.0 and not warmer.done
    for _ in range(6):  # one chunk of each of the six parts
        warmer.run(0.0)
    assert warmer.fraction() == pytest.approx(0.5)
    chunk = WARM_CHUNK // mmap.PAGESIZE
    for t in layers:
        for start in (0, part):
            assert mapped_pages(t, start, WARM_CHUNK) == chunk
    assert mapped_pages(layers[0], part - WARM_CHUNK, WARM_CHUNK) == 0  # the second chunks wait
    assert mapped_pages(layers[0], 2 * part - WARM_CHUNK, WARM_CHUNK) == 0
    while warmer.run(10.0) < 1.0:
        pass
    assert warmer.done and warmer.fraction() == 1.0
    for t in layers:
        assert mapped_pages(t, 0, 2 * part) == 2 * part // mmap.PAGESIZE
    assert layers[1][1, 3].eq(7.0).all() and layers[1].sum() == 7.0 * 16 * 4 * 64
    assert torch.signbit(layers[2][0, 200]).all() and not layers[0].any()


def test_nothing_is_mapped_ahead_when_turned_off_with_no_cpu_cache_or_off_linux(monkeypatch):
    cache = zeroed_cache((2, 256, 16, 4, 64), torch.float32, "cpu")
    monkeypatch.setenv("PDSERVE_KV_WARM", "0")
    off = CacheWarmer([cache])
    assert off.done and off.fraction() == 1.0 and off.run(1.0) == 1.0
    assert mapped_pages(cache, 0, cache.numel() * 4) == 0
    monkeypatch.delenv("PDSERVE_KV_WARM")
    assert CacheWarmer([]).done
    monkeypatch.setattr(sys, "platform", "darwin")  # madvise's number 23 is Linux's alone
    assert CacheWarmer([cache]).done and mapped_pages(cache, 0, cache.numel() * 4) == 0


def test_the_layers_must_be_of_one_size():
    with pytest.raises(ValueError, match="one size"):
        CacheWarmer([zeroed_cache((2, 4, 16), torch.float32, "cpu"), zeroed_cache((2, 8, 16), torch.float32, "cpu")])


@needs_populate
def test_mapping_stops_short_of_running_the_memory_out(monkeypatch):
    """With less than the reserve left (the machine's, or a pod's limit), the rest stays lazy."""
    from pdserve.engine.worker import kv_memory

    cache = zeroed_cache((2, 256, 16, 4, 64), torch.float32, "cpu")
    left = [kv_memory.WARM_RESERVE + 3 * WARM_CHUNK]

    def headroom() -> int:
        left[0] -= WARM_CHUNK  # each chunk mapped takes its share
        return left[0]

    monkeypatch.setattr(kv_memory, "memory_headroom", headroom)
    warmer = CacheWarmer([cache])
    assert warmer.run(10.0) == 1.0 and warmer.done
    assert mapped_pages(cache, 0, cache.numel() * 4) == 2 * WARM_CHUNK // mmap.PAGESIZE


def test_the_headroom_is_the_machines_available_memory_at_most():
    from pdserve.engine.worker.kv_memory import memory_headroom

    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert 0 < memory_headroom() <= total
