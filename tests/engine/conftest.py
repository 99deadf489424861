"""Fixtures the engine tests share: the tiny random-weight llama checkpoint (tests/support) and
transformers' model on the same weights, the reference every greedy output is checked against."""

from __future__ import annotations

import pytest
import torch

from support.hf_reference import load_hf_model


@pytest.fixture(scope="module")
def path(model_dir) -> str:
    return model_dir("llama")


@pytest.fixture(scope="module")
def hf(path):
    return load_hf_model(path)


@pytest.fixture
def float_packing(monkeypatch):
    """`float_packing(kind)` makes float32 weights loaded after it take that packing ("panels" or
    "onednn", engine/model/layers.py's float_packing) for this test, whatever this CPU's rule picks;
    skips where the kind cannot run here."""
    from pdserve.engine.model import layers

    def use(kind: str) -> None:
        if kind == "panels" and not layers.panels_supported():
            pytest.skip("our panel kernel is not built with vector code on this CPU")
        if kind == "onednn" and not layers.packing_supported(torch.float32):
            pytest.skip("no oneDNN weight packing in this torch")
        monkeypatch.setenv("PDSERVE_FLOAT_PACKING", kind)
        layers.float_packing.cache_clear()

    yield use
    layers.float_packing.cache_clear()  # monkeypatch restores the variable after this: read afresh


@pytest.fixture(scope="module")
def kernels_ready():
    """Skips tests of the int8 kernels where the C++ CPU kernels are not built."""
    from pdserve.engine.model import quant

    if not quant.kernel_available():
        pytest.skip("the C++ CPU kernels are not built here (no compiler, or not an AVX2 CPU)")
