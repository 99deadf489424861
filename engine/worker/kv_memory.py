"""The KV cache's memory: zero from the start, without writing every byte at start-up, and
mapped ahead of use while the engine is idle.

`torch.zeros` of a CPU cache writes all of it: the default 4 GiB took 0.9 s of every engine's
start on a 2-core EPYC, and made the whole cache resident before any request. Pages of a fresh
anonymous mapping are zero already, and the kernel maps them only when first written. On GPU,
`torch.zeros` is one fast fill.

But a first write costs a page fault, and the block pool hands out never-used blocks before it
reuses freed ones (they keep the prefix cache's contents), so a fresh server faults on nearly every
block it writes until it has gone once through the whole cache. On a Zen 5 KVM guest a huge page's
first write ran at 0.4-5.7 GB/s: a float32 SmolLM2 prefill of 2048 tokens (94 MiB of keys and
values) spent a tenth of its step in faults, and `write_kv` of 3 MiB took 5.2-5.7 ms on fresh pages
against 0.2 ms on mapped ones. `CacheWarmer` maps the pages ahead with MADV_POPULATE_WRITE (Linux
5.14+), a slice at a time, while the engine has nothing to run (engine_core_proc.py); the kernel
maps them as a write would, without changing a byte, so blocks in use, or being filled by a KV
transfer, are safe. Measured there: the whole 4 GiB in 30 s of idle time (7-10 s without the
engine's pauses between slices); 16 streams of float32 SmolLM2 (256-token prompts, 64 tokens out)
1.08x faster on the mapped cache.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import math
import mmap
import os
import sys
import time

import torch

log = logging.getLogger("pdserve.engine.kv_memory")

MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module does not name it before 3.13
WARM_CHUNK = 2 << 20  # bytes per madvise call: one huge page, 0.4-5 ms on the guest above
# Mapping stops while less than this much memory would be left (of the machine's, or of the
# container's limit): a cache sized near the limit stays lazy rather than have an idle engine
# pushed into swap or killed.
WARM_RESERVE = 512 << 20


def zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor for a KV cache; on CPU, backed by pages the kernel zeroes on first touch."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # Huge pages where the kernel allows them: a 2 MiB fault instead of 512 small ones.
        try:
            memory.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    # The tensor holds the mapping (through the buffer it was made from) for as long as it lives.
    return torch.frombuffer(memory, dtype=dtype).view(shape)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup's "max" means no limit


def mem_available() -> int | None:
    """The machine's MemAvailable in bytes (/proc/meminfo), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_headroom() -> int | None:
    """Bytes this process may still make resident: the machine's MemAvailable and, under a cgroup
    v2 memory limit (a Kubernetes pod's), what is left of the limit; None where neither is known."""
    available = mem_available()
    known = [] if available is None else [available]
    limit, current = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is not None and current is not None:
        known.append(limit - current)
    return min(known) if known else None


def _madvise() -> "ctypes._CFuncPtr | None":
    name = ctypes.util.find_library("c")
    try:
        fn = ctypes.CDLL(name, use_errno=True).madvise if name else None
    except (OSError, AttributeError):
        return None
    if fn is not None:
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    return fn


class CacheWarmer:
    """Maps the pages of CPU cache tensors ahead of their first write, `run` by `run`.

    Each tensor (all of one size) is walked as `parts` equal contiguous parts (a layer's keys and values), all parts
    a chunk at a time from their starts, so the blocks the pool hands out first (the lowest ids) are
    mapped first in every layer. Where pages cannot be mapped ahead (a GPU cache, a kernel without
    MADV_POPULATE_WRITE, PDSERVE_KV_WARM=0) there is nothing to do: `done` from the start. Mapping
    stops, `done` too, once less than WARM_RESERVE of memory would be left."""

    def __init__(self, tensors: list[torch.Tensor], parts: int = 2) -> None:
        cpu = [t for t in tensors if t.device.type == "cpu" and t.numel() > 0]
        sizes = {t.numel() * t.element_size() for t in cpu}
        if len(sizes) > 1 or any(size % parts for size in sizes):
            raise ValueError(f"CacheWarmer: the tensors must be of one size, in {parts} equal parts")
        self._part = sizes.pop() // parts if sizes else 0
        self._starts = [t.data_ptr() + i * self._part for t in cpu for i in range(parts)]
        self._total = self._part * len(self._starts)
        self._offset = 0  # within each part: everything before it is mapped in every part
        self._index = 0  # the parts mapped from _offset on: the next chunk is part _index's
        # MADV_POPULATE_WRITE's number means something else, or nothing, outside Linux.
        wanted = self._total and sys.platform.startswith("linux") and os.environ.get("PDSERVE_KV_WARM", "1") != "0"
        self._madvise = _madvise() if wanted else None
        if self._madvise is None:
            self._offset = self._part

    @property
    def done(self) -> bool:
        return self._offset >= self._part

    def fraction(self) -> float:
        """How much of the cache is mapped (1.0 also when no more will be: see the class doc)."""
        if self.done:
            return 1.0
        chunk = min(WARM_CHUNK, self._part - self._offset)
        return (self._offset * len(self._starts) + self._index * chunk) / self._total

    def run(self, seconds: float) -> float:
        """Map chunks, one part's at a time, until `seconds` have passed (at least one chunk) or all
        is mapped; returns fraction()."""
        deadline = time.monotonic() + seconds
        while not self.done:
            headroom = memory_headroom()
            if headroom is not None and headroom < WARM_RESERVE + WARM_CHUNK:
                log.info("KV cache mapped ahead up to %.0f%%: %d MiB of memory left", 100 * self.fraction(),
                         headroom >> 20)
                self._offset = self._part
                break
            length = min(WARM_CHUNK, self._part - self._offset)
            at = self._starts[self._index] + self._offset
            aligned = at - at % mmap.PAGESIZE  # madvise takes whole pages
            if self._madvise(aligned, length + at - aligned, MADV_POPULATE_WRITE) != 0:
                err = ctypes.get_errno()
                # EINVAL: a kernel before 5.14. ENOMEM: the memory is not there; the first writes
                # will find out as they always did. Either way nothing more is tried.
                (log.debug if err == errno.EINVAL else log.warning)(
                    "KV cache pages not mapped ahead: %s", os.strerror(err))
                self._offset = self._part
                break
            self._index += 1
            if self._index == len(self._starts):
                self._index = 0
                self._offset += length
            if time.monotonic() >= deadline:
                break
        return self.fraction()
