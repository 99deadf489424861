"""How many CPU cores this process may use. Torch-free: `pdserve up` sizes its engines' thread
shares with it without loading torch."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores in this process's affinity mask (what a container's cpuset allows), else all of them."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
