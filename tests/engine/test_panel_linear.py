"""Float32 weights in panels (engine/model/layers.py's to_panels) multiplied by our kernel
(csrc/cpu_panel_linear.cpp): the same product as F.linear for every shape a model has (partial
panels, odd reductions, row counts off the tile's), each row independent of the batch around it,
bad arguments refused, and the rule that picks panels or oneDNN's packing. bfloat16
weights go in panels too where the CPU has no bf16 arithmetic (AVX2): widened in the tile, summed
in float32, rounded to bfloat16 once."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.model import layers
from support.linear_checks import assert_rows_independent

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


# 1 to 48 panels: every width of the AVX-512 tile's last group of panels (1-4), a partial last panel.
@pytest.mark.parametrize("out_features, in_features", [(1, 1), (15, 3), (16, 64), (17, 17), (40, 24), (72, 33),
                                                       (100, 300), (130, 20), (768, 256)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 16, 70])
def test_the_product_is_f_linear_s(out_features, in_features, rows):
    weight, x = randn(out_features, in_features, seed=1), randn(rows, in_features, seed=2)
    got = torch.ops.pdserve_cpu.panel_linear(x, layers.to_panels(weight), out_features)
    exact = F.linear(x.double(), weight.double())
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    # float32 sums of in_features products: within a few ulps of their magnitude of the exact one.
    bound = 8 * in_features * torch.finfo(torch.float32).eps * (x.abs().double() @ weight.abs().double().T)
    assert torch.all((got.double() - exact).abs() <= bound + 1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_of_x_may_sit_anywhere_in_memory(dtype):
    weight = randn(40, 24, seed=3).to(dtype)
    wide = randn(9, 50, seed=4).to(dtype)
    panels = layers.to_panels(weight)
    for x in (wide[:, 3:27], randn(24, 9, seed=5).to(dtype).T):  # rows apart in memory; a transposed view
        assert not x.is_contiguous()
        assert torch.equal(torch.ops.pdserve_cpu.panel_linear(x, panels, 40),
                           torch.ops.pdserve_cpu.panel_linear(x.contiguous(), panels, 40))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_the_batch_or_the_threads(dtype):
    """Each output is one FMA chain over k: the same bits alone, in any batch, on any thread count
    (a request's logits do not change with who else is being served)."""
    weight, x = randn(200, 96, seed=6).to(dtype), randn(70, 96, seed=7).to(dtype)
    panels = layers.to_panels(weight)
    assert_rows_independent(lambda rows: torch.ops.pdserve_cpu.panel_linear(rows, panels, 200), x, (0, 5, 6, 13, 69),
                            window=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_input_goes_through_in_slices_that_change_no_row(dtype):
    """Past 512 rows (a prefill chunk) the rows go through in slices: every row, in the first slice, the
    last or across a slice's edge, has the bits it has alone, and the product stays within float32's
    summation error."""
    weight, x = randn(200, 96, seed=13).to(dtype), randn(1100, 96, seed=14).to(dtype)
    panels = layers.to_panels(weight)
    assert_rows_independent(lambda rows: torch.ops.pdserve_cpu.panel_linear(rows, panels, 200), x,
                            (0, 255, 256, 275, 276, 551, 552, 827, 828, 1099), window=16)
    got = torch.ops.pdserve_cpu.panel_linear(x, panels, 200).double()
    exact = F.linear(x.double(), weight.double())
    bound = 8 * 96 * torch.finfo(torch.float32).eps * (x.abs().double() @ weight.abs().double().T)
    rounding = exact.abs() * 2.0 ** -7 if dtype == torch.bfloat16 else 0
    assert torch.all((got - exact).abs() <= bound + rounding + 1e-30)


def test_empty_shapes():
    panels = layers.to_panels(randn(20, 8))
    assert torch.ops.pdserve_cpu.panel_linear(torch.empty(0, 8), panels, 20).shape == (0, 20)
    zero_k = torch.ops.pdserve_cpu.panel_linear(torch.empty(3, 0), torch.empty(2, 0, 16), 20)
    assert zero_k.shape == (3, 20) and torch.count_nonzero(zero_k) == 0


@pytest.mark.parametrize("x, panels, out_features, message", [
    (randn(2, 8).double(), layers.to_panels(randn(20, 8)), 20, "x must be a 2-D tensor of the panels' dtype"),
    (randn(2, 8).double(), layers.to_panels(randn(20, 8).double()), 20, r"panels' dtype \(float32 or bfloat16\)"),
    (randn(2, 8).bfloat16(), layers.to_panels(randn(20, 8)), 20, "x must be a 2-D tensor of the panels' dtype"),
    (randn(2, 2, 8), layers.to_panels(randn(20, 8)), 20, "x must be a 2-D tensor of the panels' dtype"),
    (randn(2, 8), randn(20, 8), 20, "panels must be a contiguous tensor"),
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
    assert layers.linear_path(weight, panels, None, layers.panel_max_rows()) == "panels"
    assert layers.linear_path(weight, panels, None, layers.panel_max_rows() + 1) == "torch"  # MKL's, past it
    assert layers.linear_path(weight, panels, None, 1) == "torch"  # one row: linear_tuning's choice
    assert layers.linear_path(weight, panels, "packed", 1) == "panels"
    got = layers.linear(x, weight, bias, panels)
    assert got.shape == (2, 3, 33)
    assert torch.allclose(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("setting, expected", [
    ("", "panels"),  # measured faster on an AVX2 EPYC and, with the four-panel tile, an AVX-512 Xeon
    ("panels", "panels"),
    ("onednn", "onednn"),
])
def test_the_packing_rule_and_its_override(monkeypatch, setting, expected):
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


def test_float16_weights_never_go_in_panels_and_bfloat16_only_without_bf16_arithmetic(float_packing):
    float_packing("panels")
    packed = layers.pack_weight(randn(24, 8).half())
    assert packed is None or not layers.is_panels(packed)
    packed = layers.pack_weight(randn(24, 8).bfloat16())
    if layers.bf16_is_emulated():  # AVX2: half the bytes of float32 to read, widened in the tile
        assert packed is not None and layers.is_panels(packed) and packed.dtype == torch.bfloat16
    else:  # AMX tiles (test_amx_linear), pair groups (test_pair_linear) or oneDNN's bf16 layout
        assert packed is None or not layers.is_panels(packed)


def test_bfloat16_panels_pair_each_row_with_the_one_8_further():
    """At each k a bfloat16 panel holds rows 0, 8, 1, 9, ... 7, 15 of its group: one 32-bit word per
    pair, which the AVX2 tile splits with one shift and one mask."""
    weight = randn(37, 5).bfloat16()
    panels = layers.to_panels(weight)
    assert panels.shape == (3, 5, 16) and panels.dtype == torch.bfloat16 and panels.is_contiguous()
    for row in range(37):
        j = row % 16
        slot = 2 * j if j < 8 else 2 * (j - 8) + 1
        assert torch.equal(panels[row // 16, :, slot], weight[row])
    assert torch.count_nonzero(panels[2].float().sum(0)) == 37 - 32


@pytest.mark.parametrize("out_features, in_features", [(1, 1), (15, 3), (17, 17), (100, 300), (768, 256)])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 16, 70])
def test_bfloat16_panels_sum_in_float32_and_round_once(out_features, in_features, rows):
    """Every output is the float32 sum of the exact bf16 products, rounded to bf16 once: within one
    bf16 step (plus float32's summation error, which matters where the sum cancels) of the exactly
    rounded sum (our summation order is not torch's), and equal to it on nearly every element."""
    weight = (randn(out_features, in_features, seed=11) / 7).bfloat16()
    x = randn(rows, in_features, seed=12).bfloat16()
    got = torch.ops.pdserve_cpu.panel_linear(x, layers.to_panels(weight), out_features)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    rounded = (x.double() @ weight.double().T).to(torch.bfloat16).double()
    step = rounded.abs().clamp_min(1e-30) * 2.0 ** -7  # one bf16 step (8 significant bits)
    float32_error = in_features * torch.finfo(torch.float32).eps * (x.double().abs() @ weight.double().abs().T)
    assert ((got.double() - rounded).abs() <= step + float32_error).all()
    assert (got.double() == rounded).float().mean() > 0.9  # a step away only next to a tie


def test_layers_linear_takes_bfloat16_panels_up_to_the_limit_then_widens(float_packing):
    if not layers.bf16_is_emulated():
        pytest.skip("this CPU has bf16 arithmetic: bfloat16 weights take oneDNN's packing or AMX tiles, not panels")
    float_packing("panels")
    weight, bias = randn(33, 20, seed=15).bfloat16(), randn(33, seed=16).bfloat16()
    panels = layers.pack_weight(weight)
    assert layers.is_panels(panels)
    assert layers.linear_path(weight, panels, None, 2) == "panels"
    assert layers.linear_path(weight, panels, None, layers.panel_max_rows()) == "panels"
    assert layers.linear_path(weight, panels, None, layers.panel_max_rows() + 1) == "widened"
    x = randn(2, 3, 20, seed=17).bfloat16()
    got = layers.linear(x, weight, bias, panels)
    want = layers.linear_widened(x, weight, bias)  # the same float32 products, rounded once
    assert got.shape == (2, 3, 33) and got.dtype == torch.bfloat16
    # Panels round the product, then the sum with the bias: two bf16 roundings, each within a step
    # of the value it rounds (a step of the product can exceed one of the sum where the bias cancels it).
    product = (x.double() @ weight.double().T).abs()
    assert ((got.double() - want.double()).abs() <= (product + want.double().abs()) * 2.0 ** -7).all()
