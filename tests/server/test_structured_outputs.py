"""Structured outputs through the OpenAI API with the real smollm2: JSON schemas (response_format,
vLLM's structured_outputs and guided_json), JSON mode, choice, regex, grammar, the SDK's parse();
and a bad spec is a 400 naming its field before any engine work."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import openai
import pytest
from jsonschema import Draft202012Validator
from pydantic import BaseModel, Field

from pdserve.engine.server.structured_fields import unenforced_keyword


@pytest.fixture(scope="module")
def server(smollm2_f32_server):
    return smollm2_f32_server  # shared with the other float32 smollm2 modules (tests/server/conftest.py)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def obj(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties, "required": required if required is not None else list(properties),
            "additionalProperties": False}


NAME = {"type": "string", "minLength": 1, "maxLength": 24}
SHORT_LIST = {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}
AGE = {"type": "integer", "minimum": 0, "maximum": 120}

# (prompt, schema): nested objects, enums, arrays, required fields; every string and array bounded
# so that a finished object fits in max_tokens.
SCHEMAS = [
    ("Describe a person named Alice who is 30.", obj({"name": NAME, "age": AGE})),
    ("Give the capital of France.", obj({"country": NAME, "capital": NAME})),
    ("Rate the movie Up.", obj({"title": NAME, "stars": {"type": "integer", "enum": [1, 2, 3, 4, 5]}})),
    ("Is the sky blue?", obj({"answer": {"type": "string", "enum": ["yes", "no"]}, "confident": {"type": "boolean"}})),
    ("List three fruits.", obj({"fruits": SHORT_LIST})),
    ("Describe a cat.", obj({"animal": obj({"species": NAME, "legs": {"type": "integer", "minimum": 0,
                                                                         "maximum": 8}})})),
    ("Give a book and its author.", obj({"book": obj({"title": NAME, "author": obj({"first": NAME, "last": NAME})})})),
    ("Name a color and its hex code.", obj({"color": NAME, "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("What is 2 + 2?", obj({"question": NAME, "result": {"type": "number"}})),
    ("Describe the weather today.", obj({"condition": {"type": "string", "enum": ["sunny", "rainy", "cloudy"]},
                                         "celsius": {"type": "integer", "minimum": -40, "maximum": 50}})),
    ("Plan a short trip.", obj({"city": NAME, "days": {"type": "integer", "minimum": 1, "maximum": 9},
                               "sights": SHORT_LIST})),
    ("Give two points.", obj({"points": {"type": "array", "items": obj({"x": {"type": "integer", "minimum": -9,
                                                                              "maximum": 9},
                                                                        "y": {"type": "integer", "minimum": -9,
                                                                              "maximum": 9}}),
                                         "minItems": 2, "maxItems": 2}})),
    ("Describe a dog, optionally with a nickname.", obj({"breed": NAME, "nickname": NAME}, required=["breed"])),
    ("Is Python a snake or a language? Answer with a label.",
     obj({"label": {"type": "string", "enum": ["snake", "language", "both"]}})),
    ("Give a user record.", obj({"user": obj({"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                              "email": {"type": "string", "pattern": "^[a-z]{1,12}@example\\.com$"},
                                              "active": {"type": "boolean"}})})),
    ("Name a planet and whether it has rings.", obj({"planet": NAME, "rings": {"type": "boolean"}})),
    ("Give a recipe name and two ingredients.",
     obj({"recipe": NAME, "ingredients": {"type": "array", "items": obj({"item": NAME}), "minItems": 1,
                                          "maxItems": 2}})),
    ("Classify the sentence 'I love it' by sentiment.",
     obj({"sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
          "score": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("Give a date in ISO format.", obj({"date": {"type": "string", "format": "date"}})),
    ("Describe a company.", obj({"company": obj({"name": NAME, "employees": {"type": "integer", "minimum": 1,
                                                                            "maximum": 100000},
                                                 "tags": {"type": "array", "items": {"type": "string",
                                                                                    "enum": ["tech", "food", "retail"]},
                                                          "maxItems": 2}})})),
]
assert len(SCHEMAS) == 20

MAX_TOKENS = 200


def _request(client: openai.OpenAI, i: int) -> tuple[str, str | None]:
    """Three ways of asking for a schema, in turn: response_format, structured_outputs, completions' guided_json."""
    prompt, schema = SCHEMAS[i]
    if i % 3 == 0:
        resp = client.completions.create(model="smollm2", prompt=f"{prompt} Answer in JSON.\n", max_tokens=MAX_TOKENS,
                                         temperature=0, extra_body={"guided_json": schema})
        return resp.choices[0].text, resp.choices[0].finish_reason
    if i % 3 == 1:
        resp = client.chat.completions.create(model="smollm2", messages=ask(prompt), max_tokens=MAX_TOKENS,
                                              temperature=0, extra_body={"structured_outputs": {"json": schema}})
    else:
        resp = client.chat.completions.create(
            model="smollm2", messages=ask(prompt), max_tokens=MAX_TOKENS, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": f"answer{i}", "schema": schema,
                                                                    "strict": True}})
    return resp.choices[0].message.content, resp.choices[0].finish_reason


