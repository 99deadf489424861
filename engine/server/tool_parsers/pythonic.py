"""Pythonic calls (Llama 3.2/4 style): the answer is a Python list of calls,
`[get_weather(city="Paris"), get_time()]`, possibly between <|python_start|> and <|python_end|>.

The list is read with `ast.parse` and its argument values converted by hand from literal nodes:
nothing the model writes is ever evaluated. JSON's true/false/null are accepted as literals too,
since the grammar that forces a call (call_format) writes argument values as JSON.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from pdserve.engine.server.tool_parsers.base import FunctionSpec, Step, ToolParser, json_schema_format, skip_ws
from pdserve.engine.server.tool_parsers.registry import register

START, END = "<|python_start|>", "<|python_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


class _NotLiteral(Exception):
    pass


def _literal(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float, bool))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            key = _literal(k) if k is not None else None
            if not isinstance(key, str):
                raise _NotLiteral
            out[key] = _literal(v)
        return out
    raise _NotLiteral


def _calls(tree: ast.expr) -> list[tuple[str, dict[str, Any]]] | None:
    if not isinstance(tree, ast.List):
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        try:
            args = {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
        except (_NotLiteral, RecursionError):
            return None
        if len(args) != len(node.keywords):  # **kwargs
            return None
        calls.append((node.func.id, args))
    return calls


@register
class PythonicToolParser(ToolParser):
    name = "pythonic"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._state = "start"  # start -> list -> after -> content

    def _step(self, text: str, final: bool) -> Step | None:
        if self._state == "content":
            return Step("content", len(text))
        i = skip_ws(text)
        if i == len(text):
            return Step("content", len(text)) if final else None
        if self._state == "after":
            self._state = "content"
            if text.startswith(END, i):
                return Step("calls", i + len(END))
            if not final and END.startswith(text[i:]):
                self._state = "after"
                return None
            return Step("content", len(text))
        if self._state == "start":
            if text.startswith(START, i):
                self._state = "list"
                return Step("calls", i + len(START))
            if not final and START.startswith(text[i:]):
                return None
            self._state = "list"
        if text[i] != "[":
            self._state = "content"
            return Step("content", len(text))
        # The list ends at the first "]" up to which the text parses (a "]" inside a string does not).
        end = text.find("]", i)
        while end >= 0:
            try:
                tree = ast.parse(text[i:end + 1], mode="eval").body
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                end = text.find("]", end + 1)
                continue
            calls = _calls(tree)
            if calls is None or any(self.tool_names is not None and n not in self.tool_names for n, _ in calls):
                self._state = "content"
                return Step("content", len(text))
            self._state = "after"
            return Step("calls", end + 1, tuple(calls))
        if not final:
            return None
        self._state = "content"
        return Step("content", len(text))

    @classmethod
    def describe_tools(cls, functions: list[FunctionSpec]) -> str:
        listed = json.dumps([f.openai() for f in functions], ensure_ascii=False, indent=2)
        return ("You have access to the functions below. To call functions, respond only with a Python list "
                "of calls in the format [func_name1(param_name1=value1, param_name2=value2), func_name2(...)] "
                "and nothing else.\n\n" + listed)

    @classmethod
    def render_calls(cls, calls: list[tuple[str, dict[str, Any]]]) -> str:
        return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={_py(v)}" for k, v in a.items()) + ")"
                               for n, a in calls) + "]"

    @classmethod
    def _call_tag(cls, spec: FunctionSpec) -> dict[str, Any]:
        return {"type": "tag", "begin": f"{spec.name}(", "content": _kwargs_format(spec.parameters), "end": ")"}

    @classmethod
    def call_format(cls, functions: list[FunctionSpec], multiple: bool) -> dict[str, Any]:
        tags = [cls._call_tag(f) for f in functions]
        inner = ({"type": "tags_with_separator", "tags": tags, "separator": ", ", "at_least_one": True}
                 if multiple else (tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}))
        return {"type": "tag", "begin": "[", "content": inner, "end": "]"}


def _py(value: Any) -> str:
    """A JSON value as a Python literal."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_py(k)}: {_py(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_py(v) for v in value) + "]"
    return repr(value) if isinstance(value, (bool, type(None))) else json.dumps(value, ensure_ascii=False)


def _kwargs_format(schema: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments `a=<json>, b=<json>` for the schema's properties, in the schema's order:
    the required ones always, the optional ones maybe. Values are JSON, which Python reads as
    literals apart from true/false/null (the parser accepts those)."""
    props = list((schema.get("properties") or {}).items())
    required = set(schema.get("required") or ())
    defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}

    def prop(name: str, sub: Any, lead: str) -> dict[str, Any]:
        sub = dict(sub, **defs) if isinstance(sub, dict) else sub  # keep $ref targets reachable
        return {"type": "sequence", "elements": [{"type": "const_string", "value": f"{lead}{name}="},
                                                 json_schema_format(sub)]}

    def seq(elements: list[dict[str, Any]]) -> dict[str, Any]:
        elements = [e for e in elements if e is not None]
        if not elements:
            return {"type": "const_string", "value": ""}
        return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}

    def rest(i: int) -> list[dict[str, Any]]:  # properties i.. once an argument has been written
        return [prop(n, s, ", ") if n in required else {"type": "optional", "content": prop(n, s, ", ")}
                for n, s in props[i:]]

    def first(i: int) -> dict[str, Any]:  # properties i.. with nothing written yet
        if i == len(props):
            return {"type": "const_string", "value": ""}
        name, sub = props[i]
        written = seq([prop(name, sub, ""), *rest(i + 1)])
        if name in required:
            return written
        return {"type": "or", "elements": [written, first(i + 1)]}

    return first(0)
