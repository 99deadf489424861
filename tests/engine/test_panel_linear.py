"""Float32 weights in panels (engine/model/layers.py's to_panels) multiplied by our kernel
(csrc/cpu_panel_linear.cpp): the same product as F.linear for every shape a model has (partial
panels, odd reductions, row counts off the tile's), each row independent of the batch around it,
bad arguments refused, and the rule that picks panels or oneDNN's packing per CPU."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.model import layers

pytestmark = pytest.mark.skipif(os.environ.get("PDSERVE_DISABLE_CPU_KERNELS") == "1" or not layers.panels_supported(),
                                reason="our panel kernel is not built with vector code here")


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_panels_hold_each_group_of_16_rows_k_major_and_zero_past_the_end():
    weight = randn(37, 5)
    panels = layers.to_panels(weight)
    assert panels.shape == (3, 5, 16) and panels.is_contiguous()
    for row in range(37):
        assert torch.equal(panels[row // 16, :, row % 16], weight[row])
    assert torch.count_nonzero(panels[2, :, 37 - 32:]) == 0
    assert layers.is_panels(panels)
    if layers.packing_supported(torch.float32):
        assert not layers.is_panels(torch.ops.mkldnn._reorder_linear_weight(weight, 64))


@pytest.mark.parametrize("out_features, in_features", [(1, 1), (15, 3), (16, 64), (17, 17), (100, 300), (768, 256)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 16, 70])
def test_the_product_is_f_linear_s(out_features, in_features, rows):
    weight, x = randn(out_features, in_features, seed=1), randn(rows, in_features, seed=2)
    got = torch.ops.pdserve_cpu.panel_linear(x, layers.to_panels(weight), out_features)
    exact = F.linear(x.double(), weight.double())
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    # float32 sums of in_features products: within a few ulps of their magnitude of the exact one.
    bound = 8 * in_features * torch.finfo(torch.float32).eps * (x.abs().double() @ weight.abs().double().T)
    assert torch.all((got.double() - exact).abs() <= bound + 1e-30)


def test_rows_of_x_may_sit_anywhere_in_memory():
    weight = randn(40, 24, seed=3)
    wide = randn(9, 50, seed=4)
    panels = layers.to_panels(weight)
    for x in (wide[:, 3:27], randn(24, 9, seed=5).T):  # rows apart in memory; a transposed view
        assert not x.is_contiguous()
        assert torch.equal(torch.ops.pdserve_cpu.panel_linear(x, panels, 40),
                           torch.ops.pdserve_cpu.panel_linear(x.contiguous(), panels, 40))


def test_a_rows_result_does_not_depend_on_the_batch_or_the_threads():
    """Each output is one FMA chain over k: the same bits alone, in any batch, on any thread count
    (a request's logits do not change with who else is being served)."""
    weight, x = randn(200, 96, seed=6), randn(70, 96, seed=7)
    panels = layers.to_panels(weight)
    batch = torch.ops.pdserve_cpu.panel_linear(x, panels, 200)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = torch.ops.pdserve_cpu.panel_linear(x, panels, 200)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, serial)
    for row in (0, 5, 6, 13, 69):
        assert torch.equal(torch.ops.pdserve_cpu.panel_linear(x[row:row + 1], panels, 200), batch[row:row + 1])
        assert torch.equal(torch.ops.pdserve_cpu.panel_linear(x[row:row + 16], panels, 200)[0], batch[row])


def test_empty_shapes():
    panels = layers.to_panels(randn(20, 8))
    assert torch.ops.pdserve_cpu.panel_linear(torch.empty(0, 8), panels, 20).shape == (0, 20)
    zero_k = torch.ops.pdserve_cpu.panel_linear(torch.empty(3, 0), torch.empty(2, 0, 16), 20)
    assert zero_k.shape == (3, 20) and torch.count_nonzero(zero_k) == 0


@pytest.mark.parametrize("x, panels, out_features, message", [
    (randn(2, 8).double(), layers.to_panels(randn(20, 8)), 20, "x must be a 2-D float32"),
    (randn(2, 2, 8), layers.to_panels(randn(20, 8)), 20, "x must be a 2-D float32"),
    (randn(2, 8), randn(20, 8), 20, "panels must be a contiguous float32 tensor"),
    (randn(2, 8), layers.to_panels(randn(20, 8)).transpose(0, 1), 20, "panels must be a contiguous"),
    (randn(2, 9), layers.to_panels(randn(20, 8)), 20, "x has 9 columns, the weight 8"),
    (randn(2, 8), layers.to_panels(randn(20, 8)), 33, "2 panels cannot hold 33 output features"),
    (randn(2, 8), layers.to_panels(randn(20, 8)), 16, "2 panels cannot hold 16 output features"),
])
def test_bad_arguments_are_refused_with_a_reason(x, panels, out_features, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pdserve_cpu.panel_linear(x, panels, out_features)


def test_layers_linear_takes_panels_from_two_rows_and_keeps_shape_and_bias():
    weight, bias = randn(33, 20, seed=8), randn(33, seed=9)
    panels = layers.to_panels(weight)
    x = randn(2, 3, 20, seed=10)  # [batch, tokens, features]: rows are all the leading entries
    assert layers.linear_path(weight, panels, None, 6) == "panels"
    assert layers.linear_path(weight, panels, None, layers.PANEL_MAX_ROWS) == "panels"
    assert layers.linear_path(weight, panels, None, layers.PANEL_MAX_ROWS + 1) == "torch"  # MKL's, past it
    assert layers.linear_path(weight, panels, None, 1) == "torch"  # one row: linear_tuning's choice
    assert layers.linear_path(weight, panels, "packed", 1) == "panels"
    got = layers.linear(x, weight, bias, panels)
    assert got.shape == (2, 3, 33)
    assert torch.allclose(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("setting, flags, expected", [
    ("", {"avx2", "fma"}, "panels"),  # measured faster on an AVX2 EPYC
    ("", {"avx2", "fma", "avx512f"}, "onednn"),  # measured there; panels were not
    ("panels", {"avx2", "fma", "avx512f"}, "panels"),
    ("onednn", {"avx2", "fma"}, "onednn"),
])
def test_the_packing_rule_per_cpu_and_its_override(monkeypatch, setting, flags, expected):
    monkeypatch.setattr(layers.cpu_info, "flags", lambda: frozenset(flags))
    monkeypatch.setenv("PDSERVE_FLOAT_PACKING", setting)
    layers.float_packing.cache_clear()
    try:
        assert layers.float_packing() == expected
        packed = layers.pack_weight(randn(24, 8))
        if expected == "panels":
            assert packed is not None and layers.is_panels(packed)
        elif layers.packing_supported(torch.float32):
            assert packed is not None and not layers.is_panels(packed)
    finally:
        monkeypatch.undo()
        layers.float_packing.cache_clear()


def test_an_unknown_packing_is_an_error_not_a_silent_default(monkeypatch):
    monkeypatch.setenv("PDSERVE_FLOAT_PACKING", "blas")
    layers.float_packing.cache_clear()
    try:
        with pytest.raises(ValueError, match="PDSERVE_FLOAT_PACKING='blas'"):
            layers.float_packing()
    finally:
        monkeypatch.undo()
        layers.float_packing.cache_clear()


def test_half_weights_never_go_in_panels(float_packing):
    float_packing("panels")
    for dtype in (torch.bfloat16, torch.float16):
        packed = layers.pack_weight(randn(24, 8).to(dtype))
        assert packed is None or not layers.is_panels(packed)