def test_twenty_json_schema_requests_all_parse_and_validate(client):
    with ThreadPoolExecutor(8) as pool:  # together, so that the engine batches them
        answers = list(pool.map(lambda i: _request(client, i), range(len(SCHEMAS))))
    for (prompt, schema), (text, finish) in zip(SCHEMAS, answers):
        assert finish == "stop", (prompt, text)
        Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER).validate(json.loads(text))


def test_a_truncated_json_output_is_reported_as_length(client):
    prompt, schema = SCHEMAS[10]
    resp = client.chat.completions.create(model="smollm2", messages=ask(prompt), max_tokens=5, temperature=0,
                                          response_format={"type": "json_schema",
                                                           "json_schema": {"name": "trip", "schema": schema}})
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5


def test_json_object_mode_gives_a_json_object(client):
    resp = client.chat.completions.create(model="smollm2", messages=ask("Give a JSON object with the keys city and country for Paris."), max_tokens=MAX_TOKENS,
                                          temperature=0, response_format={"type": "json_object"})
    assert resp.choices[0].finish_reason == "stop", resp.choices[0].message.content
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


CHOICES = ["red", "green", "blue"]


def test_guided_choice_only_ever_returns_one_of_the_choices(client):
    greedy = client.chat.completions.create(model="smollm2", messages=ask("Pick a color."), max_tokens=10,
                                            temperature=0, extra_body={"guided_choice": CHOICES})
    sampled = client.chat.completions.create(model="smollm2", messages=ask("Pick a color."), max_tokens=10,
                                             temperature=1.0, n=3, seed=7, extra_body={"guided_choice": CHOICES})
    completion = client.completions.create(model="smollm2", prompt="My favourite color is", max_tokens=10,
                                           temperature=1.0, n=3, extra_body={"guided_choice": CHOICES})
    texts = [c.message.content for c in greedy.choices + sampled.choices] + [c.text for c in completion.choices]
    assert len(texts) == 7
    assert all(t in CHOICES for t in texts), texts


def test_guided_regex_output_fullmatches(client):
    pattern = r"[0-9]{3}-[0-9]{4}"
    chat = client.chat.completions.create(model="smollm2", messages=ask("Give me a phone number."), max_tokens=20,
                                          temperature=0, extra_body={"guided_regex": pattern})
    completion = client.completions.create(model="smollm2", prompt="Phone:", max_tokens=20, temperature=0.8, n=2,
                                           extra_body={"structured_outputs": {"regex": pattern}})
    for text in [chat.choices[0].message.content] + [c.text for c in completion.choices]:
        assert re.fullmatch(pattern, text), text


def test_guided_grammar_output_matches(client):
    grammar = 'root ::= sign digit digit? " degrees"\nsign ::= "+" | "-"\ndigit ::= [0-9]'
    resp = client.chat.completions.create(model="smollm2", messages=ask("How warm is it outside?"), max_tokens=20,
                                          temperature=0, extra_body={"guided_grammar": grammar})
    assert re.fullmatch(r"[+-][0-9]{1,2} degrees", resp.choices[0].message.content), resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop"


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=50)
    kind: Literal["capital", "town"]


def test_sdk_parse_with_a_pydantic_model(client):
    resp = client.beta.chat.completions.parse(model="smollm2", messages=ask("Tell me about Paris."),
                                              max_tokens=MAX_TOKENS, temperature=0, response_format=City)
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(resp.choices[0].message.parsed, City)


