"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after optional free text.
Mistral's templates need tool-call ids of exactly 9 letters and digits."""

from __future__ import annotations

import json
import secrets
import string
from typing import Any

from pdserve.engine.server.tool_parsers.base import (FunctionSpec, Step, ToolParser, held_prefix, json_args_tag,
                                                     json_value_end, loads, one_or_more, skip_ws)
from pdserve.engine.server.tool_parsers.registry import register

MARKER = "[TOOL_CALLS]"
_ALNUM = string.ascii_letters + string.digits


@register
class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True  # [TOOL_CALLS] is a special token in Mistral's tokenizers

    def _step(self, text: str, final: bool) -> Step | None:
        if not text.startswith(MARKER):
            at = text.find(MARKER)
            if at < 0:
                at = len(text) if final else len(text) - held_prefix(text, MARKER)
            return Step("content", at) if at > 0 else None
        i = skip_ws(text, len(MARKER))
        if i == len(text):
            return Step("raw", len(text)) if final else None
        if text[i] not in "[{":
            return Step("raw", i)  # a marker without calls is kept as text
        end = json_value_end(text, i)
        if end is None:
            return Step("raw", len(text)) if final else None
        decoded = loads(text[i:end])
        items = decoded if isinstance(decoded, list) else [decoded]
        calls = [self.call_from(item) for item in items]
        if not items or any(c is None for c in calls):
            return Step("raw", end)
        return Step("calls", end, tuple(calls))  # type: ignore[arg-type]

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))

    @classmethod
    def describe_tools(cls, functions: list[FunctionSpec]) -> str:
        listed = json.dumps([f.openai() for f in functions], ensure_ascii=False)
        return (f"[AVAILABLE_TOOLS]{listed}[/AVAILABLE_TOOLS]\n"
                f'To call functions, answer with {MARKER} followed by a JSON list of calls: '
                f'{MARKER}[{{"name": <function-name>, "arguments": <args-json-object>}}, ...]')

    @classmethod
    def render_calls(cls, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return MARKER + json.dumps([{"name": n, "arguments": a} for n, a in calls], ensure_ascii=False)

    @classmethod
    def render_results(cls, results: list[tuple[str | None, str]]) -> str:
        return "\n".join(f"[TOOL_RESULTS]{json.dumps({'content': c}, ensure_ascii=False)}[/TOOL_RESULTS]"
                         for _, c in results)

    @classmethod
    def _calls(cls, functions: list[FunctionSpec], multiple: bool) -> dict[str, Any]:
        tags = [json_args_tag(f'{{"name": {json.dumps(f.name)}, "arguments": ', f, "}") for f in functions]
        return one_or_more(tags, multiple, ", ")

    @classmethod
    def call_format(cls, functions: list[FunctionSpec], multiple: bool) -> dict[str, Any]:
        return {"type": "tag", "begin": MARKER + "[", "content": cls._calls(functions, multiple), "end": "]"}

    @classmethod
    def auto_format(cls, functions: list[FunctionSpec], multiple: bool) -> dict[str, Any] | None:
        return {"type": "triggered_tags", "triggers": [MARKER], "tags": [cls.call_format(functions, multiple)],
                "stop_after_first": True}
