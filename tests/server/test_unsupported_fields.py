"""A request field pdserve does not implement is a 400 naming it (`param`), never a silent ignore;
OpenAI's fields that have no effect on a self-hosted server are accepted."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

MESSAGES = [{"role": "user", "content": "Hello"}]
AUTH = {"Authorization": "Bearer sekret"}  # the shared tiny_server's key


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server  # tests/server/conftest.py: the llama model, max-logprobs 5, key "sekret"


@pytest.fixture(scope="module")
def vocab_size(model_dir) -> int:
    return json.loads((Path(model_dir("llama")) / "config.json").read_text())["vocab_size"]


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "temperature": 0, **fields}


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "Hello world", "max_tokens": 2, "temperature": 0, **fields}


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/{route}", json=body, headers=AUTH, timeout=120)


def image(url: str = "https://example.com/cat.png") -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


REFUSED = [
    # (name, route, body, param, message fragment)
    ("unknown top-level field", "chat/completions", chat(frobnicate=1), "frobnicate", "unsupported field 'frobnicate'"),
    ("unknown completions field", "completions", completion(frobnicate=True), "frobnicate", "unsupported field"),
    ("messages on completions", "completions", completion(messages=MESSAGES), "messages", "unsupported field"),
    ("deprecated functions", "chat/completions", chat(functions=[{"name": "f", "parameters": {}}]), "functions",
     "use tools"),
    ("deprecated function_call", "chat/completions", chat(function_call="auto"), "function_call", "tool_choice"),
    ("audio output", "chat/completions", chat(audio={"voice": "alloy", "format": "wav"}), "audio", "unsupported"),
    ("audio modality", "chat/completions", chat(modalities=["text", "audio"]), "modalities", '["text"]'),
    ("predicted outputs", "chat/completions", chat(prediction={"type": "content", "content": "x"}), "prediction",
     "unsupported"),
    ("web search", "chat/completions", chat(web_search_options={}), "web_search_options", "unsupported"),
    ("reasoning effort", "chat/completions", chat(reasoning_effort="high"), "reasoning_effort", "unsupported"),
    ("store true", "chat/completions", chat(store=True), "store", "not stored"),
    ("flex service tier", "chat/completions", chat(service_tier="flex"), "service_tier", "auto"),
    ("non-string metadata", "chat/completions", chat(metadata={"a": 1}), "metadata", "string"),
    ("guided whitespace pattern", "completions", completion(guided_json={"type": "object"},
                                                            guided_whitespace_pattern=r"\s*"),
     "guided_whitespace_pattern", "disable_any_whitespace"),
    ("outlines backend", "completions", completion(guided_regex="a+", guided_decoding_backend="outlines"),
     "guided_decoding_backend", "xgrammar"),
    ("unknown structured_outputs key", "completions",
     completion(structured_outputs={"regex": "a+", "whitespace_pattern": " "}), "structured_outputs.whitespace_pattern",
     "unsupported field 'whitespace_pattern'"),
    ("unknown json_schema key", "chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "examples": []}}),
     "response_format.json_schema.examples", "unsupported field"),
    ("unknown response_format type", "chat/completions", chat(response_format={"type": "xml"}), "response_format",
     "'xml' is not supported"),
    ("image part", "chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": "see"}, image()]}]),
     "messages[0].content[1]", "image_url"),
    ("audio part in a later message", "chat/completions",
     chat(messages=[*MESSAGES, {"role": "assistant", "content": "hi"},
                    {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]),
     "messages[2].content[0]", "input_audio"),
    ("file part", "chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}]),
     "messages[0].content[0]", "file"),
    ("unknown message field", "chat/completions",
     chat(messages=[{"role": "user", "content": "x", "attachments": ["a"]}]), "messages[0].attachments",
     "unsupported field"),
    ("unknown text part field", "chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {}}]}]),
     "messages[0].content[0].cache_control", "unsupported field"),
    ("suffix", "completions", completion(suffix="!"), "suffix", "suffix"),
    ("best_of above n", "completions", completion(best_of=2), "best_of", "best_of"),
    ("logprobs above the maximum", "completions", completion(logprobs=6), "logprobs", "maximum of 5"),
    ("top_logprobs above the maximum", "chat/completions", chat(logprobs=True, top_logprobs=6), "top_logprobs",
     "maximum of 5"),
    ("logit_bias value out of range", "completions", completion(logit_bias={"1": 101}), "logit_bias", "[-100, 100]"),
    ("logit_bias key not a token id", "completions", completion(logit_bias={"hello": 1}), "logit_bias", "token ids"),
    # pydantic's own type errors still name the field
    ("wrong response_format shape", "chat/completions", chat(response_format="json"), "response_format", "valid"),
    ("wrong guided_choice type", "completions", completion(guided_choice="yes"), "guided_choice", "valid list"),
]


@pytest.mark.parametrize("name, route, body, param, fragment", REFUSED, ids=[c[0] for c in REFUSED])
def test_unsupported_field_is_a_400_naming_it(server, name, route, body, param, fragment):
    resp = post(server, route, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert fragment.lower() in error["message"].lower(), error


def test_logit_bias_outside_the_vocabulary_is_refused(server, vocab_size):
    for route, body in (("completions", completion(logit_bias={str(vocab_size): 5})),
                        ("chat/completions", chat(logit_bias={str(vocab_size + 10): -5}))):
        resp = post(server, route, body)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "logit_bias" and str(vocab_size) in error["message"], error
    assert post(server, "completions", completion(logit_bias={str(vocab_size - 1): 5})).status_code == 200


ACCEPTED = [
    # No-op fields with their no-op values, and the fields we implement that a client may send.
    ("user", {"user": "user-1234"}),
    ("metadata", {"metadata": {"run": "nightly"}}),
    ("store false", {"store": False}),
    ("service tier auto", {"service_tier": "auto"}),
    ("service tier default", {"service_tier": "default"}),
    ("text modality", {"modalities": ["text"]}),
    ("prompt cache key", {"prompt_cache_key": "conversation-7"}),
    ("safety identifier", {"safety_identifier": "hash-of-user"}),
    ("unsupported fields sent as null", {"functions": None, "audio": None, "reasoning_effort": None}),
    ("text response_format", {"response_format": {"type": "text"}}),
    ("xgrammar backend", {"guided_decoding_backend": "xgrammar"}),
    ("auto backend", {"guided_decoding_backend": "auto"}),
    ("router fields", {"return_token_ids": True, "priority": 0}),
    ("vLLM sampling extensions", {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 1,
                                  "ignore_eos": True, "stop_token_ids": [1], "include_stop_str_in_output": False,
                                  "skip_special_tokens": True, "spaces_between_special_tokens": True}),
]


@pytest.mark.parametrize("name, fields", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_no_op_and_implemented_fields_are_accepted(server, name, fields):
    for route, body in (("chat/completions", chat(**fields)), ("completions", completion(**fields))):
        resp = post(server, route, body)
        assert resp.status_code == 200, (route, resp.text)
        assert resp.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_an_assistant_message_sent_back_with_its_null_fields_is_accepted(server):
    """The openai SDK re-sends a parsed assistant message with refusal/audio/function_call as null."""
    client = openai.OpenAI(base_url=server.base_url, api_key="sekret", max_retries=0)
    first = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, temperature=0)
    history = [*MESSAGES, {"role": "assistant", "content": first.choices[0].message.content or "x", "refusal": None,
                           "audio": None, "function_call": None, "annotations": None},
               {"role": "user", "content": [{"type": "text", "text": "and again"}]}]
    again = client.chat.completions.create(model="tiny", messages=history, max_tokens=2, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length")


def test_the_openai_sdk_sees_a_bad_request_naming_the_field(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="sekret", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, reasoning_effort="low")
    assert caught.value.param == "reasoning_effort"
