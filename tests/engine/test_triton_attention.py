"""The Triton paged-attention and KV-store kernels, checked without a GPU.

Two child processes of `triton_cases.py` (next to this file) run side by side: one runs the
kernels in the Triton interpreter on CPU tensors against the torch reference, the other compiles
them with real Triton for sm_90, which catches what the interpreter lets through (globals a kernel
may not read, types the compiler rejects, tiles over the shared-memory limit). Child processes,
because TRITON_INTERPRET must be set or unset before triton is first imported, and other tests in
this process may import it first. Each test here reports one case. On a GPU machine run the
script by hand: see its docstring.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES_SCRIPT = Path(__file__).with_name("triton_cases.py")


def _load_cases_module():
    # Importing the script only defines its cases; triton is imported inside the child process.
    spec = importlib.util.spec_from_file_location("pdserve_triton_cases", CASES_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


_cases = _load_cases_module()
INTERPRETED_CASES = _cases.case_names(large=False)
COMPILE_CASES = _cases.compile_case_names()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """Both runs' results by mode, then case name."""
    folder = tmp_path_factory.mktemp("triton")
    modes = {
        "interpreted": (["--device", "cpu"], dict(os.environ, TRITON_INTERPRET="1", PYTHONSAFEPATH="1")),
        "compiled": (["--compile"], {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
                                     "PYTHONSAFEPATH": "1"}),
    }
    procs = {}
    for mode, (flags, env) in modes.items():
        command = [sys.executable, str(CASES_SCRIPT), *flags, "--json", str(folder / f"{mode}.json")]
        procs[mode] = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    by_mode = {}
    try:
        for mode, proc in procs.items():
            output, _ = proc.communicate(timeout=300)
            path = folder / f"{mode}.json"
            if not path.exists():
                pytest.fail(f"{CASES_SCRIPT.name} ({mode}) exited {proc.returncode} without results:\n"
                            f"{output[-6000:]}")
            by_mode[mode] = {r["name"]: r for r in json.loads(path.read_text())}
            failed = [name for name, r in by_mode[mode].items() if not r["ok"]]
            assert (proc.returncode != 0) == bool(failed), f"{mode}: exit status {proc.returncode}, failed {failed}"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return by_mode


def _check(results: dict[str, dict], name: str) -> None:
    assert name in results, f"case {name} produced no result"
    result = results[name]
    assert result["ok"], f"{name}: {result.get('message', result)}"


@pytest.mark.parametrize("name", INTERPRETED_CASES)
def test_interpreted(results, name):
    _check(results["interpreted"], name)


@pytest.mark.parametrize("name", COMPILE_CASES)
def test_compiles_for_sm90(results, name):
    _check(results["compiled"], name)


def test_cases_cover_the_brief():
    """The interpreted cases span the shapes the kernel must handle."""
    cases = _cases
    small = [c for c in cases.ATTENTION_CASES if not c.large]
    assert {c.block_size for c in small} >= {8, 16, 32}
    assert {c.dtype for c in small} == {"float32", "float16", "bfloat16"}
    assert any(c.num_heads == c.num_kv_heads for c in small) and any(c.num_heads > c.num_kv_heads for c in small)
    assert any((c.num_heads // c.num_kv_heads) & (c.num_heads // c.num_kv_heads - 1) for c in small)  # group of 3
    assert {c.head_dim for c in small} >= {32, 64, 80, 256}
    reqs = [r for c in small for r in c.reqs]
    assert any(q == 1 for q, _ in reqs) and any(q > 1 and ctx == 0 for q, ctx in reqs)
    assert any(q > 1 and ctx > 0 for q, ctx in reqs)
    assert any((q + ctx) % 16 for q, ctx in reqs)
    assert any(c.num_segments and c.num_segments > 1 for c in small)
