"""A decode step's layers in one C++ call (engine/model/decode_call.py) computes, to the bit, what
the layer-by-layer modules compute, for every matmul path a weight can take, and steps it cannot
run go through the modules.

Each model forward is run twice, the loop allowed and then not (the KV writes of the second run
store the same values at the same slots); the hidden states must be equal, not close.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model import decode_call, layers, linear_tuning, llama
from pdserve.engine.model.layers import packing_supported

pytestmark = pytest.mark.skipif(os.environ.get("PDSERVE_DISABLE_CPU_KERNELS") == "1",
                                reason="CPU kernels disabled by PDSERVE_DISABLE_CPU_KERNELS=1")


class Twice:
    """Wraps LlamaModel.forward: each call runs with the loop allowed, then with it refused, and
    records whether the loop ran and whether both results are the same bits."""

    def __init__(self, monkeypatch) -> None:
        self.one_call_steps = 0
        self.one_call_rows: list[int] = []  # the rows of each step the loop ran
        self.module_steps = 0
        self.mismatches: list[str] = []
        original = llama.LlamaModel.forward
        ran = decode_call.DecodeCall.run

        def run(plan, hidden, *args, **kwargs):
            self.one_call_steps += 1
            self.one_call_rows.append(hidden.shape[0])
            return ran(plan, hidden, *args, **kwargs)

        def forward(model, input_ids, positions, kv_caches, meta, attend, write_kv):
            before = self.one_call_steps
            monkeypatch.setenv("PDSERVE_DECODE_CALL", "1")
            first = original(model, input_ids, positions, kv_caches, meta, attend, write_kv).clone()
            if self.one_call_steps == before:
                self.module_steps += 1
                return first
            monkeypatch.setenv("PDSERVE_DECODE_CALL", "0")
            second = original(model, input_ids, positions, kv_caches, meta, attend, write_kv)
            monkeypatch.setenv("PDSERVE_DECODE_CALL", "1")
            if not torch.equal(first, second):
                self.mismatches.append(f"{meta.num_tokens} rows: max difference {(first - second).abs().max()}")
            return second

        monkeypatch.setattr(decode_call.DecodeCall, "run", run)
        monkeypatch.setattr(llama.LlamaModel, "forward", forward)


def prompts(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 4000) for _ in range(rng.randrange(3, 40))]} for _ in range(count)]


def set_paths(llm: LLM, path: str | None) -> torch.nn.Module:
    model = llm.engine.client.engine_core.executor.worker.runner.model
    for module in model.modules():
        if hasattr(module, "one_row"):
            module.one_row = path
    decode_call.forget(model)
    return model


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def generate_twice(llm: LLM, monkeypatch, seeds: tuple[int, int]) -> Twice:
    """One request (one row per decode step), then five (several rows), every forward run twice."""
    twice = Twice(monkeypatch)
    llm.generate(prompts(1, seed=seeds[0]), GREEDY)
    llm.generate(prompts(5, seed=seeds[1]), GREEDY)
    return twice


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "llama3_rope"])
@pytest.mark.parametrize("path", [None, "packed", "kernel", "kernel_serial"])
def test_one_call_equals_the_modules_for_every_single_row_path(model_dir, monkeypatch, name, path):
    if path == "packed" and not packing_supported(torch.float32):
        pytest.skip("no oneDNN weight packing in this torch")
    llm = LLM(model_dir(name), dtype="float32", num_kv_blocks=128)
    try:
        set_paths(llm, path)
        twice = generate_twice(llm, monkeypatch, seeds=(1, 2))  # several rows: packed or F.linear by the count
    finally:
        llm.shutdown()
    assert twice.one_call_steps >= 20 and twice.module_steps >= 2  # prefills run the modules
    assert twice.mismatches == []


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("packing", ["panels", "onednn"])
def test_one_call_equals_the_modules_for_each_float_packing(model_dir, monkeypatch, float_packing, name, packing):
    """Weights in panels (layers.float_packing's pick on AVX2 CPUs) or in oneDNN's layout (on
    AVX-512 ones), whichever this CPU would pick: the loop runs each as the modules do, for one
    row (the packing as one_row's path) and several, qwen2's q/k/v biases included."""
    float_packing(packing)
    llm = LLM(model_dir(name), dtype="float32", num_kv_blocks=128)
    try:
        model = set_paths(llm, "packed")
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert decode_call.linear_path(qkv, 1) == ("panels" if packing == "panels" else "packed")
        twice = generate_twice(llm, monkeypatch, seeds=(1, 2))
    finally:
        llm.shutdown()
    assert twice.one_call_steps >= 20 and twice.module_steps >= 2
    assert twice.mismatches == []


@pytest.mark.parametrize("path", ["tuned", "kernel"])
def test_one_call_in_bfloat16_equals_the_modules(model_dir, monkeypatch, path):
    if path == "kernel" and not linear_tuning.bf16_kernel_available():
        pytest.skip("no AVX512-BF16 or AVX2 here: the bfloat16 kernel is never chosen (test_linear_tuning checks it)")
    llm = LLM(model_dir("qwen2"), dtype="bfloat16", num_kv_blocks=128)
    try:
        if path == "kernel":
            set_paths(llm, "kernel")
        twice = Twice(monkeypatch)
        llm.generate(prompts(1, seed=3), GREEDY)
        llm.generate(prompts(3, seed=4), GREEDY)
    finally:
        llm.shutdown()
    assert twice.one_call_steps >= 20 and twice.mismatches == []


@pytest.mark.parametrize("packing", ["amx", "pairs", "onednn"])
def test_one_call_in_bfloat16_equals_the_modules_for_each_bf16_packing(model_dir, monkeypatch, packing):
    """Weights in AMX tiles (layers.bf16_packing's pick where the CPU has AMX), in pair groups (its
    pick with AVX512-BF16 but no AMX) or in oneDNN's layout: the loop runs each as the modules do,
    for one row and several, qwen2's biases included."""
    if packing == "amx" and not layers.amx_supported():
        pytest.skip("no AMX here: bfloat16 weights cannot go in AMX tiles")
    if packing == "pairs" and not layers.pair_groups_supported():
        pytest.skip("no AVX512-BF16 here: bfloat16 weights cannot go in pair groups")
    if packing == "onednn" and (not packing_supported(torch.bfloat16) or layers.bf16_is_emulated()):
        pytest.skip("bfloat16 weights do not take oneDNN's packing on this CPU")
    monkeypatch.setenv("PDSERVE_BF16_PACKING", packing)
    llm = LLM(model_dir("qwen2"), dtype="bfloat16", num_kv_blocks=128)
    try:
        model = set_paths(llm, "packed")
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert decode_call.linear_path(qkv, 1) == decode_call.linear_path(qkv, 16) == packing.replace("onednn", "packed")
        twice = generate_twice(llm, monkeypatch, seeds=(3, 4))
    finally:
        llm.shutdown()
    assert twice.one_call_steps >= 20 and twice.module_steps >= 2
    assert twice.mismatches == []


@pytest.mark.parametrize("name, method", [("llama", "int8"), ("qwen2", "q8_0"), ("tied", "q8_0")])
def test_one_call_with_int8_weights_equals_the_modules(model_dir, monkeypatch, name, method):
    """int8 layers (a scale per row or per 32 weights, qwen2's q/k/v biases inside them) run our
    int8 kernel in the loop as in the modules, and past its rows our int8 GEMM; past the GEMM's
    rows (the float32 slabs of AVX2 CPUs) the modules take the step."""
    from pdserve.engine.model import quant

    llm = LLM(model_dir(name), dtype="float32", num_kv_blocks=256, quantization=method)
    try:
        model = llm.engine.client.engine_core.executor.worker.runner.model
        int8_layers = [m.quantized for m in model.modules() if getattr(m, "quantized", None) is not None]
        twice = Twice(monkeypatch)
        llm.generate(prompts(1, seed=5), GREEDY)
        llm.generate(prompts(3, seed=6), GREEDY)
        one_call = twice.one_call_steps
        big = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        rows = max(q.register_rows for q in int8_layers) + 2
        llm.generate(prompts(rows, seed=7), big)  # decode steps of `rows` rows: the GEMM, in the loop
        gemm_rows = twice.one_call_rows[one_call:]
        for q in int8_layers:  # as on an AVX2 CPU, with a limit small enough to reach
            q.gemm_max_rows = rows - 1
        decode_call.forget(model)
        before = twice.one_call_steps
        outputs = llm.generate(prompts(rows, seed=8), big)
        slab_rows = twice.one_call_rows[before:]
    finally:
        llm.shutdown()
    assert one_call >= 20 and twice.mismatches == []
    assert all(not q.kernel_takes(rows) and q.gemm_takes(rows - 1) == quant.gemm_available() for q in int8_layers)
    assert (gemm_rows.count(rows) >= 2) == quant.gemm_available()
    assert rows not in slab_rows  # every step past the GEMM's rows ran the modules
    assert all(len(o.outputs[0].token_ids) == 3 for o in outputs)


@pytest.mark.parametrize("dtype, method", [("bfloat16", "q8_0"), ("float16", "int8")])
def test_int8_weights_on_float32_kernels_in_a_half_model_go_through_the_modules(model_dir, monkeypatch, dtype,
                                                                                method):
    """Our int8 kernels but the AMX one take float32 rows: in a half model (group scales in bf16,
    any int8 in float16) the modules convert around them."""
    llm = LLM(model_dir("llama"), dtype=dtype, num_kv_blocks=128, quantization=method)
    try:
        twice = Twice(monkeypatch)
        outputs = llm.generate(prompts(2, seed=5), GREEDY)
    finally:
        llm.shutdown()
    assert twice.one_call_steps == 0 and twice.module_steps >= 12  # every decode step too
    assert all(len(o.outputs[0].token_ids) == 12 for o in outputs)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_one_call_with_int8_weights_in_amx_tiles_equals_the_modules(model_dir, monkeypatch, name):
    """A bfloat16 model's int8 weights (a scale per row) in AMX tiles: the loop multiplies them as
    the modules do, for one row and several, qwen2's biases inside the layers included."""
    from pdserve.engine.model import quant

    if not quant.amx_available():
        pytest.skip("no AMX here: int8 weights do not go in AMX tiles")
    llm = LLM(model_dir(name), dtype="bfloat16", num_kv_blocks=128, quantization="int8")
    try:
        model = llm.engine.client.engine_core.executor.worker.runner.model
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert qkv.quantized.tiles is not None and decode_call.linear_path(qkv, 16) == "amx_int8"
        twice = generate_twice(llm, monkeypatch, seeds=(5, 6))
    finally:
        llm.shutdown()
    assert twice.one_call_steps >= 20 and twice.module_steps >= 2
    assert twice.mismatches == []


def test_pdserve_decode_call_0_turns_the_loop_off(model_dir, monkeypatch):
    llm = LLM(model_dir("llama"), dtype="float32", num_kv_blocks=128)
    try:
        monkeypatch.setenv("PDSERVE_DECODE_CALL", "0")
        runner = llm.engine.client.engine_core.executor.worker.runner
        calls = []
        monkeypatch.setattr(decode_call.DecodeCall, "run", lambda *a, **k: calls.append(a))
        outputs = llm.generate(prompts(2, seed=5), GREEDY)
        assert calls == [] and getattr(runner.model.model, "_decode_call", None) is None
    finally:
        llm.shutdown()
    assert all(len(o.outputs[0].token_ids) == 12 for o in outputs)


@pytest.mark.parametrize("packing", ["panels", "onednn"])
def test_linear_path_mirrors_the_rule_of_layers_linear(model_dir, float_packing, packing):
    float_packing(packing)
    llm = LLM(model_dir("llama"), dtype="float32", num_kv_blocks=64)
    try:
        model = set_paths(llm, "kernel_serial")
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert decode_call.linear_path(qkv, 1) == "kernel_serial"
        packed = "panels" if packing == "panels" else "packed"
        assert decode_call.linear_path(qkv, 16) == packed
        qkv.one_row = "packed"
        assert decode_call.linear_path(qkv, 1) == packed
        # A big batch: F.linear beats both packings, but for panels where MKL runs its AVX2 code (AMD's AVX-512 CPUs).
        big = "panels" if packing == "panels" and layers.panel_max_rows() >= 4096 else "torch"
        assert decode_call.linear_path(qkv, 4096) == big
    finally:
        llm.shutdown()


def test_the_step_profilers_labels_keep_the_loop_but_other_wrappers_do_not(model_dir, monkeypatch):
    """The profiler must time the path that really runs; a wrapper that may do more than label (a
    KV saver, say) must see every layer's call."""
    import functools

    from pdserve.bench.step_profile import labelled

    llm = LLM(model_dir("llama"), dtype="float32", num_kv_blocks=128)
    try:
        runner = llm.engine.client.engine_core.executor.worker.runner
        backend = runner.backend
        twice = Twice(monkeypatch)
        runner.backend = type(backend)(backend.plan, labelled(backend.attend, "attention"),
                                       labelled(backend.write_kv, "kv_write"))
        llm.generate(prompts(1, seed=6), GREEDY)
        assert twice.one_call_steps >= 10 and twice.mismatches == []

        seen = []

        @functools.wraps(backend.write_kv)
        def saving(*args, **kwargs):
            seen.append(args[0].shape[0])
            return backend.write_kv(*args, **kwargs)

        runner.backend = type(backend)(backend.plan, backend.attend, saving)
        before = twice.one_call_steps
        llm.generate(prompts(1, seed=7), GREEDY)
        assert twice.one_call_steps == before and len(seen) == 12 * 3  # 12 steps of 3 layers
    finally:
        llm.shutdown()


class RegionAndOps:
    """Wraps DecodeCall.run: each step runs op by op (`one_region=False`) and then as allowed by
    default, and records the steps the one-region loop ran (its counter in the library), their
    rows, and whether both results are the same bits."""

    def __init__(self, monkeypatch) -> None:
        self.region_rows: list[int] = []
        self.steps = 0
        self.mismatches: list[str] = []
        ran = decode_call.DecodeCall.run
        counter = torch.ops.pdserve_cpu.decode_region_steps

        def run(plan, hidden, positions, kv_caches, meta, paths, one_region=None):
            # The layers update their input (the residual) in place: each run gets its own copy.
            by_ops = ran(plan, hidden.clone(), positions, kv_caches, meta, paths, False)
            before = counter()
            out = ran(plan, hidden, positions, kv_caches, meta, paths, one_region)
            self.steps += 1
            if counter() > before:
                self.region_rows.append(hidden.shape[0])
            if not torch.equal(by_ops, out):
                self.mismatches.append(f"{hidden.shape[0]} rows: max difference {(by_ops - out).abs().max()}")
            return out

        monkeypatch.setattr(decode_call.DecodeCall, "run", run)


def generate_rows(llm: LLM, rows: tuple[int, ...], seed: int) -> None:
    for i, count in enumerate(rows):
        llm.generate(prompts(count, seed=seed + i), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))


def assert_every_step_in_one_region(llm: LLM, monkeypatch, seed: int) -> None:
    """Decode steps of 1, 5 and 20 rows, the packing's path for one row too: each ran in one region,
    with the op-by-op loop's bits."""
    try:
        set_paths(llm, "packed")
        seen = RegionAndOps(monkeypatch)
        generate_rows(llm, (1, 5, 20), seed=seed)
    finally:
        llm.shutdown()
    assert seen.mismatches == []
    assert {1, 5, 20} <= set(seen.region_rows) and len(seen.region_rows) == seen.steps


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral", "llama3_rope"])
@pytest.mark.parametrize("packing", ["amx", "pairs"])
def test_a_bfloat16_step_on_tiles_or_pairs_runs_in_one_region_with_the_op_by_op_bits(model_dir, monkeypatch, name,
                                                                                      packing):
    """Every matmul on AMX tiles (or every one in pair groups): the step runs in one OpenMP region,
    at one row, at several, and past a tile's 16 rows (the AMX inputs padded with zero rows), with
    the op-by-op loop's output to the bit, qwen2's q/k/v biases included."""
    if packing == "amx" and not layers.amx_supported():
        pytest.skip("no AMX here: bfloat16 weights cannot go in AMX tiles")
    if packing == "pairs" and not layers.pair_groups_supported():
        pytest.skip("no AVX512-BF16 here: bfloat16 weights cannot go in pair groups")
    monkeypatch.setenv("PDSERVE_BF16_PACKING", packing)
    assert_every_step_in_one_region(LLM(model_dir(name), dtype="bfloat16", num_kv_blocks=256, max_num_seqs=32),
                                    monkeypatch, seed=11)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_a_float32_step_on_panels_runs_in_one_region_with_the_op_by_op_bits(model_dir, monkeypatch, float_packing,
                                                                            name):
    float_packing("panels")
    assert_every_step_in_one_region(LLM(model_dir(name), dtype="float32", num_kv_blocks=256, max_num_seqs=32),
                                    monkeypatch, seed=12)


def test_steps_the_region_cannot_run_go_op_by_op(model_dir, monkeypatch, float_packing):
    """A matmul path other than tiles, pairs or panels (one row on our row kernel), or
    PDSERVE_DECODE_REGION=0: the loop runs op by op, and its output is what it was."""
    float_packing("panels")
    llm = LLM(model_dir("llama"), dtype="float32", num_kv_blocks=256)
    try:
        set_paths(llm, "kernel")
        seen = RegionAndOps(monkeypatch)
        generate_rows(llm, (1,), seed=14)
        assert seen.steps >= 4 and seen.region_rows == [] and seen.mismatches == []
        set_paths(llm, "packed")
        monkeypatch.setenv("PDSERVE_DECODE_REGION", "0")
        seen = RegionAndOps(monkeypatch)
        generate_rows(llm, (1, 5), seed=15)
        assert seen.steps >= 8 and seen.region_rows == [] and seen.mismatches == []
    finally:
        llm.shutdown()


_SLEEPING_THREADS_RUN = """
import json, sys
import torch
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model import decode_call, layers
llm = LLM(sys.argv[1], dtype="float32", num_kv_blocks=256)
model = llm.engine.client.engine_core.executor.worker.runner.model
for module in model.modules():
    if hasattr(module, "one_row"):
        module.one_row = "packed"
decode_call.forget(model)
prompts = [{"prompt_token_ids": [5 + 7 * i + j for j in range(9)]} for i in range(5)]
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs],
                  "region_steps": torch.ops.pdserve_cpu.decode_region_steps()}))
llm.shutdown()
"""


def test_the_region_where_idle_threads_sleep_answers_as_where_they_spin(model_dir, float_packing):
    """`pdserve up` runs its engines with OMP_WAIT_POLICY=PASSIVE (read once per process), under which
    the region's barriers are OpenMP's own rather than spinning ones: the same greedy tokens."""
    import json
    import subprocess
    import sys

    float_packing("panels")
    path = model_dir("llama")
    runs = {}
    for policy in ("ACTIVE", "PASSIVE"):
        env = {**os.environ, "OMP_WAIT_POLICY": policy, "PDSERVE_FLOAT_PACKING": "panels"}
        done = subprocess.run([sys.executable, "-c", _SLEEPING_THREADS_RUN, path], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[policy] = json.loads(done.stdout.strip().splitlines()[-1])
    assert runs["ACTIVE"]["region_steps"] >= 7 and runs["PASSIVE"]["region_steps"] >= 7
    assert runs["ACTIVE"]["tokens"] == runs["PASSIVE"]["tokens"]
