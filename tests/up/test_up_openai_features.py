"""Structured outputs, tool calling and prompt logprobs through `pdserve up` (issue 19), with the
real built-in smollm2 and the official openai SDK.

One stack, started once: 1 prefill + 1 decode engine, every prompt disaggregated, float32. Each
test reads the router's decision counters and the prefill engine's finished requests before and
after, so it shows where its requests really ran: constrained and tool requests through both
engines (the prefill engine computes the prompt, the decode engine constrains from the first
token), prompt logprobs on one engine.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from pdserve import up
from pdserve.engine.demo import resolve_model

from support.up_stack import UpProcess

MODEL = "smollm2"
PARSER = "hermes"

SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age"],
               "properties": {"name": {"type": "string", "enum": ["Ada", "Alan", "Grace"]},
                              "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    "colour": {"type": "object", "additionalProperties": False, "required": ["colour", "bright"],
               "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                              "bright": {"type": "boolean"}}},
    "primes": {"type": "object", "additionalProperties": False, "required": ["primes"],
               "properties": {"primes": {"type": "array", "minItems": 1, "maxItems": 3,
                                         "items": {"type": "integer", "minimum": 0, "maximum": 100}}}},
    "capital": {"type": "object", "additionalProperties": False, "required": ["capital", "population_millions"],
                "properties": {
                    "capital": {"type": "object", "additionalProperties": False, "required": ["city", "country"],
                                "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Berlin"]},
                                               "country": {"type": "string", "enum": ["France", "Italy", "Germany"]}}},
                    "population_millions": {"type": "integer", "minimum": 0, "maximum": 99}}},
    "steps": {"type": "object", "additionalProperties": False, "required": ["steps"],
              "properties": {"steps": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
                  "type": "object", "additionalProperties": False, "required": ["n", "done"],
                  "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}, "done": {"type": "boolean"}}}}}},
}
QUESTIONS = {"person": "Describe a famous computer scientist.", "colour": "What colour is the sky?",
             "primes": "List a few prime numbers.", "capital": "What is the capital of France?",
             "steps": "Plan two steps to make tea."}
# Four ways of asking for each schema: 20 requests, as the issue asks of the P/D path too.
ASKED_AS = ("{}", "Answer in JSON. {}", "{} Be brief.", "Please reply with the requested record. {}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


# --- without starting anything -------------------------------------------------------------------------

def plan_for(*argv: str) -> up.Plan:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return up.build_plan(parser.parse_args(list(argv)), up.ModelSource("/models/m", "/models/m", "/models/m"))


@pytest.mark.parametrize("argv, expected", [(("--tool-call-parser", "pythonic"), "pythonic"), ((), None)])
def test_plan_passes_the_tool_call_parser_to_every_engine_and_the_router(argv, expected):
    from pdserve.engine.server import cli as serve_cli
    from pdserve.router import cli as router_cli

    serve_parser, router_parser = argparse.ArgumentParser(), argparse.ArgumentParser()
    serve_cli.add_arguments(serve_parser)
    router_cli.add_arguments(router_parser)
    default = serve_parser.parse_args(["--model", "m"]).tool_call_parser
    plan = plan_for("--prefill", "1", "--decode", "2", *argv)
    engines = [c for c in plan.components if c.name.startswith(("prefill-", "decode-"))]
    assert len(engines) == 3
    # What each process makes of its command line: the flag given, or the engine's own default
    # (the router's is the same: it renders chat prompts with tools as the engines do).
    for engine in engines:
        assert serve_parser.parse_args(list(engine.argv[1:])).tool_call_parser == (expected or default)
    assert ("--tool-call-parser" in engines[0].argv) == (expected is not None)
    router = next(c for c in plan.components if c.name == "router")
    assert router_parser.parse_args(list(router.argv[1:])).tool_call_parser == (expected or default)


@pytest.mark.parametrize("argv, expected", [(("--enforce-eager",), True), ((), False)])
def test_plan_passes_enforce_eager_to_every_engine(argv, expected):
    from pdserve.engine.server import cli as serve_cli

    serve_parser = argparse.ArgumentParser()
    serve_cli.add_arguments(serve_parser)
    plan = plan_for("--prefill", "1", "--decode", "2", *argv)
    engines = [c for c in plan.components if c.name.startswith(("prefill-", "decode-"))]
    assert len(engines) == 3
    for engine in engines:
        assert serve_parser.parse_args(list(engine.argv[1:])).enforce_eager is expected


# --- the stack ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    resolve_model(MODEL)  # converted once here, not inside the engines' start-up wait
    # 512 MiB of KV per engine (~11k smollm2 tokens) holds the 20 batched chats many times over; the
    # 4 GiB default cost each engine ~9 s of start-up (more on a loaded machine) just to allocate.
    proc = UpProcess(["--model", MODEL, "--prefill", "1", "--decode", "1", "--pd-min-prompt-tokens", "0",
                      "--dtype", "float32", "--tool-call-parser", PARSER, "--kv-cache-memory-bytes", str(512 << 20)],
                     tmp_path_factory.mktemp("up") / "run")
    try:
        proc.endpoint = proc.wait_for(r"pdserve is up at (http://\S+)/v1", timeout=400).group(1)
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.endpoint}/v1", api_key="none", max_retries=0, timeout=300)


def metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            series, value = line.rsplit(" ", 1)
            if all(f'{k}="{v}"' in series for k, v in labels.items()):
                total += float(value)
    return total


class Where:
    """Where requests ran, counted from here on: the router's P/D decisions and the prefill engine's
    finished requests (each prefill leg is one)."""

    def __init__(self, stack: UpProcess) -> None:
        self.router = stack.endpoint
        self.prefill = stack.health_url("prefill-0").removesuffix("/health")
        self.start = self.counts()

    def counts(self) -> dict[str, float]:
        counts = {d: metric(self.router, "pdserve_router_pd_decisions_total", decision=d)
                  for d in ("disaggregated", "local_only", "local_prompt_logprobs", "prefill_failed")}
        counts["prefill_legs"] = metric(self.prefill, "vllm:request_success_total")
        return counts

    def since(self) -> dict[str, float]:
        now = self.counts()
        return {k: now[k] - self.start[k] for k in now if now[k] != self.start[k]}

    def expect(self, **expected: float) -> None:
        deadline = time.monotonic() + 30  # an engine counts a request just after its answer went out
        while self.since() != expected and time.monotonic() < deadline:
            time.sleep(0.2)
        assert self.since() == expected


# --- structured outputs -------------------------------------------------------------------------------

def test_json_schema_chats_parse_and_validate_and_are_disaggregated(stack, client):
    where = Where(stack)

    asks = [(name, form.format(QUESTIONS[name])) for name in SCHEMAS for form in ASKED_AS]

    def ask(name_question: tuple[str, str]) -> Any:
        name, question = name_question
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=120, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name],
                                                                    "strict": True}})

    with ThreadPoolExecutor(len(asks)) as pool:  # together: the decode engine batches them
        answers = list(pool.map(ask, asks))
    for (name, question), answer in zip(asks, answers):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (name, question, choice)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
    where.expect(disaggregated=len(asks), prefill_legs=len(asks))


def test_guided_choice_only_returns_one_of_the_choices(stack, client):
    choices = ["Paris", "London", "Berlin"]
    where = Where(stack)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Capital of France?"}],
                                          max_tokens=10, temperature=0, extra_body={"guided_choice": choices})
    assert chat.choices[0].message.content in choices and chat.choices[0].finish_reason == "stop"
    for seed in (1, 2):  # sampled too: whatever is drawn stays within the choices
        text = client.completions.create(model=MODEL, prompt="The largest city in Europe is", max_tokens=10,
                                         temperature=1.0, seed=seed, extra_body={"guided_choice": choices})
        assert text.choices[0].text in choices
    where.expect(disaggregated=3, prefill_legs=3)


class City(BaseModel):
    city: Literal["Paris", "Rome", "Madrid"]
    country: Literal["France", "Italy", "Spain"]
    is_capital: bool


def test_beta_parse_with_a_pydantic_model(stack, client):
    where = Where(stack)
    completion = client.beta.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Tell me about the capital of Italy."}],
        response_format=City, max_tokens=80, temperature=0)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, City) and completion.choices[0].finish_reason == "stop"
    where.expect(disaggregated=1, prefill_legs=1)


# --- tools -----------------------------------------------------------------------------------------------

def check_call(name: str, arguments: str) -> dict[str, Any]:
    assert name == "get_weather"
    args = json.loads(arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    return args


def final_answer(client: openai.OpenAI, call_id: str, name: str, arguments: str) -> str:
    """The round trip's second half: the call and its result in the history, then the answer."""
    messages = WEATHER_QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"sky": "sunny", "temperature": 21})}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                            max_tokens=24, temperature=0)
    choice = answer.choices[0]
    assert choice.message.tool_calls in (None, []) and choice.finish_reason in ("stop", "length")
    assert choice.message.content and choice.message.content.strip()
    return choice.message.content


