"""Hermes / Qwen style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of
them, with free text around."""

from __future__ import annotations

import json
from typing import Any

from pdserve.engine.server.tool_parsers.base import (FunctionSpec, Step, ToolParser, held_prefix, json_args_tag,
                                                     loads, one_or_more)
from pdserve.engine.server.tool_parsers.registry import register

START, END = "<tool_call>", "</tool_call>"


@register
class HermesToolParser(ToolParser):
    name = "hermes"

    def _step(self, text: str, final: bool) -> Step | None:
        if not text.startswith(START):
            at = text.find(START)
            if at < 0:
                at = len(text) if final else len(text) - held_prefix(text, START)
            return Step("content", at) if at > 0 else None
        end = text.find(END, len(START))
        if end < 0:
            if not final:
                return None
            # The text ended inside a call: accept it only if it is whole but for (the rest of) the
            # closing tag, which max_tokens or a stop string may have cut.
            inner = text[len(START):]
            call = self.call_from(loads(inner[:len(inner) - held_prefix(inner, END)]))
            return Step("calls", len(text), (call,)) if call else Step("raw", len(text))
        call = self.call_from(loads(text[len(START):end]))
        length = end + len(END)
        return Step("calls", length, (call,)) if call else Step("raw", length)

    @classmethod
    def describe_tools(cls, functions: list[FunctionSpec]) -> str:
        listed = "\n".join(json.dumps(f.openai(), ensure_ascii=False) for f in functions)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{listed}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n"
                '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    @classmethod
    def render_calls(cls, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "\n".join(f"{START}\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n{END}"
                         for n, a in calls)

    @classmethod
    def _tags(cls, functions: list[FunctionSpec]) -> list[dict[str, Any]]:
        return [json_args_tag(f'{START}\n{{"name": {json.dumps(f.name)}, "arguments": ', f, f"}}\n{END}")
                for f in functions]

    @classmethod
    def call_format(cls, functions: list[FunctionSpec], multiple: bool) -> dict[str, Any]:
        return one_or_more(cls._tags(functions), multiple, "\n")

    @classmethod
    def auto_format(cls, functions: list[FunctionSpec], multiple: bool) -> dict[str, Any] | None:
        return {"type": "triggered_tags", "triggers": [START], "tags": cls._tags(functions),
                "stop_after_first": not multiple}
