"""The Triton paged-attention and KV-store kernels against the torch reference, on the CPU.

The kernels run in the Triton interpreter, which must be switched on before triton is first
imported; other tests in this process may already have imported it, so every case runs in one
child process (`triton_cases.py`, next to this file) and each test here reports one case's result.
On a GPU machine run that script by hand: see its docstring.
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


CASE_NAMES = _load_cases_module().case_names(large=False)


@pytest.fixture(scope="module")
def interpreted_results(tmp_path_factory) -> dict[str, dict]:
    results_file = tmp_path_factory.mktemp("triton") / "results.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONSAFEPATH="1")
    proc = subprocess.run([sys.executable, str(CASES_SCRIPT), "--device", "cpu", "--json", str(results_file)],
                          env=env, capture_output=True, text=True, timeout=300)
    if not results_file.exists():
        pytest.fail(f"{CASES_SCRIPT.name} exited {proc.returncode} without results:\n{proc.stdout[-4000:]}\n"
                    f"{proc.stderr[-4000:]}")
    results = {r["name"]: r for r in json.loads(results_file.read_text())}
    failed = [name for name, r in results.items() if not r["ok"]]
    assert (proc.returncode != 0) == bool(failed), f"exit status {proc.returncode} but failed cases {failed}"
    return results


@pytest.mark.parametrize("name", CASE_NAMES)
def test_case(interpreted_results, name):
    assert name in interpreted_results, f"case {name} produced no result"
    result = interpreted_results[name]
    assert result["ok"], f"{name}: {result.get('message', result)}"


def test_cases_cover_the_brief():
    """The interpreted cases span the shapes the kernel must handle."""
    cases = _load_cases_module()
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
