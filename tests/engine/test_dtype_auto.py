"""What `dtype auto` runs a checkpoint in, per CPU kind: the rule itself, a pure function of the flags."""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.engine import config
from pdserve.engine.config import EngineArgs, auto_cpu_dtype, cpu_flags
from pdserve.engine.demo import build_random_model


@pytest.mark.parametrize("checkpoint", [torch.bfloat16, torch.float16])
def test_half_checkpoints_run_in_bfloat16_only_on_amx_cpus(checkpoint):
    # Sapphire Rapids and later (AMX): bf16 matmuls are several times faster than float32.
    assert auto_cpu_dtype(checkpoint, machine="x86_64", amx_bf16=True)[0] == torch.bfloat16
    # AVX512-BF16 without AMX (issue 20's Xeon: 92 vs 110 tok/s at 16 streams) and AVX2-only
    # CPUs (bf16 emulated) are faster in float32: never pick the slower precision.
    dtype, why = auto_cpu_dtype(checkpoint, machine="x86_64", amx_bf16=False)
    assert dtype == torch.float32 and "no AMX" in why


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
