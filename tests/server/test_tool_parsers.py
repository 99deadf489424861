"""Tool-call parsers on hand-written model outputs: one-shot and streamed (cut anywhere) agree,
malformed calls come back as content, and the grammars that force calls accept exactly the
parser's format (checked with xgrammar itself)."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from pdserve.engine.server.tool_parsers import FunctionSpec, get_parser, parser_names
from pdserve.engine.server.tool_parsers.base import ToolParser

WEATHER = FunctionSpec("get_weather", "Current weather of a city", {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]})
TIME = FunctionSpec("get_time", None, {"type": "object", "properties": {}})
NAMES = ["get_weather", "get_time"]


def shape(content, calls):
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def one_shot(parser: str, text: str, **kw):
    result = get_parser(parser).parse(text, NAMES, **kw)
    return shape(result.content, result.calls)


def streamed(parser: str, pieces: list[str], **kw) -> tuple[str | None, list]:
    p: ToolParser = get_parser(parser)(NAMES, **kw)
    content, calls = "", []
    for piece in pieces:
        d = p.feed(piece)
        content += d.content
        calls += d.calls
    d = p.finish()
    content += d.content
    calls += d.calls
    return shape(content if content or not calls else None, calls)


def assert_streams_like_one_shot(parser: str, text: str, **kw):
    """Cut at every position (two pieces), and one character at a time: always the one-shot answer."""
    expected = one_shot(parser, text, **kw)
    for i in range(len(text) + 1):
        assert streamed(parser, [text[:i], text[i:]], **kw) == expected, (parser, text[:i], text[i:])
    assert streamed(parser, list(text), **kw) == expected
    return expected


CASES = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
         (None, [("get_weather", {"city": "Paris"})])),
        ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
         '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n',
         ("Let me check.", [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})])),
        # arguments given as a JSON string, and no "arguments" at all
        ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
         '<tool_call>{"name": "get_time"}</tool_call>',
         (None, [("get_weather", {"city": "Rome"}), ("get_time", {})])),
        # the closing tag never came, but the call is whole
        ('<tool_call>\n{"name": "get_time", "arguments": {}}\n', (None, [("get_time", {})])),
        ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_ca', (None, [("get_time", {})])),
        # malformed JSON, an unknown function, a truncated call: all content, verbatim
        ('Hi <tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call> bye',
         ('Hi <tool_call>{"name": "get_weather", "arguments": {"city": }}</tool_call> bye', [])),
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
         ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', [])),
        ('ok <tool_call>{"name": "get_weather", "argu', ('ok <tool_call>{"name": "get_weather", "argu', [])),
        # a malformed call between good ones, and text after a call
        ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call> <tool_call>[1]</tool_call> done ',
         ('<tool_call>[1]</tool_call> done', [("get_time", {})])),
        # plain text, whitespace and all, is untouched (including things that look like a marker's start)
        ("a < b and <tool but not a call\n\n", ("a < b and <tool but not a call\n\n", [])),
        ("", ("", [])),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', (None, [("get_weather", {"city": "Paris"})])),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", '
         '"parameters": {}}', (None, [("get_weather", {"city": "Oslo"}), ("get_time", {})])),
        ('  {"name": "get_time", "arguments": {}} and then text', ("and then text", [("get_time", {})])),
        # JSON that is not a call, a broken object, a call in the middle of prose: content
        ('{"city": "Paris"}', ('{"city": "Paris"}', [])),
        ('{"name": "get_time", "parameters": {', ('{"name": "get_time", "parameters": {', [])),
        ('Sure: {"name": "get_time", "parameters": {}}', ('Sure: {"name": "get_time", "parameters": {}}', [])),
        ('{"name": "get_time", "parameters": {}}; {"name": ', ('; {"name":', [("get_time", {})])),
        ("The answer is 4.", ("The answer is 4.", [])),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
         '"arguments": {}}]', (None, [("get_weather", {"city": "Paris"}), ("get_time", {})])),
        ('Checking.[TOOL_CALLS] [{"name": "get_time", "arguments": {}}]', ("Checking.", [("get_time", {})])),
        ('[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "nope", "arguments": {}}]',
         ('[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "nope", "arguments": {}}]', [])),
        ('[TOOL_CALLS][{"name": "get_time", "arguments": {]', ('[TOOL_CALLS][{"name": "get_time", "arguments": {]', [])),
        ("[TOOL_CALL] is not the marker", ("[TOOL_CALL] is not the marker", [])),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", unit="celsius"), get_time()]',
         (None, [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {})])),
        # a "]" inside a string, nested values, JSON literals, negative numbers
        ("<|python_start|>[get_weather(city='Pa]ris', extra={'a': [1, -2.5, True, null]})]<|python_end|>",
         (None, [("get_weather", {"city": "Pa]ris", "extra": {"a": [1, -2.5, True, None]}})])),
        ("[get_time()] That is all.", ("That is all.", [("get_time", {})])),
        # never evaluated: anything but literals is not a call
        ("[get_weather(city=__import__('os').getcwd())]", ("[get_weather(city=__import__('os').getcwd())]", [])),
        ('[get_weather("Paris")]', ('[get_weather("Paris")]', [])),
        ("[1] is a citation", ("[1] is a citation", [])),
        ("[get_time(", ("[get_time(", [])),
        ("No calls here.", ("No calls here.", [])),
    ],
}


@pytest.mark.parametrize("parser,text,expected",
                         [(p, t, e) for p, cases in CASES.items() for t, e in cases],
                         ids=[f"{p}-{i}" for p, cases in CASES.items() for i in range(len(cases))])
def test_streamed_cut_anywhere_equals_one_shot_and_the_expected_split(parser, text, expected):
    assert assert_streams_like_one_shot(parser, text) == expected


def test_every_parser_is_registered():
    assert {"hermes", "llama3_json", "mistral", "pythonic"} <= set(parser_names())
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_parser("nope")


def test_content_is_released_as_soon_as_it_cannot_start_a_call():
    p = get_parser("hermes")(NAMES)
    assert p.feed("Hello").content == "Hello"
    assert p.feed(" wor").content == " wor"
    assert p.feed("ld <tool").content == "ld"  # " <tool" may open a call: held back
    assert p.feed("box>").content == " <toolbox>"  # it did not
    d = p.feed('<tool_call>{"name": "get_time", "arguments": {}}')
    assert d.content == "" and d.calls == []  # the call is not closed yet
    d = p.feed("</tool_call>")
    assert [c.name for c in d.calls] == ["get_time"]


def test_call_ids_are_unique_and_in_each_parsers_style():
    hermes = get_parser("hermes").parse('<tool_call>{"name": "get_time"}</tool_call>' * 3, NAMES).calls
    assert len({c.id for c in hermes}) == 3
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in hermes)
    mistral = get_parser("mistral").parse('[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', NAMES).calls
    assert len(mistral[0].id) == 9 and mistral[0].id.isalnum()


def test_max_calls_keeps_only_the_first_call():
    text = '<tool_call>{"name": "get_time"}</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "x"}}</tool_call>'
    assert assert_streams_like_one_shot("hermes", text, max_calls=1) == (None, [("get_time", {})])


def test_any_tool_name_is_accepted_when_no_names_are_given():
    result = get_parser("hermes").parse('<tool_call>{"name": "other", "arguments": {"x": 1}}</tool_call>')
    assert [(c.name, c.arguments) for c in result.calls] == [("other", '{"x": 1}')]


# -- the grammars that force a call -----------------------------------------------------------------


def grammar_accepts(structural_tag: dict, text: str) -> bool:
    grammar = xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": structural_tag}))
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False).compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


GOOD_CALL = ("get_weather", {"city": "Paris", "unit": "celsius"})
SECOND_CALL = ("get_time", {})
BAD_ARGS = [("get_weather", {"unit": "celsius"}),  # city is required
            ("get_weather", {"city": "Paris", "unit": "kelvin"}),  # not in the enum
            ("get_weather", {"city": 3})]


def written(parser: str, calls) -> str:
    """Calls as the model writes them; pythonic argument values as JSON (what its grammar emits)."""
    if parser == "pythonic":
        return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in a.items()) + ")"
                               for n, a in calls) + "]"
    return get_parser(parser).render_calls(calls)


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_required_grammar_produces_only_valid_calls_in_the_parsers_format(parser):
    cls = get_parser(parser)
    one = cls.call_format([WEATHER, TIME], multiple=False)
    many = cls.call_format([WEATHER, TIME], multiple=True)
    named = cls.call_format([WEATHER], multiple=False)
    for fmt in (one, many, named):
        text = written(parser, [GOOD_CALL])
        assert grammar_accepts(fmt, text), text
        assert one_shot(parser, text) == (None, [GOOD_CALL])  # and the parser reads back what it allows
        for bad in BAD_ARGS:
            assert not grammar_accepts(fmt, written(parser, [bad])), bad
        assert not grammar_accepts(fmt, "Sure! " + text)  # no free text
        assert not grammar_accepts(fmt, "")  # at least one call
    two = written(parser, [GOOD_CALL, SECOND_CALL])
    assert grammar_accepts(many, two) and not grammar_accepts(one, two)
    assert one_shot(parser, two) == (None, [GOOD_CALL, SECOND_CALL])
    assert not grammar_accepts(named, written(parser, [SECOND_CALL]))  # only the named function


def test_pythonic_grammar_allows_leaving_out_optional_arguments_only():
    fmt = get_parser("pythonic").call_format([WEATHER], multiple=False)
    assert grammar_accepts(fmt, '[get_weather(city="Paris")]')
    assert not grammar_accepts(fmt, '[get_weather(unit="celsius")]')
    assert not grammar_accepts(fmt, '[get_weather(city="Paris", city="Rome")]')


@pytest.mark.parametrize("parser", ["hermes", "mistral"])
def test_auto_grammar_leaves_text_free_and_constrains_an_opened_call(parser):
    cls = get_parser(parser)
    fmt = cls.auto_format([WEATHER, TIME], multiple=True)
    assert grammar_accepts(fmt, "Just an answer, no call.")
    good = "Let me look. " + written(parser, [GOOD_CALL])
    assert grammar_accepts(fmt, good)
    assert one_shot(parser, good) == ("Let me look.", [GOOD_CALL])
    for bad in BAD_ARGS:
        assert not grammar_accepts(fmt, "Let me look. " + written(parser, [bad]))


@pytest.mark.parametrize("parser", ["llama3_json", "pythonic"])
def test_formats_without_an_opening_marker_leave_auto_unconstrained(parser):
    assert get_parser(parser).auto_format([WEATHER], multiple=True) is None


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_history_calls_written_by_render_calls_parse_back(parser):
    calls = [GOOD_CALL, SECOND_CALL]
    text = get_parser(parser).render_calls(calls)
    assert one_shot(parser, text) == (None, calls)
    assert "get_weather" in get_parser(parser).describe_tools([WEATHER, TIME])
