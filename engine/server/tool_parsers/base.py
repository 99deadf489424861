"""What every tool-call parser shares: the call and delta types, and the incremental scanner.

A parser splits a model's text into plain content and function calls. It is fed the text as the
model produces it and hands back, each time, the content that is now certain to be content and the
calls that are now complete. `parse` is the same machine fed the whole text at once, so a streamed
answer always adds up to the one-shot answer, however the text was cut.

A call is handed out only once it is complete and valid (its JSON parses, its name is a declared
tool): a client never receives a call it has to take back, nor arguments that do not parse. A
malformed or truncated call is given back verbatim as content. The cost: a call's arguments come
in one piece once the call is closed, not token by token.

Whitespace next to calls is not content: the text "<tool_call>..</tool_call>\n" has content None,
not "\n". Text without any call comes back exactly as the model wrote it.

Each parser also knows its own call format on the way in: how to describe the tools to a model whose
chat template ignores them, how to write earlier calls and results into such a prompt, and the
xgrammar structural tag that makes the model write a valid call.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, ClassVar, Collection, Literal

_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class FunctionSpec:
    """One declared tool (OpenAI `tools[i].function`)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParserDelta:
    """What one feed settled: content text to send, and calls that are now complete."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


@dataclass
class ParseResult:
    content: str | None  # None when the model only made calls
    calls: list[ToolCall]


# A step of a scanner: the first `length` characters of the pending text are content, or a
# region of calls (possibly none: a separator), or a region that failed to parse (content).
@dataclass(frozen=True)
class Step:
    kind: Literal["content", "calls", "raw"]
    length: int
    calls: tuple[tuple[str, dict[str, Any]], ...] = ()


class ToolParser:
    """Subclasses set `name` and implement `_step`; the format hooks below have defaults."""

    name: ClassVar[str]
    # The marker of a call is a special token that the detokenizer drops unless told otherwise.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tool_names: Collection[str] | None = None, max_calls: int | None = None) -> None:
        self.tool_names = frozenset(tool_names) if tool_names is not None else None
        self.max_calls = max_calls
        self._pending = ""
        self._held_ws = ""  # trailing whitespace of content: dropped if a call follows
        self._after_call = False  # drop the whitespace that opens the content after a call
        self._num_calls = 0
        self._finished = False

    # -- the machine -----------------------------------------------------------------------------

    def feed(self, text: str) -> ParserDelta:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._pending += text
        return self._run(final=False)

    def finish(self) -> ParserDelta:
        if self._finished:
            return ParserDelta()
        out = self._run(final=True)
        if self._held_ws and not self._num_calls:
            out.content += self._held_ws
        self._held_ws = ""
        self._finished = True
        return out

    @classmethod
    def parse(cls, text: str, tool_names: Collection[str] | None = None, max_calls: int | None = None) -> ParseResult:
        parser = cls(tool_names, max_calls)
        a, b = parser.feed(text), parser.finish()
        content = a.content + b.content
        calls = a.calls + b.calls
        return ParseResult(content if content or not calls else None, calls)

    @property
    def made_calls(self) -> bool:
        return self._num_calls > 0

    def _run(self, final: bool) -> ParserDelta:
        out = ParserDelta()
        while self._pending:
            step = self._step(self._pending, final)
            if step is None:
                break
            if step.length <= 0 and step.kind != "calls":
                raise AssertionError(f"{type(self).__name__} made no progress")
            piece, self._pending = self._pending[:step.length], self._pending[step.length:]
            if step.kind == "calls":
                self._held_ws = ""
                self._after_call = True
                for name, args in step.calls:
                    if self.max_calls is not None and self._num_calls >= self.max_calls:
                        break  # parallel_tool_calls=false: later calls are dropped, never run
                    self._num_calls += 1
                    out.calls.append(ToolCall(self.new_call_id(), name,
                                              json.dumps(args, ensure_ascii=False)))
            else:
                out.content += self._content(piece)
        return out

    def _content(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return ""
            self._after_call = False
        text = self._held_ws + text
        kept = text.rstrip()
        self._held_ws = text[len(kept):]
        return kept

    def _step(self, text: str, final: bool) -> Step | None:
        """Settle a prefix of `text`, or None to wait for more (never None when `final`)."""
        raise NotImplementedError

    # -- helpers for scanners --------------------------------------------------------------------

    def call_from(self, obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")
                  ) -> tuple[str, dict[str, Any]] | None:
        """(name, arguments) of a decoded {"name": ..., "arguments": {...}}, or None if it is not one."""
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        name = obj["name"]
        if self.tool_names is not None and name not in self.tool_names:
            return None
        present = [k for k in args_keys if k in obj]
        args = obj[present[0]] if present else {}
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return name, args

    def new_call_id(self) -> str:
        return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))

    # -- the call format on the way in (see tools.py) -------------------------------------------

    @classmethod
    def describe_tools(cls, functions: list[FunctionSpec]) -> str:
        """A system-prompt block teaching the tools and this call format to a model whose chat
        template does not take `tools`."""
        raise NotImplementedError

    @classmethod
    def render_calls(cls, calls: list[tuple[str, dict[str, Any]]]) -> str:
        """Earlier calls of an assistant turn, written as the model would have written them."""
        raise NotImplementedError

    @classmethod
    def render_results(cls, results: list[tuple[str | None, str]]) -> str:
        """Tool results ((name, content) in order) as the text of one user turn."""
        return "\n".join(f"<tool_response>\n{json.dumps({'name': n, 'content': c}, ensure_ascii=False) if n else c}\n"
                         "</tool_response>" for n, c in results)

    @classmethod
    def call_format(cls, functions: list[FunctionSpec], multiple: bool) -> dict[str, Any]:
        """An xgrammar structural-tag format that only produces calls of these functions, exactly
        in this parser's syntax: one call, or (multiple) one or more."""
        raise NotImplementedError

    @classmethod
    def auto_format(cls, functions: list[FunctionSpec], multiple: bool) -> dict[str, Any] | None:
        """For tool_choice auto: free text, but a call the model opens must be valid; None when
        the format has no unambiguous opening marker to trigger on."""
        return None


# -- shared pieces ---------------------------------------------------------------------------------


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (kept back: it may
    be the start of a marker whose rest has not arrived)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def json_value_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON object or array opening at text[start], by bracket matching
    outside strings; None if it has not closed yet. Does not check the JSON itself."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def skip_ws(text: str, i: int = 0) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def loads(text: str) -> Any:
    """json.loads, None where the text is not JSON (a malformed call becomes content, never an error)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def json_args_tag(begin: str, spec: FunctionSpec, end: str) -> dict[str, Any]:
    """A structural tag `begin <arguments as JSON matching the schema> end`."""
    return {"type": "tag", "begin": begin, "end": end, "content": json_schema_format(spec.parameters)}


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    # At most one whitespace character between JSON tokens: a small model under free whitespace
    # can write newlines until max_tokens.
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}


def one_or_more(tags: list[dict[str, Any]], multiple: bool, separator: str) -> dict[str, Any]:
    if multiple:
        return {"type": "tags_with_separator", "tags": tags, "separator": separator, "at_least_one": True}
    return tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
