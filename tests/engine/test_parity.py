"""Greedy generation equals Hugging Face transformers token for token, on the same weights."""

from __future__ import annotations

import random

import pytest

from pdserve.engine import LLM, SamplingParams

from support.hf_reference import hf_greedy, load_hf_model

# Lengths around block boundaries (block size 16) and across several blocks.
PROMPT_LENGTHS = [1, 7, 15, 16, 17, 40, 64, 130]
MAX_NEW_TOKENS = 32


def random_prompts(seed: int, lengths: list[int], vocab: int = 4096) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("name", ["llama", "qwen2", "tied", "mistral", "llama3_rope"])
def test_greedy_matches_transformers(model_dir, name):
    path = model_dir(name)
    prompts = random_prompts(hash(name) % 1000, PROMPT_LENGTHS)
    expected = hf_greedy(load_hf_model(path), prompts, MAX_NEW_TOKENS)

    llm = LLM(path, dtype="float32", num_kv_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)

    assert [o.prompt_token_ids for o in outputs] == prompts
    for prompt, out, want in zip(prompts, outputs, expected):
        got = out.outputs[0].token_ids
        assert got == want, f"prompt of {len(prompt)} tokens diverges at {next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)}"
        assert out.outputs[0].finish_reason == "length"


def test_text_prompts_match_transformers_tokenization_and_generation(model_dir):
    from transformers import AutoTokenizer

    path = model_dir("llama")
    texts = ["Hello world", "The license grants permission to copy, modify and distribute", "naïve café — 日本語"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    expected = hf_greedy(load_hf_model(path), [tokenizer.encode(t) for t in texts], 16)
    llm = LLM(path, dtype="float32")
    outputs = llm.generate(texts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    for text, out, want in zip(texts, outputs, expected):
        assert out.prompt == text
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].text == tokenizer.decode(want, skip_special_tokens=True)
