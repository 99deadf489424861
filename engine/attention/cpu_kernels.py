"""Our C++ CPU kernels, compiled on first use with the machine's compiler and cached.

`python -m pdserve.engine.attention.cpu_kernels` builds them ahead of time (the Makefile does,
so tests and servers never wait for a compile). Without a compiler, `available()` is False and
the engine falls back to the plain torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger("pdserve.engine.cpu_kernels")

# One library for all our CPU ops (namespace torch.ops.pdserve_cpu): decode attention, the fused
# elementwise ops of a layer, the KV cache write, the int8 weight-only linear (few rows) and GEMM
# (many rows), the float32 linear on weights in panels, the bfloat16 linear on weights in AMX
# tiles, and the loop that runs a decode step's layers in one call.
SOURCES = [Path(__file__).parent / "csrc" / name for name in ("cpu_decode_attention.cpp", "cpu_fused_ops.cpp",
                                                                "cpu_int8_linear.cpp", "cpu_int8_gemm.cpp",
                                                                "cpu_kv_write.cpp", "cpu_decode_step.cpp",
                                                                "cpu_prefill_attention.cpp", "cpu_panel_linear.cpp",
                                                                "cpu_amx_linear.cpp", "cpu_bf16_pair_linear.cpp",
                                                                "cpu_argmax.cpp", "cpu_int8_panels.cpp")]
# Included by the sources: part of the build's name.
HEADERS = [Path(__file__).parent / "csrc" / name for name in ("cpu_simd.h", "cpu_gemm_tile.h", "cpu_amx.h",
                                                                "cpu_parallel.h", "cpu_step_parts.h")]
# -march=native: the build is this CPU's (and named by it, below). -mprefer-vector-width=512: GCC 12
# auto-vectorizes plain loops (the fused ops' float math, bfloat16 widening and rounding) with 256-bit
# vectors on AVX-512 CPUs unless told otherwise; our intrinsics are what they are either way.
CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp"]
_lock = threading.Lock()
_state: dict[str, object] = {}


def _build_name() -> str:
    """Unique per source, flags, torch version and CPU: -march=native code must never run on another CPU."""
    from pdserve.engine import cpu_info

    digest = hashlib.sha256()
    for part in [cpu_info.identity(), torch.__version__, *CFLAGS, *(s.read_text() for s in SOURCES + HEADERS)]:
        digest.update(part.encode())
    return f"pdserve_cpu_kernels_{digest.hexdigest()[:12]}"


def _library_path() -> Path:
    from pdserve.engine.demo import cache_root

    return cache_root() / "kernels" / f"{_build_name()}.so"


def _build(target: Path, verbose: bool) -> None:
    """Compile in a private folder, then move the library into place atomically.

    torch's own build cache guards a shared folder with a lock file that a killed process leaves
    behind, after which every later load waits forever; a private folder has no such lock.
    """
    from torch.utils.cpp_extension import load as load_extension

    target.parent.mkdir(parents=True, exist_ok=True)
    # The name comes from the target, fixed before the compile: recomputed after it, a source
    # edited meanwhile would name a library that was never built.
    name = target.stem
    with tempfile.TemporaryDirectory(prefix="build-", dir=target.parent) as build_dir:
        # at::parallel_for is inline OpenMP code: without -fopenmp it runs on one thread. torch's
        # wheel ships libgomp.so.1 under that soname, so linking -fopenmp reuses torch's runtime
        # (already loaded) instead of adding a second thread pool.
        load_extension(name=name, sources=[str(s) for s in SOURCES], build_directory=build_dir,
                       extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                       is_python_module=False, verbose=verbose)
        os.replace(Path(build_dir) / f"{name}.so", target)


def load(verbose: bool = False) -> bool:
    """Load the kernels, compiling them first if this machine has no build yet; True when usable."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        if os.environ.get("PDSERVE_DISABLE_CPU_KERNELS") == "1":
            _state["ok"] = False
            return False
        target = _library_path()
        try:
            if target.exists():
                torch.ops.load_library(str(target))
            else:
                log.info("compiling the CPU kernels (once per machine) into %s", target)
                _build(target, verbose)  # loads the library into this process as it builds it
            _state["ok"] = True
        except Exception as exc:  # no compiler, no ninja, a build error: run without the kernels
            log.warning("CPU kernels unavailable, using the torch path (%s)", str(exc).splitlines()[0])
            _state["ok"] = False
        return bool(_state["ok"])


def available() -> bool:
    return load()


def decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     out: torch.Tensor) -> None:
    torch.ops.pdserve_cpu.decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, out)


def decode_attention_amx_scores(head_dim: int, group: int) -> bool:
    """Whether bfloat16 decode attention computes its scores on AMX for this head size and number
    of query heads per KV head (only where the CPU has AMX)."""
    return bool(torch.ops.pdserve_cpu.decode_attention_amx_scores(head_dim, group))


if __name__ == "__main__":
    ok = load(verbose="-v" in sys.argv)
    print("pdserve CPU kernels:", "ready" if ok else "unavailable (torch fallback)")
    sys.exit(0)
