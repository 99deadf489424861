"""The engine on its GPU attention backend, without a GPU: greedy parity with transformers.

On cuda the model runner attends with the Triton kernels (triton_paged.plan / paged_attention /
write_kv). Here the same backend runs in the Triton interpreter on CPU tensors inside the whole
engine: the scheduler's mixed decode/prefill batches, chunked prompts continuing over cached
context, q/k/v as the model lays them out, and the per-step plan shared by every layer. A child
process each (tests/gpu/gpu_checks.py), because TRITON_INTERPRET must be set before triton is
first imported. The compiled kernels on a real GPU are tests/gpu/test_gpu.py's job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECKS = Path(__file__).resolve().parent.parent / "gpu" / "gpu_checks.py"
# Each decode step of every layer runs interpreted (seconds each): 4 new tokens still give every
# prompt 3 decode steps over its cached context, and the short prompts decode beside the long
# one's prefill chunks.
MAX_NEW_TOKENS = 4
# run -> (model, extra arguments, why it is here). A step budget of 48 tokens chunks the 130-token
# prompt and mixes decodes with prefills that continue over cached context.
RUNS = {
    "llama_2layers": ("llama_2layers", [], "GQA group 2, head_dim 32, 2 layers sharing each step's plan"),
    "tied": ("tied", [], "GQA group 3 (padded to 4 rows), head_dim 16, tied embeddings"),
    # Decodes alone (4 at a time while the other 4 prompts wait, then the last ones' tails) replay
    # the step captured per batch size (engine/worker/decode_graphs.py), recorded by gpu_checks'
    # ReplayGraph: the kernels read padded rows (slot -1, one key in block 0) and a key split
    # planned for max_model_len from the static buffers, as a CUDA graph's replay does.
    "llama_2layers graphs": ("llama_2layers", ["--graphs", "--max-num-seqs", "4"],
                             "decode steps replayed from graphs captured at batch sizes 1, 2 and 4"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[int, str, dict | None]]:
    """name -> (exit status, output, results) of one child per model, run side by side."""
    folder = tmp_path_factory.mktemp("triton_engine")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONSAFEPATH="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    procs = {}
    for name, (model, extra, _) in RUNS.items():
        # Each run its own models folder: two children building one checkpoint at once would race.
        command = [sys.executable, str(CHECKS), "engine", "--model", model, "--triton", "--device", "cpu",
                   "--max-new-tokens", str(MAX_NEW_TOKENS), "--max-num-batched-tokens", "48", *extra,
                   "--models-dir", str(folder / name.replace(" ", "-")), "--json", str(folder / f"{name}.json")]
        procs[name] = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = {}
    try:
        for name, proc in procs.items():
            output, _ = proc.communicate(timeout=300)
            path = folder / f"{name}.json"
            out[name] = (proc.returncode, output, json.loads(path.read_text()) if path.exists() else None)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


@pytest.mark.parametrize("name", sorted(RUNS))
def test_engine_on_triton_backend_matches_transformers(runs, name):
    code, output, result = runs[name]
    assert result is not None, f"{CHECKS.name} wrote no results (exit {code}):\n{output[-6000:]}"
    assert result["backend"] == "triton (interpreted)"
    assert result["matched"] == [MAX_NEW_TOKENS] * len(result["prompt_lengths"]), (
        f"{name} ({RUNS[name][2]}): leading tokens matching transformers per prompt of lengths "
        f"{result['prompt_lengths']}: {result['matched']}")
    if "--graphs" in RUNS[name][1]:
        assert result["decode_graph_replays"] > 0, "no decode step replayed a captured graph"
    else:
        assert result["decode_graph_replays"] == 0
    assert code == 0
