"""The fused layer ops (engine/model/fused.py) against the eager expressions they replace.

On the CPU the C++ kernels (csrc/cpu_fused_ops.cpp, cpu_kv_write.cpp) run; their Triton twins run in the Triton
interpreter in a child process (TRITON_INTERPRET must be set before triton is first imported, and
other tests may import it first): this file is that child's script when run with --triton-cases.

Tolerances, from measured errors on these inputs:
- rotary: float32 and bfloat16 bit-identical to eager on the CPU (same roundings, no fused
  multiply-add). The Triton interpreter truncates to bfloat16, so its bfloat16 cases allow 3 ulps.
- RMSNorm: the sum of squares is accumulated in another order than torch's, so float32 differs
  by up to ~1e-6 relative (measured max abs 7e-7 at |x| ~ 3); bfloat16 results within one ulp.
- SiLU·mul: our vectorized exp is within ~2 ulps of torch's, measured max relative error 2.2e-7.
- KV write: a copy, bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pdserve.engine.model import fused

DTYPES = [torch.float32, torch.bfloat16]
TOKENS = [1, 3, 17]
HIDDEN = 72  # not a multiple of the vector width: the loop tails run too
BF16_ULP = 2.0 ** -7


def _tol(dtype: torch.dtype) -> dict:
    return dict(rtol=2e-6, atol=2e-6) if dtype == torch.float32 else dict(rtol=BF16_ULP, atol=1e-2)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    if os.environ.get("PDSERVE_DISABLE_CPU_KERNELS") == "1":
        pytest.skip("CPU kernels disabled by PDSERVE_DISABLE_CPU_KERNELS=1")
    assert fused.cpu_kernels_ready(), "the C++ kernels did not build or load (see the log)"


def _norm_inputs(tokens: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(tokens, HIDDEN, generator=gen)).to(dtype)
    residual = (2 * torch.randn(tokens, HIDDEN, generator=gen)).to(dtype)
    weight = (1 + 0.2 * torch.randn(HIDDEN, generator=gen)).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
def test_add_rms_norm_matches_eager(tokens, dtype):
    x, residual, weight = _norm_inputs(tokens, dtype)
    want, want_residual = fused.rms_norm_reference(x, residual, weight, 1e-6)
    got, got_residual = fused.rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    torch.testing.assert_close(got, want, **_tol(dtype))
    assert torch.equal(got_residual, want_residual)  # one add, rounded once: exact


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_residual_leaves_input_alone(dtype):
    # The first layer's input is also the residual the next norm adds: it must not change.
    x, _, weight = _norm_inputs(5, dtype, seed=1)
    kept = x.clone()
    got, residual = fused.rms_norm(x, None, weight, 1e-5)
    want, _ = fused.rms_norm_reference(kept, None, weight, 1e-5)
    assert torch.equal(x, kept) and residual is x
    torch.testing.assert_close(got, want, **_tol(dtype))


def test_rms_norm_falls_back_for_other_layouts():
    # A 3-D input or float16 is not what the kernel takes: the reference runs instead.
    x, residual, weight = _norm_inputs(6, torch.float32, seed=2)
    got, _ = fused.rms_norm(x.view(2, 3, HIDDEN), residual.view(2, 3, HIDDEN), weight, 1e-5)
    want, _ = fused.rms_norm_reference(x.view(2, 3, HIDDEN), residual.view(2, 3, HIDDEN), weight, 1e-5)
    assert torch.equal(got, want)
    half = x.half(), residual.half(), weight.half()
    assert torch.equal(fused.rms_norm(*half, 1e-5)[0], fused.rms_norm_reference(*half, 1e-5)[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("inter", [40, 100])
def test_silu_mul_matches_eager(tokens, inter, dtype):
    gen = torch.Generator().manual_seed(tokens * inter)
    gate_up = 4 * torch.randn(tokens, 2 * inter, generator=gen)
    # Saturated and zero inputs, where exp under- or overflows in a naive sigmoid.
    extremes = torch.tensor([-200.0, -88.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 88.0, 200.0])
    gate_up[0, :extremes.numel()] = extremes
    gate_up = gate_up.to(dtype)
    got = fused.silu_mul(gate_up)
    want = fused.silu_mul_reference(gate_up)
    assert got.shape == (tokens, inter)
    torch.testing.assert_close(got, want, **_tol(dtype))


def _qk(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """q and k as the model has them: views into one [tokens, (heads + 2 kv) * dim] projection."""
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    return qkv, q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_rotary_matches_eager_bit_for_bit(tokens, partial, dtype):
    from pdserve.engine.model.rotary import RotaryEmbedding

    head_dim = 32
    rotary = RotaryEmbedding(head_dim, 512, {"rope_theta": 10000.0, "partial_rotary_factor": partial}, dtype)
    assert rotary.rotary_dim == int(head_dim * partial)
    qkv, q, k = _qk(tokens, 4, 2, head_dim, dtype)
    positions = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(7))
    want_q, want_k = fused.rotate_qk_reference(positions, q, k, rotary.cos, rotary.sin, rotary.rotary_dim)
    v_before = qkv[:, 6 * head_dim:].clone()
    got_q, got_k = rotary(positions, q, k)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(qkv[:, 6 * head_dim:], v_before)  # v shares the buffer and is left alone


def test_rotary_rejects_positions_outside_the_table():
    from pdserve.engine.model.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(32, 64, {}, torch.float32)
    _, q, k = _qk(2, 4, 2, 32, torch.float32)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        rotary(torch.tensor([3, 64]), q, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 300])  # 300: enough rows for the copy to split over threads
def test_kv_write_matches_index_copy(tokens, dtype):
    # k and v as the model hands them over: views into the fused qkv projection's output.
    heads, kv_heads, head_dim, block_size, blocks = 4, 2, 24, 16, 24
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    _, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    k, v = k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    caches = [torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
    want, got = caches[0].clone(), caches[0]
    fused.write_kv_reference(k, v, want[0], want[1], slots)
    fused.write_kv(k, v, got[0], got[1], slots)
    assert torch.equal(got, want)  # a copy: bit for bit, and nothing but the named slots changes


def test_kv_write_skips_negative_slots_and_refuses_slots_past_the_cache():
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    key_cache, value_cache = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    fused.write_kv(k, v, key_cache, value_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(key_cache.view(-1, 2, 8)[[5, 0]], k[[0, 2]])
    assert torch.equal(value_cache.view(-1, 2, 8)[[5, 0]], v[[0, 2]])
    assert int((key_cache != 0).any(-1).any(-1).sum()) == 2  # the skipped token wrote nowhere
    before = key_cache.clone()
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        fused.write_kv(k, v, key_cache, value_cache, torch.tensor([1, 2, 16]))
    assert torch.equal(key_cache, before)  # checked before anything is written


def test_reference_switch_routes_every_op_to_eager():
    x, residual, weight = _norm_inputs(3, torch.float32, seed=3)
    fused.use_reference(True)
    try:
        got, got_residual = fused.rms_norm(x, residual, weight, 1e-5)
        assert got is not x and got_residual is not residual  # the eager path allocates; inputs untouched
    finally:
        fused.use_reference(False)
    want, _ = fused.rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


# -- Triton twins, in the interpreter ----------------------------------------------------------------

TRITON_CASES = [(op, dtype, tokens) for op in ("rms_norm", "rms_norm_first", "silu_mul", "rotary", "rotary_partial")
                for dtype in ("float32", "bfloat16") for tokens in (1, 5)]


def run_triton_cases() -> dict[str, float]:
    """Max error of each Triton kernel against the reference, relative to the tolerance (<= 1 passes)."""
    from pdserve.engine.attention import triton_fused

    results = {}
    for op, dtype_name, tokens in TRITON_CASES:
        dtype = getattr(torch, dtype_name)
        # The interpreter truncates to bfloat16 where a GPU rounds to nearest: up to one ulp per
        # rounding, and RMSNorm rounds three times.
        tol = dict(rtol=3 * BF16_ULP, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=2e-6, atol=2e-6)
        if op.startswith("rms_norm"):
            x, residual, weight = _norm_inputs(tokens, dtype, seed=tokens)
            residual = None if op == "rms_norm_first" else residual
            want = fused.rms_norm_reference(x, residual, weight, 1e-6)
            got = triton_fused.rms_norm(x.clone(), None if residual is None else residual.clone(), weight, 1e-6)
        elif op == "silu_mul":
            gate_up = (4 * torch.randn(tokens, 2 * 40, generator=torch.Generator().manual_seed(tokens))).to(dtype)
            want, got = (fused.silu_mul_reference(gate_up),), (triton_fused.silu_mul(gate_up),)
        else:
            from pdserve.engine.model.rotary import RotaryEmbedding

            factor = 0.75 if op == "rotary_partial" else 1.0
            rotary = RotaryEmbedding(32, 64, {"partial_rotary_factor": factor}, dtype)
            _, q, k = _qk(tokens, 4, 2, 32, dtype)
            positions = torch.arange(tokens) * 7 % 64
            want = fused.rotate_qk_reference(positions, q, k, rotary.cos, rotary.sin, rotary.rotary_dim)
            got = triton_fused.rotate_qk(positions, q, k, rotary.cos, rotary.sin, rotary.rotary_dim)
        worst = 0.0
        for g, w in zip(got, want):
            allowed = tol["atol"] + tol["rtol"] * w.float().abs()
            worst = max(worst, float(((g.float() - w.float()).abs() / allowed).max()))
        results[f"{op}-{dtype_name}-{tokens}"] = worst
    return results


@pytest.fixture(scope="module")
def triton_results() -> dict[str, float]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONSAFEPATH="1")
    proc = subprocess.run([sys.executable, __file__, "--triton-cases"], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"triton cases exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1])


@pytest.mark.parametrize("case", [f"{op}-{dtype}-{tokens}" for op, dtype, tokens in TRITON_CASES])
def test_triton_kernel_matches_eager(triton_results, case):
    assert triton_results[case] <= 1.0, f"{case}: error {triton_results[case]:.2f}x the tolerance"


def test_a_kernel_build_with_other_flags_gets_its_own_library(monkeypatch):
    """The compiled library is cached by name: a change of compiler flags must name a new one, or a
    library built with the old flags would keep being loaded."""
    from pdserve.engine.attention import cpu_kernels

    name = cpu_kernels._build_name()
    monkeypatch.setattr(cpu_kernels, "CFLAGS", [*cpu_kernels.CFLAGS, "-fno-tree-vectorize"])
    assert cpu_kernels._build_name() != name


if __name__ == "__main__":
    if sys.argv[1:] == ["--triton-cases"]:
        print(json.dumps(run_triton_cases()))
