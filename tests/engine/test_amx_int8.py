"""int8 weights (a scale per output row) in AMX tiles, multiplied by bfloat16 rows on AMX
(csrc/cpu_amx_linear.cpp's `amx_int8_linear`, quant.Int8Linear in a bfloat16 model): the layout
round trip, the product (x times the int8 row, summed in float32, scaled and rounded once), every
row count's path (few rows, one output block at a time, widened groups), rows independent of the
batch, bad arguments refused, which layers keep their values in tiles and at what memory, and a
bfloat16 model with int8 weights tracking float32 transformers on the same rounded weights.

The layout runs on every CPU; the rest needs AMX (an Intel Xeon since Sapphire Rapids) and is
skipped elsewhere, with that reason."""

from __future__ import annotations

import os
import random

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.model import layers, quant
from pdserve.engine.model.quant import Int8Linear

from support.hf_reference import assert_greedy_tracks, load_hf_model, rounded_copy
from support.linear_checks import assert_rows_independent

kernels_off = os.environ.get("PDSERVE_DISABLE_CPU_KERNELS") == "1"
needs_amx = pytest.mark.skipif(kernels_off or not quant.amx_available(),
                               reason="no AMX here (or the CPU kernels are off): the AMX int8 kernel cannot run")
# As test_dtypes' bfloat16 engine: logits of size ~10 carry bf16 errors of a few hundredths.
BF16_LOGPROB_TOLERANCE = 0.1


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def int8_weight(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    weight = randn(out_features, in_features, seed=seed) * torch.logspace(-2, 0, out_features)[:, None]
    return quant.quantize_per_channel(weight)


def test_tiles_give_back_the_int8_rows_they_were_made_of():
    for out_features, in_features in ((1, 1), (70, 45), (64, 32), (130, 100)):
        q = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8,
                          generator=torch.Generator().manual_seed(out_features))
        assert torch.equal(layers.from_amx_tiles(layers.to_amx_tiles(q), out_features, in_features), q)
        tiles = quant.to_amx_int8_tiles(q)
        assert tiles.dtype == torch.uint8 and tiles.shape == (-(-out_features // 64), -(-in_features // 32), 4, 16, 32)
        assert torch.equal(quant.from_amx_int8_tiles(tiles, out_features, in_features), q)
    with pytest.raises(ValueError, match="-128 has no sign-and-magnitude byte"):
        quant.to_amx_int8_tiles(torch.full((2, 2), -128, dtype=torch.int8))


def test_stored_bytes_are_sign_and_magnitude_in_the_widening_order():
    """Byte 16L + 8h + k of each 64 holds element 32h + 8L + k, its sign in bit 7."""
    q = torch.arange(64, dtype=torch.int8).reshape(2, 32) * torch.tensor([1, -1], dtype=torch.int8)[:, None]
    stored = quant.to_amx_int8_tiles(q).flatten()[:64].tolist()  # tile row r holds inputs 2r, 2r + 1 of 16 outputs
    plain = layers.to_amx_tiles(q).flatten()[:64].tolist()
    for h in range(2):
        for lane in range(4):
            for k in range(8):
                value = plain[32 * h + 8 * lane + k]
                assert stored[16 * lane + 8 * h + k] == (0x80 | -value if value < 0 else value)


@needs_amx
# Up to 16 rows: four output blocks per pass; 17 to 127: one block, its tiles widened in the first
# row blocks' pass; from 128 a group widened whole, pairs of blocks. 48 and 17 outputs leave blocks
# and groups part-filled; 300 and 45 inputs a part-filled k-block.
@pytest.mark.parametrize("out_features, in_features", [(1, 1), (17, 33), (48, 40), (64, 32), (200, 300), (130, 45)])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40, 64, 65, 127, 128, 129, 150])
def test_the_product_scales_the_int8_sum_once_and_rounds_once(out_features, in_features, rows):
    """Within one bf16 step (plus float32's summation error) of x times the dequantized weight,
    rounded once, and equal to it on nearly every element."""
    q, scales = int8_weight(out_features, in_features, seed=1)
    x = randn(rows, in_features, seed=2).bfloat16()
    got = torch.ops.pdserve_cpu.amx_int8_linear(x, quant.to_amx_int8_tiles(q), scales)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    exact = x.double() @ quant.dequantize(q, scales).double().T
    rounded = exact.to(torch.bfloat16).double()
    step = rounded.abs().clamp_min(1e-30) * 2.0 ** -7
    magnitudes = q.double().abs() * scales.double()[:, None]
    float32_error = in_features * torch.finfo(torch.float32).eps * (x.double().abs() @ magnitudes.T)
    assert ((got.double() - rounded).abs() <= step + float32_error).all()
    assert (got.double() == rounded).float().mean() > 0.9


@needs_amx
def test_rows_of_x_may_sit_anywhere_in_memory():
    q, scales = int8_weight(40, 64, seed=3)
    tiles = quant.to_amx_int8_tiles(q)
    wide = randn(140, 100, seed=4).bfloat16()
    for x in (wide[:5, 3:67], wide[:40, 36:100], wide[:130, 1:65]):
        assert not x.is_contiguous()
        assert torch.equal(torch.ops.pdserve_cpu.amx_int8_linear(x, tiles, scales),
                           torch.ops.pdserve_cpu.amx_int8_linear(x.contiguous(), tiles, scales))


