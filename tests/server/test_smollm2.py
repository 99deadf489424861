"""`pdserve serve --model smollm2`: the real built-in model answers through the OpenAI API."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import torch

from pdserve.engine.config import auto_cpu_dtype_here
from pdserve.engine.demo import resolve_model
from pdserve.engine.model.gguf_convert import smollm2_gguf

from support.server import run_server

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(request, tmp_path_factory):
    # dtype auto, as `make serve` runs it: bfloat16 where it is the faster (AMX, or AVX512-BF16
    # timed faster), else float32.
    cfg = json.loads((Path(resolve_model("smollm2")) / "config.json").read_text())
    if auto_cpu_dtype_here(torch.bfloat16, cfg)[0] == torch.float32:
        # Here auto means float32: the session's float32 smollm2 server is the same model in the same
        # dtype (its longer max-model-len and 16-token prefill chunks change nothing asserted here),
        # and sharing it saves a smollm2 start-up in make test.
        yield request.getfixturevalue("smollm2_f32_server")
        return
    with run_server("smollm2", "--dtype", "auto", tmp_path=tmp_path_factory.mktemp("smollm2")) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_models_endpoint_reports_smollm2(client):
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_capital_of_france_is_paris_with_the_models_own_chat_template(client):
    from transformers import AutoTokenizer

    resp = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=32)
    answer = resp.choices[0].message.content
    assert "Paris" in answer, answer
    assert resp.choices[0].finish_reason == "stop"  # ended on <|im_end|>, which is not in the text
    assert "<|im_end|>" not in answer
    # Prompt tokens: SmolLM2's template (with its default system turn) as transformers builds it from the GGUF.
    path = smollm2_gguf()
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    expected = reference.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"]
    assert "You are a helpful AI assistant named SmolLM" in reference.decode(expected)
    assert resp.usage.prompt_tokens == len(expected)
    # The same ids sent as a raw completion prompt give the same greedy answer.
    raw = client.completions.create(model="smollm2", prompt=expected, temperature=0, max_tokens=32)
    assert raw.choices[0].text == answer


def test_streamed_answer_equals_the_whole_one(client):
    whole = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=32)
    stream = client.chat.completions.create(model="smollm2", messages=QUESTION, temperature=0, max_tokens=32,
                                            stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content
