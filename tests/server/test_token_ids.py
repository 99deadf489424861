"""`return_token_ids` (as vLLM): choices carry the generated token ids and the prompt's, streamed
chunk by chunk. The router resumes a broken stream on another engine from exactly these ids, so
they must be the engine's own: the prompt as its tokenizer splits it, the completion as sampled.
"""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import pytest

from support.server import ServerProcess

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over"
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def model(model_dir) -> str:
    return model_dir("llama")


@pytest.fixture(scope="module")
def tokenizer(model):
    from pdserve.engine.frontend.tokenizer import load_tokenizer

    return load_tokenizer(model)


AUTH = {"Authorization": "Bearer sekret"}


@pytest.fixture(scope="module")
def server(tiny_server) -> ServerProcess:
    return tiny_server  # tests/server/conftest.py: the llama model served as "tiny", key "sekret"


def post(server: ServerProcess, route: str, **body) -> dict:
    response = httpx.post(f"{server.base_url}/{route}", json={"model": MODEL, "temperature": 0, **body},
                          headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def stream(server: ServerProcess, route: str, **body) -> list[dict]:
    """Every data event's choices, in order (one choice per event, as the server sends them)."""
    choices = []
    with httpx.stream("POST", f"{server.base_url}/{route}", headers=AUTH, timeout=60,
                      json={"model": MODEL, "temperature": 0, "stream": True, **body}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                choices.extend(event["choices"])
    return choices


def test_completion_choices_carry_the_prompt_and_generated_ids(server, tokenizer):
    answer = post(server, "completions", prompt=PROMPT, max_tokens=10, ignore_eos=True, return_token_ids=True)
    choice = answer["choices"][0]
    assert choice["prompt_token_ids"] == list(tokenizer.encode(PROMPT))
    assert len(choice["token_ids"]) == answer["usage"]["completion_tokens"] == 10
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["text"]
    # Asked for nothing, the answer is the plain OpenAI one.
    plain = post(server, "completions", prompt=PROMPT, max_tokens=10, ignore_eos=True)["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain and plain["text"] == choice["text"]


def test_streamed_ids_add_up_to_the_whole_answer_per_choice(server, tokenizer):
    prompts = [PROMPT, "Once upon a time there"]
    whole = post(server, "completions", prompt=prompts, n=2, max_tokens=9, ignore_eos=True, return_token_ids=True)
    chunks = stream(server, "completions", prompt=prompts, n=2, max_tokens=9, ignore_eos=True, return_token_ids=True)
    ids: dict[int, list[int]] = defaultdict(list)
    text: dict[int, str] = defaultdict(str)
    prompt_ids: dict[int, list[list[int]]] = defaultdict(list)
    for choice in chunks:
        ids[choice["index"]] += choice["token_ids"]  # present on every chunk, [] when it has none
        text[choice["index"]] += choice["text"]
        if "prompt_token_ids" in choice:
            prompt_ids[choice["index"]].append(choice["prompt_token_ids"])
    assert sorted(ids) == [0, 1, 2, 3]
    assert sum(1 for c in chunks if c["token_ids"]) > 4  # piece by piece, not one event per choice
    for c in whole["choices"]:
        i = c["index"]
        assert ids[i] == c["token_ids"] and len(ids[i]) == 9
        assert text[i] == c["text"] == tokenizer.decode(ids[i], skip_special_tokens=True)
        # Only a choice's first chunk carries the prompt's ids, those of its own prompt.
        assert prompt_ids[i] == [list(tokenizer.encode(prompts[i // 2]))] == [c["prompt_token_ids"]]


def test_chat_choices_carry_the_rendered_prompt_and_generated_ids(server, tokenizer):
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    whole = post(server, "chat/completions", messages=MESSAGES, max_tokens=8, ignore_eos=True, return_token_ids=True)
    choice = whole["choices"][0]
    assert choice["prompt_token_ids"] == rendered and len(rendered) == whole["usage"]["prompt_tokens"]
    assert len(choice["token_ids"]) == 8
    assert tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["message"]["content"]

    chunks = stream(server, "chat/completions", messages=MESSAGES, max_tokens=8, ignore_eos=True,
                    return_token_ids=True)
    assert chunks[0]["delta"]["role"] == "assistant"
    assert chunks[0]["token_ids"] == [] and chunks[0]["prompt_token_ids"] == rendered
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == choice["message"]["content"]
