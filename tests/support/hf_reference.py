"""Hugging Face transformers as the reference for generation: greedy, one prompt at a time."""

from __future__ import annotations

import torch

from pdserve.engine.model import quant


def load_hf_model(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    # Generate exactly max_new_tokens: the engine runs these requests with ignore_eos.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    results = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        results.append(out[0, len(ids):].tolist())
    return results


@torch.inference_mode()
def hf_next_token_logits(model, token_ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([token_ids])).logits[0, -1].float()


def assert_greedy_tracks(model, prompts: list[list[int]], outputs, tolerance: float) -> None:
    """Each token the engine picked greedily (with `logprobs=1`) is transformers' argmax at that
    position or tied with it within `tolerance` in log-probability, and the engine's log-probability
    of it is transformers' within `tolerance`: a half-precision engine computing `model`'s function."""
    for prompt, out in zip(prompts, outputs):
        context = list(prompt)
        completion = out.outputs[0]
        for token, entry in zip(completion.token_ids, completion.logprobs):
            reference = torch.log_softmax(hf_next_token_logits(model, context), -1)
            assert reference.max().item() - reference[token].item() < tolerance
            assert abs(entry[token].logprob - reference[token].item()) < tolerance
            context.append(token)


def rounded_copy(hf_model, method: str = "int8"):
    """transformers' model with every linear weight replaced by its int8 rounding, dequantized.

    New tensors, not in-place copies: an lm_head tied to the embedding is rounded alone, as the
    engine rounds it (the embedding keeps its float rows)."""
    for module in hf_model.modules():
        if isinstance(module, torch.nn.Linear):
            q, scales = (quant.quantize_per_channel(module.weight) if method == "int8"
                         else quant.quantize_groups(module.weight, quant.Q8_0_GROUP))
            module.weight = torch.nn.Parameter(quant.dequantize(q, scales), requires_grad=False)
    return hf_model
