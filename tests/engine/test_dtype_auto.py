"""What `dtype auto` runs a checkpoint in, per CPU kind: the rule itself, a pure function of the flags."""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.engine import config
from pdserve.engine.config import EngineArgs, auto_cpu_dtype, cpu_flags
from pdserve.engine.demo import build_random_model


@pytest.mark.parametrize("checkpoint", [torch.bfloat16, torch.float16])
def test_half_checkpoints_run_in_bfloat16_only_where_it_is_the_faster(checkpoint):
    def never_timed():
        raise AssertionError("the hardware settles it: nothing to time")

    # Sapphire Rapids and later (AMX): bf16 matmuls are several times faster than float32.
    assert auto_cpu_dtype(checkpoint, machine="x86_64", amx_bf16=True, native_bf16=True,
                          timed=never_timed)[0] == torch.bfloat16
    # AVX2-only CPUs emulate bf16: never pick the slower precision.
    dtype, why = auto_cpu_dtype(checkpoint, machine="x86_64", amx_bf16=False, native_bf16=False, timed=never_timed)
    assert dtype == torch.float32 and "no bfloat16 hardware" in why
    # AVX512-BF16 without AMX: slower than float32 on issue 20's Xeon, faster on a Zen 4 EPYC; the
    # measurement decides, and without one float32 is kept.
    assert auto_cpu_dtype(checkpoint, machine="x86_64", amx_bf16=False, native_bf16=True,
                          timed=lambda: (True, "timed: faster"))[0] == torch.bfloat16
    assert auto_cpu_dtype(checkpoint, machine="x86_64", amx_bf16=False, native_bf16=True,
                          timed=lambda: (False, "timed: slower")) == (torch.float32, "timed: slower")
    assert auto_cpu_dtype(checkpoint, machine="x86_64", amx_bf16=False, native_bf16=True)[0] == torch.float32


@pytest.mark.parametrize("amx", [False, True])
def test_float32_checkpoints_stay_float32(amx):
    assert auto_cpu_dtype(torch.float32, machine="x86_64", amx_bf16=amx)[0] == torch.float32
    assert auto_cpu_dtype(torch.float32, machine="aarch64", amx_bf16=amx)[0] == torch.float32


def test_other_architectures_keep_bfloat16_for_half_checkpoints():
    assert auto_cpu_dtype(torch.bfloat16, machine="aarch64", amx_bf16=False)[0] == torch.bfloat16


def test_cpu_flags_are_read_from_cpuinfo():
    flags = cpu_flags()
    if torch.backends.cpu.get_cpu_capability().startswith("AVX"):  # x86 Linux: /proc/cpuinfo lists them
        assert "avx2" in flags or "avx" in flags


def test_engine_config_applies_the_rule_and_logs_it_once(tmp_path, monkeypatch, caplog):
    half = build_random_model(tmp_path / "bf16", arch="llama", hidden_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, intermediate_size=128, dtype="bfloat16")
    monkeypatch.setattr(config.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(config, "_logged_dtype_choices", set())
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: False)  # the rule alone: nothing timed
    for amx, expected in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(config, "cpu_has_amx_bf16", lambda amx=amx: amx)
        with caplog.at_level(logging.INFO, logger="pdserve.engine.config"):
            caplog.clear()
            for _ in range(2):  # an API server and its engine core both resolve the config
                assert EngineArgs(model=str(half), device="cpu").create_engine_config().model.dtype == expected
        decisions = [r.getMessage() for r in caplog.records if "dtype auto" in r.getMessage()]
        assert len(decisions) == 1 and str(expected).removeprefix("torch.") in decisions[0]
    # An explicit dtype is honoured whatever the CPU.
    assert EngineArgs(model=str(half), device="cpu", dtype="bfloat16").create_engine_config().model.dtype == torch.bfloat16


def test_avx512_bf16_without_amx_runs_what_the_probe_timed_faster(tmp_path, monkeypatch):
    from pdserve.engine import dtype_probe

    half = build_random_model(tmp_path / "bf16", arch="llama", hidden_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, intermediate_size=128, dtype="bfloat16")
    monkeypatch.setattr(config.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(config, "cpu_has_amx_bf16", lambda: False)
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: True)
    asked = []
    for faster, expected in ((True, torch.bfloat16), (False, torch.float32)):
        def verdict(shapes, faster=faster):
            asked.append(shapes)
            return dtype_probe.Verdict(faster, {"1": [2.0, 1.0]})

        monkeypatch.setattr(dtype_probe, "bf16_beats_float32", verdict)
        assert EngineArgs(model=str(half), device="cpu").create_engine_config().model.dtype == expected
    # The checkpoint's own layer: qkv (2 heads of 32, one KV head), o, gate_up, down.
    assert asked[0] == ((128, 64), (64, 64), (256, 64), (64, 128))


def test_a_config_without_layer_shapes_keeps_float32_untimed(monkeypatch):
    from pdserve.engine import dtype_probe

    monkeypatch.setattr(config.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(config, "cpu_has_amx_bf16", lambda: False)
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(dtype_probe, "bf16_beats_float32", lambda shapes: pytest.fail("nothing to time"))
    dtype, why = config.auto_cpu_dtype_here(torch.bfloat16, {"hidden_size": 64, "num_attention_heads": 2})
    assert dtype == torch.float32 and "layer shapes" in why


@pytest.mark.parametrize("quantization, int8_activations, amx, expected", [
    ("int8", False, True, torch.bfloat16),  # bf16 rows on AMX tiles: faster than float32
    ("int8", False, False, torch.float32),  # the float32 int8 kernels: a half model converts around them
    ("q8_0", False, True, torch.float32),  # group scales keep the float32 kernels, AMX or not
    ("int8", True, True, torch.float32),  # so do int8 activations
])
def test_int8_weights_run_in_bfloat16_only_where_amx_multiplies_them(tmp_path, monkeypatch, quantization,
                                                                      int8_activations, amx, expected):
    half = build_random_model(tmp_path / "bf16", arch="llama", hidden_size=64, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1, intermediate_size=128, dtype="bfloat16")
    monkeypatch.setattr(config.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(config, "_logged_dtype_choices", set())
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(config, "auto_cpu_dtype_here", lambda checkpoint, cfg: (torch.bfloat16, "timed: faster"))
    monkeypatch.setattr(config, "cpu_has_amx_bf16", lambda: amx)
    monkeypatch.delenv("PDSERVE_DISABLE_CPU_KERNELS", raising=False)
    args = EngineArgs(model=str(half), device="cpu", quantization=quantization, int8_activations=int8_activations)
    assert args.create_engine_config().model.dtype == expected
    # Without int8 weights the checkpoint keeps what the rule picked; an explicit dtype is honoured.
    assert EngineArgs(model=str(half), device="cpu").create_engine_config().model.dtype == torch.bfloat16
    explicit = EngineArgs(model=str(half), device="cpu", dtype="bfloat16", quantization=quantization,
                          int8_activations=int8_activations)
    assert explicit.create_engine_config().model.dtype == torch.bfloat16
