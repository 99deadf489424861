"""The KV cache starts zero without being written at start-up: resident memory follows use."""

from __future__ import annotations

import gc

import pytest
import torch

from pdserve.engine.worker.kv_memory import zeroed_cache


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
