"""What /proc/cpuinfo says of this CPU (Linux; elsewhere only what `platform` knows).

Compiled kernels (-march=native), the dtype probe's verdicts and benchmark reports all depend on
the CPU: one reading of it, so they key on the same thing.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path


@functools.cache
def _fields() -> dict[str, str]:
    """The first processor's `name: value` lines."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the end of the first processor's block; the others repeat it
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return fields


def model_name() -> str:
    return _fields().get("model name") or platform.processor()


def vendor() -> str:
    """"GenuineIntel", "AuthenticAMD", ...; empty where there is no /proc/cpuinfo."""
    return _fields().get("vendor_id", "")


def flags() -> frozenset[str]:
    """The CPU feature flags; empty where there is no /proc/cpuinfo."""
    return frozenset(_fields().get("flags", "").split())


def identity() -> str:
    """The model name and feature flags, as one string: what code built or timed here depends on."""
    return f"{model_name()} | {' '.join(sorted(flags()))}"


# Where sysfs does not say (not Linux, or a container hiding it): a large server CPU's share.
DEFAULT_LAST_LEVEL_CACHE = 32 << 20


@functools.cache
def last_level_cache_bytes() -> int:
    """Bytes of the first processor's largest-level cache, from sysfs ("32768K"); a default elsewhere."""
    best_level, best_bytes = 0, 0
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = int((index / "level").read_text())
            size = _size_bytes((index / "size").read_text().strip())
        except (OSError, ValueError):
            continue
        if level > best_level or (level == best_level and size > best_bytes):
            best_level, best_bytes = level, size
    return best_bytes or DEFAULT_LAST_LEVEL_CACHE


def _size_bytes(text: str) -> int:
    """sysfs's cache size: a number with an optional K, M or G."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1].upper() in units:
        return int(text[:-1]) * units[text[-1].upper()]
    return int(text)
