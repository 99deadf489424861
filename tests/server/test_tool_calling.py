"""Tool calling on /v1/chat/completions with the real smollm2 (greedy, float32) and the openai SDK:
a round trip (request with tools -> tool_calls -> tool result -> plain answer) for tool_choice
required and a named function, streaming and not; auto; requests the server must refuse.

tool_choice "auto": asked cold, SmolLM2-135M never chooses to call a tool greedily (tried: no system
prompt, "Always call a function", "Answer only with a tool call", and more): it answers in prose,
which must come back as content, untouched. Shown one earlier call in the history (a one-shot
example, as agent frameworks replay past turns), it calls the tool for the next question by itself:
the auto round trip starts from that history, and so also checks that history calls render."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest


WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "description": "Get the current time in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
]
QUESTION = [{"role": "system", "content": "You are a weather assistant. Use the tools to answer."},
            {"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def server(smollm2_f32_server):
    return smollm2_f32_server  # shared with the other float32 smollm2 modules (tests/server/conftest.py)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)


def ask(client, messages, stream: bool, max_tokens: int = MAX_TOKENS, **kw):
    """(content, [(id, name, arguments text)], finish_reason) of one greedy answer, streamed or not;
    streamed, also checks the chunks are shaped as OpenAI sends them."""
    kw = dict(model="smollm2", messages=messages, temperature=0, max_tokens=max_tokens, **kw)
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            assert finish is None, "a chunk after the finish reason"
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.index not in calls:  # a call opens with its id, type, name and empty arguments
                    assert tc.id and tc.type == "function" and tc.function.name
                    assert tc.function.arguments == ""
                    assert tc.index == len(calls)
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                else:
                    assert tc.id is None and tc.function.name is None
                    calls[tc.index][2] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert "<tool_call" not in content
    return content or None, [tuple(c) for c in calls.values()], finish


# An earlier turn in which the assistant called get_weather: the model's one example for "auto".
ONE_SHOT = [{"role": "user", "content": "What is the weather in London?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_0", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": "London"})}}]},
            {"role": "user", "content": "What is the weather in Paris?"}]


def round_trip(client, tool_choice, stream: bool, question=QUESTION):
    # One call: with parallel calls allowed the 135M model writes call after call until max_tokens.
    # Room for the whole call: the grammar ends with it, so the model stops right after.
    content, calls, finish = ask(client, question, stream, max_tokens=96, tools=TOOLS, tool_choice=tool_choice,
                                 parallel_tool_calls=False)
    assert calls, f"no tool call; the model answered {content!r}"
    assert finish == "tool_calls"
    assert content is None  # the answer is only the call
    for _, name, arguments in calls:
        assert name in ("get_weather", "get_time")
        args = json.loads(arguments)
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
        jsonschema.validate(args, schema)  # constrained: the arguments always match the schema
    if tool_choice == NAMED:
        assert [name for _, name, _ in calls] == ["get_weather"]
    assert "Paris" in calls[0][2]
    history = question + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}
                        for cid, name, arguments in calls]},
        *[{"role": "tool", "tool_call_id": cid, "content": "22 degrees celsius and sunny"} for cid, _, _ in calls],
    ]
    answer, more_calls, finish = ask(client, history, stream, tools=TOOLS, tool_choice="auto")
    assert more_calls == [] and finish in ("stop", "length")
    # Plain content. (What it says is the 135M model's business: it tends to repeat the tool result.)
    assert isinstance(answer, str) and answer
    return calls, answer


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_round_trip_streamed_and_not_agree(client, tool_choice):
    calls, answer = round_trip(client, tool_choice, stream=False)
    streamed_calls, streamed_answer = round_trip(client, tool_choice, stream=True)
    # Greedy: the same calls and answer either way (only the random call ids differ).
    assert [c[1:] for c in streamed_calls] == [c[1:] for c in calls]
    assert streamed_answer == answer


def test_auto_round_trip_after_a_one_shot_history_streamed_and_not(client):
    calls, answer = round_trip(client, "auto", stream=False, question=ONE_SHOT)
    streamed_calls, streamed_answer = round_trip(client, "auto", stream=True, question=ONE_SHOT)
    assert [c[1:] for c in streamed_calls] == [c[1:] for c in calls]
    assert streamed_answer == answer


def test_auto_prose_answer_comes_back_as_content_streamed_and_not(client):
    content, calls, finish = ask(client, QUESTION, stream=False, tools=TOOLS)
    assert calls == [] and finish in ("stop", "length")
    assert content and "Paris" in content
    assert ask(client, QUESTION, stream=True, tools=TOOLS) == (content, [], finish)


def test_without_tools_the_answer_is_plain_text(client):
    content, calls, finish = ask(client, QUESTION, stream=False, tools=TOOLS, tool_choice="none")
    assert calls == [] and finish in ("stop", "length") and content


@pytest.mark.parametrize("body,param", [
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": QUESTION + [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]},
     "messages[2].tool_calls[0].function.arguments"),
    ({"messages": QUESTION + [{"role": "tool", "content": "22"}]}, "messages[2].tool_call_id"),
])
def test_bad_tool_requests_are_refused_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**{"model": "smollm2", "messages": QUESTION, "max_tokens": 4, **body})
    assert err.value.body["param"] == param, err.value.body
