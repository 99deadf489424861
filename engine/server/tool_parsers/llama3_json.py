"""Llama 3.x JSON tool calls: the answer *is* the calls, `{"name": ..., "parameters": {...}}`,
several separated by `;`, possibly after `<|python_tag|>`. Calls are only recognised at the start
of the answer: a JSON object in the middle of prose is prose."""

from __future__ import annotations

import json
from typing import Any

from pdserve.engine.server.tool_parsers.base import (FunctionSpec, Step, ToolParser, json_args_tag,
                                                     json_value_end, loads, one_or_more, skip_ws)
from pdserve.engine.server.tool_parsers.registry import register

PYTHON_TAG = "<|python_tag|>"


@register
class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._state = "start"  # start -> (object -> after)* -> content

    def _step(self, text: str, final: bool) -> Step | None:
        if self._state == "content":
            return Step("content", len(text))
        i = skip_ws(text)
        if i == len(text):  # only whitespace so far: what follows decides
            return Step("content", len(text)) if final else None
        if self._state == "start":
            if text.startswith(PYTHON_TAG, i):
                self._state = "object"
                return Step("calls", i + len(PYTHON_TAG))
            if not final and PYTHON_TAG.startswith(text[i:]):
                return None
            self._state = "object"
        if self._state == "after":
            if text[i] != ";":
                self._state = "content"
                return Step("content", len(text))
            i = skip_ws(text, i + 1)
            if i == len(text):
                return Step("content", len(text)) if final else None
        # an object is expected at i
        if text[i] != "{":
            self._state = "content"
            return Step("content", len(text))
        end = json_value_end(text, i)
        if end is None:
            if not final:
                return None
            self._state = "content"
            return Step("content", len(text))
        call = self.call_from(loads(text[i:end]), ("parameters", "arguments"))
        if call is None:
            self._state = "content"
            return Step("content", len(text))
        self._state = "after"
        return Step("calls", end, (call,))

    @classmethod
    def describe_tools(cls, functions: list[FunctionSpec]) -> str:
        listed = "\n\n".join(json.dumps(f.openai(), ensure_ascii=False) for f in functions)
        return ("You have access to the following functions. To call a function, respond only with a JSON "
                'object of the form {"name": function name, "parameters": dictionary of argument name and its '
                "value}; separate several calls with \"; \". Do not use variables.\n\n" + listed)

    @classmethod
    def render_calls(cls, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)

    @classmethod
    def call_format(cls, functions: list[FunctionSpec], multiple: bool) -> dict[str, Any]:
        tags = [json_args_tag(f'{{"name": {json.dumps(f.name)}, "parameters": ', f, "}") for f in functions]
        return one_or_more(tags, multiple, "; ")
