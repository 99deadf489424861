"""bfloat16 weights in pair groups (engine/model/layers.py's to_pair_groups) multiplied with vdpbf16ps
by csrc/cpu_bf16_pair_linear.cpp, the bf16 layout where the CPU has AVX512-BF16 but no AMX (AMD Zen 4
and 5): the layout, the product (bf16 products summed in float32 and rounded once), every shape a
model has (part-filled groups, odd reductions, any row count, past one pass over k), each row
independent of the batch and of the thread count, bad arguments refused, and layers.linear's path.

The layout runs on every CPU; the kernel's tests need AVX512-BF16 and are skipped elsewhere, with
that reason. The one-call decode step on pair groups is test_decode_call's."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.engine.model import layers
from support.linear_checks import assert_rounded_once, assert_rows_independent

kernels_off = os.environ.get("PDSERVE_DISABLE_CPU_KERNELS") == "1"
needs_pairs = pytest.mark.skipif(kernels_off or not layers.pair_groups_supported(),
                                 reason="no AVX512-BF16 here (or the CPU kernels are off): the pairs kernel cannot run")


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def pair_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.pdserve_cpu.pair_linear(x, layers.to_pair_groups(weight), weight.shape[0])


def test_groups_hold_each_weight_element_where_the_kernel_reads_it_and_zero_past_the_edges():
    weight = randn(70, 45).bfloat16()
    pairs = layers.to_pair_groups(weight)
    assert pairs.shape == (2, 23, 48, 2) and pairs.dtype == torch.bfloat16 and pairs.is_contiguous()
    for n in (0, 15, 16, 47, 48, 69):
        for k in (0, 1, 30, 31, 44):
            assert pairs[n // 48, k // 2, n % 48, k % 2] == weight[n, k]
    assert pairs.float().abs().sum() == weight.float().abs().sum()  # everything else is zero
    assert torch.equal(layers.from_pair_groups(pairs, 70, 45), weight)
    assert layers.is_pair_groups(pairs) and not layers.is_panels(pairs) and not layers.is_amx_tiles(pairs)


@needs_pairs
# 48 outputs fill one group, 49 and 100 end in a part-filled one; 300 and 600 inputs take more than
# one pass over k (64 pairs a pass up to 64 rows, 128 past that), 3 and 33 end on half a pair.
@pytest.mark.parametrize("out_features, in_features", [(1, 1), (15, 3), (17, 33), (48, 40), (49, 64), (100, 300),
                                                       (768, 600)])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 17, 70, 150])
def test_the_product_sums_in_float32_and_rounds_once(out_features, in_features, rows):
    """Within one bf16 step (plus float32's summation error, where the sum cancels) of the exactly
    rounded sum, equal to it on nearly every element, and as close to it as torch's own bf16 matmul."""
    weight = (randn(out_features, in_features, seed=1) / 7).bfloat16()
    x = randn(rows, in_features, seed=2).bfloat16()
    assert_rounded_once(pair_linear(x, weight), x, weight)


@needs_pairs
def test_rows_of_x_may_sit_anywhere_in_memory():
    """Strided, transposed and odd-offset rows (read a pair at a time, so copied where a pair would
    straddle) give what contiguous ones give."""
    weight = randn(40, 64, seed=3).bfloat16()
    wide = randn(20, 100, seed=4).bfloat16()
    for x in (wide[:, 3:67], wide[:17, 36:100], randn(64, 9, seed=5).bfloat16().T, randn(5, 65).bfloat16()[:, 1:]):
        assert not x.is_contiguous()
        assert torch.equal(pair_linear(x, weight), pair_linear(x.contiguous(), weight))


@needs_pairs
def test_a_rows_result_does_not_depend_on_the_batch_or_the_threads():
    """Each row of x is summed on its own: a request's logits do not change with who else is in
    the batch nor with how many threads run it."""
    weight = randn(200, 300, seed=6).bfloat16()
    pairs = layers.to_pair_groups(weight)
    x = randn(70, 300, seed=7).bfloat16()
    assert_rows_independent(lambda rows: torch.ops.pdserve_cpu.pair_linear(rows, pairs, 200), x, (0, 5, 8, 16, 69),
                            window=20)


@needs_pairs
def test_a_long_input_goes_through_in_slices_that_change_no_row():
    """Past 512 rows (a prefill chunk) the rows go through in slices, over several passes of k: every
    row, in the first slice, the last or across a slice's edge, has the bits it has alone, and the
    product is rounded once."""
    weight = (randn(100, 300, seed=8) / 7).bfloat16()
    pairs = layers.to_pair_groups(weight)
    x = randn(1100, 300, seed=9).bfloat16()
    assert_rows_independent(lambda rows: torch.ops.pdserve_cpu.pair_linear(rows, pairs, 100), x,
                            (0, 255, 256, 279, 280, 559, 560, 839, 840, 1099), window=20)
    assert_rounded_once(pair_linear(x, weight), x, weight)


@needs_pairs
def test_no_rows_or_no_inputs_give_an_empty_or_zero_product():
    pairs = layers.to_pair_groups(randn(20, 8).bfloat16())
    assert torch.ops.pdserve_cpu.pair_linear(torch.empty(0, 8, dtype=torch.bfloat16), pairs, 20).shape == (0, 20)
    empty = layers.to_pair_groups(torch.empty(20, 0, dtype=torch.bfloat16))
    got = torch.ops.pdserve_cpu.pair_linear(torch.empty(3, 0, dtype=torch.bfloat16), empty, 20)
    assert got.shape == (3, 20) and not got.any()


@needs_pairs
@pytest.mark.parametrize("x, pairs, out_features, message", [
    (randn(2, 8), layers.to_pair_groups(randn(20, 8).bfloat16()), 20, "x must be a 2-D bfloat16 tensor"),
    (randn(2, 2, 8).bfloat16(), layers.to_pair_groups(randn(20, 8).bfloat16()), 20, "x must be a 2-D bfloat16"),
    (randn(2, 8).bfloat16(), layers.to_amx_tiles(randn(20, 8).bfloat16()), 20, "the weight must be contiguous"),
    (randn(2, 8).bfloat16(), layers.to_pair_groups(randn(20, 8)), 20, "the weight must be contiguous bfloat16"),
    (randn(2, 40).bfloat16(), layers.to_pair_groups(randn(20, 8).bfloat16()), 20, "x has 40 columns, the weight 8"),
    (randn(2, 8).bfloat16(), layers.to_pair_groups(randn(20, 8).bfloat16()), 49, "1 groups cannot hold 49"),
    (randn(2, 8).bfloat16(), layers.to_pair_groups(randn(70, 8).bfloat16()), 48, "2 groups cannot hold 48"),
])
def test_bad_arguments_are_refused_with_a_reason(x, pairs, out_features, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pdserve_cpu.pair_linear(x, pairs, out_features)


@needs_pairs
def test_layers_linear_takes_the_pairs_at_every_row_count_and_keeps_shape_and_bias(monkeypatch):
    monkeypatch.setenv("PDSERVE_BF16_PACKING", "pairs")
    weight, bias = randn(33, 20, seed=15).bfloat16(), randn(33, seed=16).bfloat16()
    pairs = layers.pack_weight(weight)
    assert layers.is_pair_groups(pairs)
    for rows in (1, 16, 4096):
        assert layers.linear_path(weight, pairs, None, rows) == "pairs"
    assert layers.linear_path(weight, pairs, "kernel", 1) == "kernel"  # tuning's pick for one row stands
    x = randn(2, 3, 20, seed=17).bfloat16()
    got = layers.linear(x, weight, bias, pairs)
    assert got.shape == (2, 3, 33) and got.dtype == torch.bfloat16
    want = pair_linear(x.reshape(6, 20), weight).reshape(2, 3, 33) + bias
    assert torch.equal(got, want)
