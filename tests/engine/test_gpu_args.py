"""GPU engine arguments are checked before any model loads, on any machine."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineArgs


@pytest.mark.parametrize("value", [0.0, -0.5, 1.01, 9.0])
def test_gpu_memory_utilization_outside_zero_one_is_refused(model_dir, value):
    args = EngineArgs(model=model_dir("llama"), gpu_memory_utilization=value)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        args.create_engine_config()


@pytest.mark.parametrize("value", [0.05, 0.9, 1.0])
def test_gpu_memory_utilization_in_range_is_kept(model_dir, value):
    config = EngineArgs(model=model_dir("llama"), gpu_memory_utilization=value).create_engine_config()
    assert config.cache.gpu_memory_utilization == value


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda:1", "CPU", ""])
def test_unknown_device_is_refused(model_dir, device):
    """It used to run on the CPU without a word (and cuda:1 on GPU 0)."""
    from pdserve.engine import LLM

    with pytest.raises(ValueError, match="device must be auto, cpu or cuda"):
        LLM(model_dir("llama"), device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine where torch sees no GPU")
def test_cuda_without_a_gpu_is_a_clear_error(model_dir):
    """Not torch's AttributeError from deep in the worker ('torch._C' has no '_cuda_setDevice')."""
    from pdserve.engine import LLM

    with pytest.raises(ValueError, match="device cuda was asked for, but torch .* sees no CUDA GPU"):
        LLM(model_dir("llama"), device="cuda")


def test_serve_cli_reports_a_bad_device_and_exits(model_dir):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--model", model_dir("llama"), "--device", "tpu",
                           "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "pdserve serve: device must be auto, cpu or cuda; got 'tpu'" in proc.stderr
