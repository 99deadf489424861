"""What /proc/cpuinfo says of this CPU (Linux; elsewhere only what `platform` knows).

Compiled kernels (-march=native), the dtype probe's verdicts and benchmark reports all depend on
the CPU: one reading of it, so they key on the same thing.
"""

from __future__ import annotations

import functools
import platform


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
