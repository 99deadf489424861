"""bfloat16 on whatever CPU runs the tests, and how `dtype="auto"` chooses.

The parity tests run in float32; these make sure the half-precision path loads and computes the
same function on CPUs with and without native bf16 (AVX2-only machines cannot prepack bf16
weights and must fall back to plain matmuls instead of failing).
"""

from __future__ import annotations

import json

import platform
import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineArgs, auto_cpu_dtype_here, cpu_has_native_bf16
from pdserve.engine.demo import build_random_model
from pdserve.engine.model import layers
from pdserve.engine.model.layers import WIDEN_SLAB_ROWS, linear_widened, packing_supported

from support.hf_reference import assert_greedy_tracks, load_hf_model

# bf16 keeps 8 bits of mantissa: logits of size ~10 carry errors of a few hundredths.
BF16_LOGPROB_TOLERANCE = 0.1


@pytest.mark.parametrize("pack, widen", [("1", None), ("0", False), ("0", True)])
def test_bfloat16_engine_tracks_float32_transformers(model_dir, monkeypatch, pack, widen):
    """Prepacked weights (oneDNN's, or on CPUs without bf16 hardware panels widened in our tile),
    plain bf16 matmuls, and bf16 weights widened to fp32 matmuls (what CPUs without bf16 hardware
    use past the panels' rows) all compute the model transformers computes."""
    monkeypatch.setenv("PDSERVE_PACK_WEIGHTS", pack)
    if widen is not None:
        monkeypatch.setattr(layers, "bf16_is_emulated", lambda: widen)
    path = model_dir("llama")
    hf = load_hf_model(path)
    llm = LLM(path, dtype="bfloat16")
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 4096) for _ in range(n)] for n in (5, 17, 40, 90)]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
    # Greedy in bf16 picks the float32 argmax, or a token tied with it within bf16 error.
    assert_greedy_tracks(hf, prompts, outputs, BF16_LOGPROB_TOLERANCE)


@pytest.mark.parametrize("shape", [(16, 64, 48), (40, 96, WIDEN_SLAB_ROWS + 37), (3, 7, 32, 2 * WIDEN_SLAB_ROWS)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_widened_bf16_linear_equals_torch_bf16_linear(shape, with_bias):
    *lead, k, n = shape
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*lead, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) * 0.1).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    got = linear_widened(x, w, b)
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == torch.bfloat16 and got.shape == (*lead, n)
    # Rounded once from an fp32 sum: within one bf16 step (2^-7 relative) of the exact product,
    # every slab of output columns included.
    assert torch.all((got.double() - exact).abs() <= exact.abs() * 2 ** -7 + 1e-3)
    assert torch.allclose(got.float(), torch.nn.functional.linear(x, w, b).float(), rtol=2 ** -7, atol=1e-2)


def test_packing_support_is_probed_not_assumed():
    fp32 = packing_supported(torch.float32)
    if torch.backends.mkldnn.is_available() and platform.machine() in ("x86_64", "AMD64"):
        assert fp32  # oneDNN packs fp32 weights on every x86 CPU: False here means the probe broke
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(48, 32, generator=gen), torch.randn(4, 32, generator=gen)
    packed = layers.pack_weight(weight)
    assert (packed is not None) == fp32
    if packed is not None:  # 4 rows: inside PACKED_ROWS[float32], so the packed kernel really runs
        got = layers.linear(x, weight, None, packed)
        assert torch.allclose(got, torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-5)
    if not cpu_has_native_bf16() and not torch.cpu._is_avx512_supported():
        assert packing_supported(torch.bfloat16) is False
    assert packing_supported(torch.float16) is False  # never packed: not in the measured table


def test_auto_dtype_takes_bfloat16_only_where_the_cpu_runs_it_fastest(tmp_path):
    half = build_random_model(tmp_path / "bf16", arch="llama", hidden_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, intermediate_size=128, dtype="bfloat16")
    full = build_random_model(tmp_path / "fp32", arch="llama", hidden_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, intermediate_size=128, dtype="float32")
    # The rule (engine/config.py auto_cpu_dtype): bfloat16 only where this CPU runs it faster (AMX, or
    # AVX512-BF16 timed faster on this model's shapes).
    cfg = json.loads((half / "config.json").read_text())
    expected_half = auto_cpu_dtype_here(torch.bfloat16, cfg)[0]
    assert EngineArgs(model=str(half), device="cpu").create_engine_config().model.dtype == expected_half
    assert EngineArgs(model=str(full), device="cpu").create_engine_config().model.dtype == torch.float32
    # An explicit choice is always honoured.
    assert EngineArgs(model=str(full), device="cpu", dtype="bfloat16").create_engine_config().model.dtype == torch.bfloat16


def test_the_demo_model_generates_with_the_default_dtype():
    llm = LLM("demo")
    out = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
