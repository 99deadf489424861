"""`int8_activations=True` (`--int8-activations`): decode rows rounded to int8 in blocks of 32, one
scale each, and integer dot products with the int8 weights (W8A8, as llama.cpp's Q8_0 path).

The kernel is checked against the same arithmetic written in torch (exact integer block sums), its
error against the float product by the bound the rounding allows, and a row against the rows
batched with it. The rounding's effect on the real model is stated as a tolerance on logits and
on greedy choices, for the engine and for transformers running the same rounding.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.config import EngineArgs
from pdserve.engine.model import quant
from pdserve.engine.model.decode_call import linear_path
from pdserve.engine.model.quant import Int8Linear

from support.hf_reference import hf_greedy, load_hf_model, rounded_copy

BLOCK = quant.ACT_BLOCK
# SmolLM2-135M with Q8_0 weights and int8 activations against float32, teacher-forced, over the
# prompts of the test below (measured on a Zen 3 EPYC): relative logits error over a prompt (0.037-
# 0.041; the weights' rounding alone: 0.013-0.03), the share of greedy choices that are float32's
# (transformers with the rounding, on float32's text: 0.96; the engine, on its own text: 0.92-0.93), and
# the mean gap between the engine's log-probability of its choice and float32's (0.038).
SMOLLM2_A8_LOGITS_REL_TOLERANCE = 0.07
SMOLLM2_A8_AGREEMENT = 0.9
SMOLLM2_A8_ENGINE_AGREEMENT = 0.85
SMOLLM2_A8_LOGPROB_GAP = 0.1


def round_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows to int8 in blocks of BLOCK, as the kernel does: (int8 values, one scale per block)."""
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    scale = blocks.abs().amax(-1) / quant.QMAX
    inverse = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return torch.round(blocks * inverse[..., None]).to(torch.int8), scale  # half to even, as the kernel


def reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in float64: exact integer sums per block, times the two scales."""
    xq, xd = round_activations(x)  # [rows, blocks, BLOCK], [rows, blocks]
    wq = q.reshape(q.shape[0], -1, BLOCK).long()
    dots = torch.einsum("mbk,nbk->mnb", xq.long(), wq).double()  # exact
    if scales.dim() == 2:
        w_scale = scales.double().repeat_interleave(q.shape[1] // scales.shape[1] // BLOCK, dim=1)  # per block
        return (dots * xd.double()[:, None, :] * w_scale[None]).sum(-1)
    return (dots * xd.double()[:, None, :]).sum(-1) * scales.double()


def operands(seed: int, rows: int, out_features: int, in_features: int, group: int | None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen) * torch.logspace(-2, 1, in_features)[torch.randperm(
        in_features, generator=gen)]  # blocks of very different size, as real activations with outliers
    q = torch.randint(-127, 128, (out_features, in_features), dtype=torch.int8, generator=gen)
    shape = (out_features, in_features // group) if group else (out_features,)
    return x, q, torch.rand(shape, generator=gen) * 0.02 + 1e-3


@pytest.mark.parametrize("rows", [1, 2, 4, 5, quant.SMALL_ROWS])
@pytest.mark.parametrize("out_features, in_features, group", [(1, 32, 32), (33, 96, 32), (40, 576, 32),
                                                              (17, 1536, 64), (70, 64, None), (9, 608, None)])
def test_kernel_equals_the_block_arithmetic(kernels_ready, rows, out_features, in_features, group):
    """Only the float32 sum of the exact block dot products may differ from float64: a handful of
    terms (one per block, in two chains of vector lanes), so within 2e-6 of their magnitudes. One
    activation rounded differently would move a result by about 1e-5 of it."""
    x, q, scales = operands(rows * out_features + in_features, rows, out_features, in_features, group)
    got = torch.ops.pdserve_cpu.int8_linear_a8(x, q, scales)
    xq, xd = round_activations(x)
    w = quant.dequantize(q, scales).double()
    magnitude = (xq.reshape(rows, -1).double().abs() * xd.double().repeat_interleave(BLOCK, 1)) @ w.abs().T
    assert got.shape == (rows, out_features)
    assert torch.all((got.double() - reference(x, q, scales)).abs() <= 2e-6 * magnitude + 1e-9)


@pytest.mark.parametrize("group", [32, None])
def test_error_against_float_activations_is_within_the_rounding_bound(kernels_ready, group):
    """Each activation moves by at most half a step of its block: the result by at most the sum of
    (half step x |weight|) over the row, and in practice by far less (errors of both signs)."""
    x, q, scales = operands(3, 6, 64, 576, group)
    got = torch.ops.pdserve_cpu.int8_linear_a8(x, q, scales).double()
    w = quant.dequantize(q, scales).double()
    exact = x.double() @ w.T
    _, xd = round_activations(x)
    bound = (xd.double().repeat_interleave(BLOCK, 1) / 2) @ w.abs().T
    err = (got - exact).abs()
    assert torch.all(err <= bound * (1 + 1e-5) + 1e-6)
    assert err.norm() / exact.norm() < 0.01  # about 0.3% here: the rounding averages out


def test_a_row_gets_the_same_result_in_any_batch(kernels_ready):
    """Each row is rounded with its own block scales and summed in one order: a request's decode
    output does not depend on the requests batched with it (within the kernel's rows)."""
    x, q, scales = operands(4, quant.SMALL_ROWS, 100, 576, 32)
    whole = torch.ops.pdserve_cpu.int8_linear_a8(x, q, scales)
    for lo, hi in ((0, 1), (3, 7), (10, quant.SMALL_ROWS)):
        assert torch.equal(torch.ops.pdserve_cpu.int8_linear_a8(x[lo:hi], q, scales), whole[lo:hi])


def test_all_zero_blocks_and_bad_shapes(kernels_ready):
    x, q, scales = operands(5, 2, 8, 96, 32)
    x[:, 32:64] = 0  # a zero block must not divide by zero
    got = torch.ops.pdserve_cpu.int8_linear_a8(x, q, scales)
    assert torch.isfinite(got).all()
    assert torch.allclose(got.double(), reference(x, q, scales), rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="do not split into blocks of 32"):
        torch.ops.pdserve_cpu.int8_linear_a8(torch.randn(1, 40), torch.zeros(3, 40, dtype=torch.int8), torch.ones(3))
    with pytest.raises(RuntimeError, match="groups do not split a row"):
        torch.ops.pdserve_cpu.int8_linear_a8(torch.randn(1, 96), torch.zeros(3, 96, dtype=torch.int8),
                                             torch.ones(3, 12))  # groups of 8: smaller than a block
    with pytest.raises(RuntimeError, match="groups do not split a row"):
        torch.ops.pdserve_cpu.int8_linear_a8(torch.randn(1, 0), torch.zeros(3, 0, dtype=torch.int8),
                                             torch.ones(3, 1))  # empty rows: no group size at all


def test_layer_rounds_activations_in_decode_rows_only(kernels_ready):
    gen = torch.Generator().manual_seed(6)
    weight, bias = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    layer = Int8Linear(weight, bias, group=32, int8_activations=True)
    plain = Int8Linear(weight, bias, group=32)
    few = torch.randn(3, 64, generator=gen)
    assert layer.int8_activations and layer.kernel_takes(3)
    assert torch.equal(layer(few), torch.ops.pdserve_cpu.int8_linear_a8(few, layer.qweight, layer.scales) + bias)
    assert not torch.equal(layer(few), plain(few))
    many = torch.randn(quant.SMALL_ROWS + 1, 64, generator=gen)  # a prefill chunk: float activations
    assert torch.equal(layer(many), plain(many))
    # Rounded rows are the same on every CPU, though weight-only int8 may hand fewer rows to its kernel.
    assert layer.register_rows == quant.SMALL_ROWS >= plain.register_rows
    edge = torch.randn(quant.SMALL_ROWS, 64, generator=gen)
    assert torch.equal(layer(edge), torch.ops.pdserve_cpu.int8_linear_a8(edge, layer.qweight, layer.scales) + bias)
    # Rows that do not split into blocks of 32, or groups smaller than a block: float activations.
    assert not Int8Linear(torch.randn(8, 40), int8_activations=True).int8_activations
    assert not Int8Linear(torch.randn(8, 64), group=16, int8_activations=True).int8_activations
    assert Int8Linear(torch.randn(8, 64), int8_activations=True).int8_activations


def test_the_one_call_decode_step_takes_the_int8_activation_path(kernels_ready, model_dir):
    llm = LLM(model_dir("llama"), dtype="float32", quantization="q8_0", int8_activations=True, num_kv_blocks=64)
    model = llm.engine.client.engine_core.executor.worker.runner.model
    assert linear_path(model.model.layers[0].mlp.down_proj, 1) == "int8_a8"
    past = "int8_gemm" if quant.gemm_available() else None  # float activations, as in the modules
    assert linear_path(model.model.layers[0].mlp.down_proj, quant.SMALL_ROWS) == "int8_a8"
    assert linear_path(model.model.layers[0].mlp.down_proj, quant.SMALL_ROWS + 1) == past
    llm.shutdown()


def test_flag_needs_int8_weights_and_reaches_the_engine(model_dir):
    from pdserve.engine.server.cli import add_arguments, engine_args_from

    path = model_dir("llama")
    with pytest.raises(ValueError, match="int8 activations need int8 weights"):
        EngineArgs(model=path, device="cpu", int8_activations=True).create_engine_config()
    config = EngineArgs(model=path, device="cpu", quantization="int8", int8_activations=True).create_engine_config()
    assert config.model.int8_activations
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert engine_args_from(parser.parse_args(["--model", "demo", "--int8-activations"])).int8_activations
    assert not engine_args_from(parser.parse_args(["--model", "demo"])).int8_activations


def patch_rounding(hf_model, max_rows: int) -> None:
    """transformers' linear layers round their input as the engine's kernel does, in forwards of at
    most `max_rows` rows (SMALL_ROWS: generate's one-token steps, as the engine's decode steps, not
    a longer prompt's forward)."""
    def forward(module, x):
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= max_rows and x.shape[-1] % BLOCK == 0:
            xq, xd = round_activations(rows)
            x = (xq.float() * xd[..., None]).reshape(x.shape)
        return torch.nn.functional.linear(x, module.weight, module.bias)

    for module in hf_model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = forward.__get__(module)


def test_smollm2_q8_0_with_int8_activations_stays_within_tolerance_of_float32():
    """On the real model, the rounding's effect is stated as a tolerance, for the engine and for the
    same arithmetic in transformers.

    Rounding activations is discontinuous: on SmolLM2, whose activations have large outliers, a
    perturbation of 1e-6 of the embeddings moved the rounded model's log-probabilities by up to
    0.13 (measured in transformers alone). The engine's float parts equal transformers' to about
    that, so token-for-token equality with transformers is not what holds here; closeness to
    float32 is."""
    from transformers import AutoTokenizer

    from pdserve.engine.demo import resolve_model

    path = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time, in a small village,"]
    prompts = [tokenizer.encode(t) for t in texts]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    llm = LLM(path, dtype="float32", max_model_len=256, num_kv_blocks=64, quantization="q8_0", int8_activations=True)
    outputs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    llm.shutdown()
    full = load_hf_model(path)
    rounded = rounded_copy(load_hf_model(path), "q8_0")
    patch_rounding(rounded, 1 << 30)  # every row rounded alone, as a decode step rounds it

    # The engine: its greedy choices and their log-probabilities against float32's, teacher-forced.
    agree = total = 0
    gaps = []
    with torch.inference_mode():
        for prompt, out in zip(prompts, outputs):
            picks = torch.tensor(out.token_ids)
            logprobs = full(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1].log_softmax(-1)
            agree += (logprobs.argmax(-1) == picks).sum().item()
            total += picks.numel()
            engine = torch.tensor([d[t].logprob for d, t in zip(out.logprobs, out.token_ids)])
            gaps.append((logprobs.gather(1, picks[:, None]).squeeze(1) - engine).abs())
    assert agree / total >= SMOLLM2_A8_ENGINE_AGREEMENT, f"{agree}/{total} of the engine's choices are float32's"
    assert torch.cat(gaps).mean() < SMOLLM2_A8_LOGPROB_GAP

    # The arithmetic alone, on float32's greedy text: logits error and greedy choices kept.
    texts_f32 = [p + out for p, out in zip(prompts, hf_greedy(full, prompts, 24))]
    agree = total = 0
    with torch.inference_mode():
        for prompt, seq in zip(prompts, texts_f32):
            ids = torch.tensor([seq])
            want, got = full(ids).logits[0, len(prompt) - 1:-1], rounded(ids).logits[0, len(prompt) - 1:-1]
            assert (got - want).norm() / want.norm() < SMOLLM2_A8_LOGITS_REL_TOLERANCE
            agree += (got.argmax(-1) == want.argmax(-1)).sum().item()
            total += want.shape[0]
    assert agree / total >= SMOLLM2_A8_AGREEMENT, f"{agree}/{total} greedy choices kept"


def test_up_passes_the_flag_to_every_engine_and_only_with_it():
    from pdserve import up
    from pdserve.engine.server.cli import add_arguments, engine_args_from

    def engines(*argv: str) -> list[argparse.Namespace]:
        parser = argparse.ArgumentParser()
        up.add_arguments(parser)
        plan = up.build_plan(parser.parse_args(["--prefill", "1", "--decode", "2", *argv]),
                             up.ModelSource("/models/m", "/models/m", "/models/m"))
        serve = argparse.ArgumentParser()
        add_arguments(serve)
        return [serve.parse_args(list(c.argv[1:])) for c in plan.components if c.argv[:1] == ("serve",)]

    on, off = engines("--int8-activations", "--quantization", "q8_0"), engines()
    assert len(on) == 3 and all(engine_args_from(a).int8_activations for a in on)
    assert len(off) == 3 and not any(engine_args_from(a).int8_activations for a in off)