def test_streamed_constrained_output_concatenates_to_valid_json(client):
    prompt, schema = SCHEMAS[6]
    stream = client.chat.completions.create(model="smollm2", messages=ask(prompt), max_tokens=MAX_TOKENS,
                                            temperature=0, stream=True,
                                            response_format={"type": "json_schema",
                                                             "json_schema": {"name": "book", "schema": schema}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    Draft202012Validator(schema).validate(json.loads(text))


def test_stop_strings_still_stop_a_constrained_output(client):
    prompt, schema = SCHEMAS[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}
    whole = client.chat.completions.create(model="smollm2", messages=ask(prompt), max_tokens=MAX_TOKENS,
                                           temperature=0, response_format=fmt).choices[0].message.content
    assert "," in whole
    cut = client.chat.completions.create(model="smollm2", messages=ask(prompt), max_tokens=MAX_TOKENS,
                                         temperature=0, response_format=fmt, stop=[","]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == whole.split(",")[0]


# -- bad specs are 400s naming the field -------------------------------------------------------------

BAD = [
    # (name, route, extra fields, param, message fragment)
    ("schema with a bad type", "chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "not a valid json schema"),
    ("schema that is not an object", "completions", {"guided_json": [1, 2]}, "guided_json", "valid"),
    ("schema text that is not JSON", "completions", {"guided_json": "{not json"}, "guided_json", "not valid json"),
    ("json_schema without a schema", "chat/completions",
     {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ("keyword xgrammar does not enforce", "chat/completions",
     {"structured_outputs": {"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}},
     "structured_outputs.json", "uniqueItems"),
    ("nested unenforced keyword", "completions",
     {"guided_json": {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}},
     "guided_json", "not at #/properties/n"),
    ("invalid regex", "completions", {"guided_regex": "(ab"}, "guided_regex", "cannot be compiled"),
    ("regex feature xgrammar lacks", "chat/completions", {"structured_outputs": {"regex": "(?<=a)b"}},
     "structured_outputs.regex", "lookbehind"),
    ("invalid grammar", "completions", {"guided_grammar": "root ::= ("}, "guided_grammar", "cannot be compiled"),
    ("empty choice", "completions", {"guided_choice": []}, "guided_choice", "non-empty"),
    ("two constraints", "chat/completions",
     {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "only one"),
    ("two kinds in structured_outputs", "completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs", "exactly one"),
    ("unknown response_format type", "completions", {"response_format": {"type": "yaml"}}, "response_format",
     "'yaml' is not supported"),
]


@pytest.mark.parametrize("name, route, fields, param, fragment", BAD, ids=[c[0] for c in BAD])
def test_a_bad_constraint_is_a_400_naming_its_field(server, name, route, fields, param, fragment):
    body = {"model": "smollm2", "max_tokens": 4, **fields}
    body.update({"messages": ask("hi")} if route.startswith("chat") else {"prompt": "hi"})
    resp = httpx.post(f"{server.base_url}/{route}", json=body, timeout=120)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param, error
    assert fragment.lower() in error["message"].lower(), error


# -- the refused keywords are the ones xgrammar does not enforce --------------------------------------

# (keyword, schema using it, an instance it allows, an instance only the keyword forbids)
UNENFORCED_CASES = [
    ("not", {"type": "integer", "not": {"const": 3}}, "4", "3"),
    ("if", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
            "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, '{"a": 1, "b": "x"}', '{"a": 1}'),
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}}, '{"a": 1, "b": 2}', '{"a": 1}'),
    ("dependentSchemas", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                          "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1, "b": 2}', '{"a": 1}'),
    ("contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[5]", "[1]"),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 2]", "[1, 1]"),
    ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 5}]}, "6", "2"),
    ("oneOf", {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]}, "20", "5"),
    ("format", {"type": "string", "format": "iri"}, '"x"', '"not an iri"'),
    ("maxLength", {"type": "string", "format": "email", "maxLength": 8}, '"a@b.com"', '"abcdef@b.com"'),
    ("minLength", {"type": "string", "pattern": "^a+$", "minLength": 3}, '"aaa"', '"a"'),
]


@pytest.mark.parametrize("keyword, schema, allowed, forbidden", UNENFORCED_CASES, ids=[c[0] for c in UNENFORCED_CASES])
def test_refused_keywords_are_those_xgrammar_lets_through(keyword, schema, allowed, forbidden):
    """If a new xgrammar enforces one of these, this fails: stop refusing it."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    assert validator.is_valid(json.loads(allowed))
    if keyword != "format":  # jsonschema checks "iri" only with an optional package
        assert not validator.is_valid(json.loads(forbidden))
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema))
    assert _is_grammar_accept_string(grammar, allowed)
    assert _is_grammar_accept_string(grammar, forbidden), f"xgrammar now enforces {keyword}"
    found = unenforced_keyword(schema)
    assert found is not None and found[0].startswith(keyword), found


def test_keywords_xgrammar_enforces_are_accepted():
    """The common keywords are enforced, so schemas using them are not refused."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    for schema, forbidden in [({"type": "integer", "multipleOf": 3}, "4"),
                              ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, "[1]"),
                              ({"type": "string", "pattern": "^a+$"}, '"b"'),
                              ({"type": "string", "format": "email"}, '"nope"'),
                              ({"type": "object", "minProperties": 1, "additionalProperties": {"type": "integer"}}, "{}"),
                              ({"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, '"s"'),
                              ({"type": "array", "items": {"type": "integer"}, "uniqueItems": False}, None)]:
        assert unenforced_keyword(schema) is None, schema
        if forbidden is not None:
            assert not _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema)), forbidden), schema
