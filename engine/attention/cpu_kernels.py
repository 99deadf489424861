"""Our C++ CPU kernels, compiled on first use with the machine's compiler and cached.

`python -m pdserve.engine.attention.cpu_kernels` builds them ahead of time (the Makefile does,
so tests and servers never wait for a compile). Without a compiler, `available()` is False and
the engine falls back to the plain torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path

import torch

log = logging.getLogger("pdserve.engine.cpu_kernels")

SOURCES = [Path(__file__).parent / "csrc" / "cpu_decode_attention.cpp"]
_lock = threading.Lock()
_state: dict[str, object] = {}


def _build_name() -> str:
    # -march=native code must never be reused on another CPU: key the build on the CPU's flags.
    flags = ""
    try:
        flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    except OSError:
        flags = platform.processor()
    digest = hashlib.sha256((flags + torch.__version__).encode()).hexdigest()[:10]
    return f"pdserve_cpu_kernels_{digest}"


def load(verbose: bool = False) -> bool:
    """Compile (once per machine) and load the kernels; True when they are usable."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        if os.environ.get("PDSERVE_DISABLE_CPU_KERNELS") == "1":
            _state["ok"] = False
            return False
        try:
            from torch.utils.cpp_extension import load as load_extension

            load_extension(
                name=_build_name(),
                sources=[str(s) for s in SOURCES],
                extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
                is_python_module=False,
                verbose=verbose,
            )
            _state["ok"] = True
        except Exception as exc:  # no compiler, no ninja, a build error: run without the kernels
            log.warning("CPU attention kernels unavailable, using the torch path (%s)", str(exc).splitlines()[0])
            _state["ok"] = False
        return bool(_state["ok"])


def available() -> bool:
    return load()


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     out: torch.Tensor) -> None:
    torch.ops.pdserve_cpu.decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, out)


if __name__ == "__main__":
    ok = load(verbose="-v" in sys.argv)
    print("pdserve CPU kernels:", "ready" if ok else "unavailable (torch fallback)")
    sys.exit(0)