@needs_amx
def test_a_rows_result_does_not_depend_on_the_batch_or_the_threads():
    """Each path sums a row on its own and in the same order: a request's logits do not change
    with who else is in the batch nor with how many threads run it."""
    q, scales = int8_weight(200, 96, seed=6)
    tiles = quant.to_amx_int8_tiles(q)
    multiply = lambda rows: torch.ops.pdserve_cpu.amx_int8_linear(rows, tiles, scales)  # noqa: E731
    assert_rows_independent(multiply, randn(70, 96, seed=7).bfloat16(), (0, 5, 15, 16, 69), window=20)
    assert_rows_independent(multiply, randn(150, 96, seed=8).bfloat16(), (0, 31, 100, 128, 149), window=140)


@needs_amx
def test_no_rows_give_an_empty_product():
    q, scales = int8_weight(20, 8, seed=9)
    tiles = quant.to_amx_int8_tiles(q)
    empty = torch.ops.pdserve_cpu.amx_int8_linear(torch.empty(0, 8, dtype=torch.bfloat16), tiles, scales)
    assert empty.shape == (0, 20)


def _tiles(out_features: int, in_features: int) -> torch.Tensor:
    return quant.to_amx_int8_tiles(torch.zeros(out_features, in_features, dtype=torch.int8))


@needs_amx
@pytest.mark.parametrize("x, tiles, scales, message", [
    (randn(2, 8), _tiles(20, 8), torch.ones(20), "x must be a 2-D bfloat16 tensor"),
    (randn(2, 8).bfloat16(), layers.to_amx_tiles(torch.zeros(20, 8, dtype=torch.int8)), torch.ones(20),
     "the weight must be in AMX tiles, a contiguous Byte"),
    (randn(2, 8).bfloat16(), _tiles(20, 8), torch.ones(20, dtype=torch.float64), "scales must be a contiguous 1-D"),
    (randn(2, 8).bfloat16(), _tiles(20, 8), torch.ones(20, 1), "scales must be a contiguous 1-D"),
    (randn(2, 40).bfloat16(), _tiles(20, 8), torch.ones(20), "x has 40 columns, the tiles hold 32"),
    (randn(2, 8).bfloat16(), _tiles(20, 8), torch.ones(65), "1 groups of tiles cannot hold 65"),
    (randn(2, 8).bfloat16(), _tiles(70, 8), torch.ones(64), "2 groups of tiles cannot hold 64"),
])
def test_bad_arguments_are_refused_with_a_reason(x, tiles, scales, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.pdserve_cpu.amx_int8_linear(x, tiles, scales)


@needs_amx
def test_a_bfloat16_layer_keeps_one_copy_of_its_int8_values_in_tiles():
    weight, bias = randn(70, 45, seed=10).bfloat16(), randn(70, seed=11)
    layer = Int8Linear(weight, bias)
    rows_layer = Int8Linear(weight.float(), bias)  # a float32 weight keeps its rows
    assert layer.tiles is not None and layer._rows is None and rows_layer.tiles is None
    assert torch.equal(layer.qweight, rows_layer.qweight) and torch.equal(layer.scales, rows_layer.scales)
    assert layer.nbytes == layer.tiles.numel() + 70 * 4 * 2  # the padded tiles, the scales and the bias
    x = randn(3, 2, 45, seed=12).bfloat16()
    got = layer(x)
    assert got.shape == (3, 2, 70) and got.dtype == torch.bfloat16
    product = torch.ops.pdserve_cpu.amx_int8_linear(x.reshape(6, 45), layer.tiles, layer.scales)
    assert torch.equal(got, (product.float() + bias).bfloat16().reshape(3, 2, 70))  # the bias added in float32
    # float32 rows still get the float32 product of the rounded weight
    x32 = randn(4, 45, seed=13)
    assert torch.allclose(layer(x32), torch.nn.functional.linear(x32, layer.dequantize(), bias), rtol=1e-5, atol=1e-4)


@needs_amx
def test_group_scales_and_int8_activations_keep_their_rows():
    """The tiles take one scale per row and bf16 rows of x; Q8_0's group scales and W8A8's int8 rows
    are other arithmetic, kept on their own kernels."""
    weight = randn(64, 64, seed=14).bfloat16()
    assert Int8Linear(weight, group=32).tiles is None
    assert Int8Linear(weight, int8_activations=True).tiles is None
    with pytest.raises(ValueError, match="one scale per row and bfloat16 rows"):
        Int8Linear(weight, group=32, amx=True)


@needs_amx
@pytest.mark.parametrize("name", ["llama", "qwen2", "tied"])
def test_bfloat16_int8_engine_tracks_float32_transformers_on_the_rounded_weights(model_dir, name):
    """The bf16 model with int8 weights computes what transformers computes in float32 with the
    weights rounded to int8, within bf16's error (qwen2's q/k/v biases and a tied lm_head included),
    and its decode steps run the one-call loop on the tiles."""
    from pdserve.engine.model import decode_call

    path = model_dir(name)
    hf = rounded_copy(load_hf_model(path), "int8")
    llm = LLM(path, dtype="bfloat16", quantization="int8", num_kv_blocks=128)
    try:
        model = llm.engine.client.engine_core.executor.worker.runner.model
        quantized = [m.quantized for m in model.modules() if getattr(m, "quantized", None) is not None]
        assert quantized and all(q.tiles is not None for q in quantized)
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert decode_call.linear_path(qkv, 1) == decode_call.linear_path(qkv, 40) == "amx_int8"
        rng = random.Random(11)
        prompts = [[rng.randrange(3, 4096) for _ in range(n)] for n in (5, 17, 40, 90)]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=8, logprobs=1, ignore_eos=True))
    finally:
        llm.shutdown()
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
    assert_greedy_tracks(hf, prompts, outputs, BF16_LOGPROB_TOLERANCE)