def test_a_required_tool_call_round_trip(stack, client):
    where = Where(stack)
    # One call: allowed several, the 135M model writes call after call until max_tokens, and the
    # call cut off there comes back as text (tests/server/test_tool_calling.py does the same).
    answer = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER],
                                            tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                            temperature=0)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    assert not (choice.message.content or "").strip()  # the call is not also shown as text
    call = choice.message.tool_calls[0]
    check_call(call.function.name, call.function.arguments)
    assert call.id and call.type == "function"
    final_answer(client, call.id, call.function.name, call.function.arguments)
    where.expect(disaggregated=2, prefill_legs=2)


def test_a_required_tool_call_round_trip_streamed(stack, client):
    where = Where(stack)
    calls: dict[int, dict[str, str]] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=[WEATHER],
                                                tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                                temperature=0, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            call = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
            call["id"] = part.id or call["id"]
            if part.function is not None:
                call["name"] = part.function.name or call["name"]
                call["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls, calls
    assert not content.strip()
    first = calls[min(calls)]
    check_call(first["name"], first["arguments"])
    assert first["id"]
    final_answer(client, first["id"], first["name"], first["arguments"])
    where.expect(disaggregated=2, prefill_legs=2)


# --- prompt logprobs ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference():
    """SmolLM2 in transformers, float32, on the same converted weights the engines load."""
    from transformers import AutoTokenizer

    from support.hf_reference import load_hf_model

    path = resolve_model(MODEL)
    return AutoTokenizer.from_pretrained(path), load_hf_model(path)


def test_echo_logprobs_equal_transformers_and_run_on_one_engine(stack, client, reference):
    import torch

    tokenizer, model = reference
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog because it")
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]
    where = Where(stack)
    answer = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
    got = answer.choices[0].logprobs.token_logprobs
    assert len(got) == len(ids) + 1 and got[0] is None  # the prompt's tokens, then the generated one
    assert max(abs(a - b) for a, b in zip(got[1:len(ids)], expected)) < 1e-3
    where.expect(local_prompt_logprobs=1)  # the prefill engine never saw it
