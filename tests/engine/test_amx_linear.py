"""bfloat16 weights in AMX tiles (engine/model/layers.py's to_amx_tiles) multiplied by our AMX
kernel (csrc/cpu_amx_linear.cpp) on CPUs with AMX: the layout, the product (bf16 products summed in
float32 and rounded once, as torch's bf16 matmul), every shape a model has (partial tiles, odd
reductions, any row count), each row independent of the batch and of the thread count, bad
arguments refused, the rule that picks AMX tiles or oneDNN's packing and its override, and the
one-call decode step on AMX weights equal to the modules to the bit.

The layout and the rule run on every CPU; the kernel's tests need AMX (an Intel Xeon since
Sapphire Rapids) and are skipped elsewhere, with that reason."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.engine.model import layers
from support.linear_checks import assert_rounded_once, assert_rows_independent

kernels_off = os.environ.get("PDSERVE_DISABLE_CPU_KERNELS") == "1"
needs_amx = pytest.mark.skipif(kernels_off or not layers.amx_supported(),
                               reason="no AMX here (or the CPU kernels are off): the AMX kernel cannot run")


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def amx_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.pdserve_cpu.amx_linear(x, layers.to_amx_tiles(weight), weight.shape[0])


@pytest.fixture
def bf16_packing(monkeypatch):
    """`bf16_packing(kind)`: bfloat16 weights packed after it take that packing ("amx" or "onednn")."""
    def use(kind: str) -> None:
        if kind == "amx" and (kernels_off or not layers.amx_supported()):
            pytest.skip("no AMX here: bfloat16 weights cannot go in AMX tiles")
        if kind == "onednn" and not layers.packing_supported(torch.bfloat16):
            pytest.skip("oneDNN cannot pack bfloat16 weights on this CPU")
        monkeypatch.setenv("PDSERVE_BF16_PACKING", kind)
    return use


def test_tiles_hold_each_weight_element_where_the_tile_unit_reads_it_and_zero_past_the_edges():
    weight = randn(70, 45).bfloat16()
    tiles = layers.to_amx_tiles(weight)
    assert tiles.shape == (2, 2, 4, 16, 32) and tiles.dtype == torch.bfloat16 and tiles.is_contiguous()
    for n in (0, 15, 16, 37, 63, 64, 69):
        for k in (0, 1, 30, 31, 32, 44):
            g, j, c, b, r, h = n // 64, n % 64 // 16, n % 16, k // 32, k % 32 // 2, k % 2
            assert tiles[g, b, j, r, 2 * c + h] == weight[n, k]
    assert tiles.float().abs().sum() == weight.float().abs().sum()  # everything else is zero
    assert layers.is_amx_tiles(tiles) and not layers.is_panels(tiles)
    assert layers.is_panels(layers.to_panels(weight)) and not layers.is_amx_tiles(layers.to_panels(weight))


@needs_amx
# From 128 rows pairs of output blocks go two row blocks at a time: 48 outputs are three blocks (a
# pair and one alone), 129 and 150 rows end in a lone or a part-filled row block.
@pytest.mark.parametrize("out_features, in_features", [(1, 1), (15, 3), (17, 33), (48, 40), (64, 32), (100, 300),
                                                       (768, 256)])
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 33, 70, 129, 150, 160])
def test_the_product_sums_in_float32_and_rounds_once(out_features, in_features, rows):
    """Within one bf16 step (plus float32's summation error, where the sum cancels) of the exactly
    rounded sum, equal to it on nearly every element, and as close to it as torch's own bf16 matmul."""
    weight = (randn(out_features, in_features, seed=1) / 7).bfloat16()
    x = randn(rows, in_features, seed=2).bfloat16()
    assert_rounded_once(amx_linear(x, weight), x, weight)


@needs_amx
def test_rows_of_x_may_sit_anywhere_in_memory():
    weight = randn(40, 64, seed=3).bfloat16()
    wide = randn(20, 100, seed=4).bfloat16()
    for x in (wide[:, 3:67], wide[:17, 36:100], randn(64, 9, seed=5).bfloat16().T):
        assert not x.is_contiguous()
        assert torch.equal(amx_linear(x, weight), amx_linear(x.contiguous(), weight))


@needs_amx
def test_a_rows_result_does_not_depend_on_the_batch_or_the_threads():
    """The tile unit sums each row of x on its own: a request's logits do not change with who else
    is in the batch nor with how many threads run it."""
    weight = randn(200, 96, seed=6).bfloat16()
    tiles = layers.to_amx_tiles(weight)
    x = randn(70, 96, seed=7).bfloat16()
    assert_rows_independent(lambda rows: torch.ops.pdserve_cpu.amx_linear(rows, tiles, 200), x, (0, 5, 15, 16, 69),
                            window=20)
    many = randn(150, 96, seed=8).bfloat16()  # pairs of row blocks in the batch, one at a time in the windows
    assert_rows_independent(lambda rows: torch.ops.pdserve_cpu.amx_linear(rows, tiles, 200), many,
                            (0, 31, 100, 128, 149), window=20)


@needs_amx
def test_no_rows_give_an_empty_product():
    tiles = layers.to_amx_tiles(randn(20, 8).bfloat16())
    assert torch.ops.pdserve_cpu.amx_linear(torch.empty(0, 8, dtype=torch.bfloat16), tiles, 20).shape == (0, 20)


@needs_amx
@pytest.mark.parametrize("x, tiles, out_features, message", [
    (randn(2, 8), layers.to_amx_tiles(randn(20, 8).bfloat16()), 20, "x must be a 2-D bfloat16 tensor"),
    (randn(2, 2, 8).bfloat16(), layers.to_amx_tiles(randn(20, 8).bfloat16()), 20, "x must be a 2-D bfloat16"),
    (randn(2, 8).bfloat16(), layers.to_panels(randn(20, 8).bfloat16()), 20, "the weight must be in AMX tiles"),
    (randn(2, 8).bfloat16(), layers.to_amx_tiles(randn(20, 8)), 20, "the weight must be in AMX tiles"),
    (randn(2, 40).bfloat16(), layers.to_amx_tiles(randn(20, 8).bfloat16()), 20, "x has 40 columns, the tiles hold 32"),
    (randn(2, 8).bfloat16(), layers.to_amx_tiles(randn(20, 8).bfloat16()), 65, "1 groups of tiles cannot hold 65"),
    (randn(2, 8).bfloat16(), layers.to_amx_tiles(randn(70, 8).bfloat16()), 64, "2 groups of tiles cannot hold 64"),
])
def test_bad_arguments_are_refused_with_a_reason(x, tiles, out_features, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pdserve_cpu.amx_linear(x, tiles, out_features)


@needs_amx
def test_layers_linear_takes_the_tiles_up_to_the_limit_and_keeps_shape_and_bias(bf16_packing):
    bf16_packing("amx")
    weight, bias = randn(33, 20, seed=15).bfloat16(), randn(33, seed=16).bfloat16()
    tiles = layers.pack_weight(weight)
    assert layers.is_amx_tiles(tiles)
    assert layers.linear_path(weight, tiles, None, 1) == "amx"
    assert layers.linear_path(weight, tiles, None, layers.AMX_MAX_ROWS) == "amx"
    assert layers.linear_path(weight, tiles, None, layers.AMX_MAX_ROWS + 1) == "torch"
    assert layers.linear_path(weight, tiles, "kernel", 1) == "kernel"  # tuning's pick for one row stands
    x = randn(2, 3, 20, seed=17).bfloat16()
    got = layers.linear(x, weight, bias, tiles)
    assert got.shape == (2, 3, 33) and got.dtype == torch.bfloat16
    want = amx_linear(x.reshape(6, 20), weight).reshape(2, 3, 33) + bias
    assert torch.equal(got, want)


@pytest.mark.parametrize("setting", ["amx", "pairs", "onednn", ""])
def test_the_bf16_packing_rule_and_its_override(monkeypatch, setting):
    """AMX tiles where the CPU has AMX, else pair groups where it has AVX512-BF16, else oneDNN's
    layout; "onednn" always takes oneDNN's, "pairs" takes pair groups over AMX tiles."""
    monkeypatch.setenv("PDSERVE_BF16_PACKING", setting)
    amx = not kernels_off and layers.amx_supported()
    pairs = not kernels_off and layers.pair_groups_supported()
    want = "onednn" if setting == "onednn" else "amx" if amx and setting != "pairs" else "pairs" if pairs else "onednn"
    assert layers.bf16_packing() == want
    packed = layers.pack_weight(randn(24, 8).bfloat16())
    if want == "amx":
        assert packed is not None and layers.is_amx_tiles(packed)
    elif want == "pairs" and not layers.bf16_is_emulated():
        assert packed is not None and layers.is_pair_groups(packed)
    else:  # oneDNN's opaque layout, panels where bf16 is emulated, or none
        assert packed is None or not (layers.is_amx_tiles(packed) or layers.is_pair_groups(packed))
    float32 = layers.pack_weight(randn(24, 8))  # AMX tiles and pair groups are for bfloat16 only
    assert float32 is None or not (layers.is_amx_tiles(float32) or layers.is_pair_groups(float32))


def test_an_unknown_bf16_packing_is_an_error_not_a_silent_default(monkeypatch):
    monkeypatch.setenv("PDSERVE_BF16_PACKING", "tiles")
    with pytest.raises(ValueError, match="PDSERVE_BF16_PACKING='tiles': expected one of amx, pairs, onednn"):
        layers.bf16_packing()
