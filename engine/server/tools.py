"""Tool calling on chat: checking `tools` / `tool_choice` / `parallel_tool_calls`, the chat
template's inputs (tools, earlier calls, tool results), the output constraint that makes
`required` and named calls valid, and the `tool_calls` of responses and stream chunks.

The call format itself (how a call is written, parsed and constrained) is the parser's
(tool_parsers/, chosen by --tool-call-parser); this module applies it to a request.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal, Sequence

from pdserve.engine.server.errors import APIError
from pdserve.engine.server.protocol import ChatCompletionRequest, ChatMessage
from pdserve.engine.server.tool_parsers import FunctionSpec, ToolCall, ToolParser
from pdserve.engine.structured_output.params import StructuredOutputsParams, canonical_json

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


@dataclass(frozen=True)
class ToolPlan:
    """What a request with active tools (tools given, tool_choice not "none") asks for."""

    functions: tuple[FunctionSpec, ...]
    choice: Literal["auto", "required", "named"]
    named: str | None  # the function of a named tool_choice
    parallel: bool
    parser: type[ToolParser]

    def new_parser(self) -> ToolParser:
        return self.parser([f.name for f in self.functions], max_calls=None if self.parallel else 1)

    def format(self) -> dict[str, Any] | None:
        """The xgrammar structural-tag format the output must follow, None for free text."""
        if self.choice == "named":
            return self.parser.call_format([f for f in self.functions if f.name == self.named], multiple=False)
        if self.choice == "required":
            return self.parser.call_format(list(self.functions), multiple=self.parallel)
        return self.parser.auto_format(list(self.functions), multiple=self.parallel)

    def constraint(self) -> StructuredOutputsParams | None:
        fmt = self.format()
        if fmt is None:
            return None
        return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": fmt},
                                                                 ensure_ascii=False))


# -- request checks ---------------------------------------------------------------------------------


def check_functions(tools: list[dict[str, Any]]) -> list[FunctionSpec]:
    functions: list[FunctionSpec] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(where, f"{where} must be an object")
        if tool.get("type") != "function":
            raise _bad(f"{where}.type", f'{where}.type must be "function", got {tool.get("type")!r}')
        extra = sorted(set(tool) - {"type", "function"})
        if extra:
            raise _bad(f"{where}.{extra[0]}", f"unsupported field '{extra[0]}' in {where}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise _bad(f"{where}.function", f"{where}.function must be an object")
        extra = sorted(k for k in set(fn) - {"name", "description", "parameters", "strict"} if fn[k] is not None)
        if extra:
            raise _bad(f"{where}.function.{extra[0]}", f"unsupported field '{extra[0]}' in {where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise _bad(f"{where}.function.name", f"{where}.function.name must be 1 to 64 letters, digits, '_' or "
                                                 f"'-'; got {name!r}")
        if name in seen:
            raise _bad(f"{where}.function.name", f"{where}.function.name {name!r} is declared twice; tool names "
                                                 "must be unique")
        seen.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise _bad(f"{where}.function.description", f"{where}.function.description must be a string")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise _bad(f"{where}.function.strict", f"{where}.function.strict must be a boolean")
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = dict(_EMPTY_PARAMETERS)
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise _bad(f"{where}.function.parameters", f"{where}.function.parameters must be a JSON Schema of "
                                                       'type "object" (the arguments are an object)')
        functions.append(FunctionSpec(name, description, parameters))
    return functions


def plan(body: ChatCompletionRequest, parser: type[ToolParser]) -> ToolPlan | None:
    """The request's tool plan, None when no tool may be called; APIError(400) naming the bad field.

    Checks each function's schema with the structured-output checks (helper B's check_spec: a
    valid JSON Schema that the grammar engine enforces in full) when the plan constrains the
    output with it. Compiles: call off the event loop."""
    choice = body.tool_choice
    if body.tools is None:
        if choice not in (None, "none"):
            raise _bad("tool_choice", "tool_choice needs tools: declare the functions in `tools`")
        return None
    if not body.tools:
        raise _bad("tools", "tools must not be empty (leave it out instead)")
    functions = check_functions(body.tools)
    if choice is None:
        choice = "auto"
    named = None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _bad("tool_choice", f'tool_choice must be "none", "auto", "required" or '
                                      f'{{"type": "function", "function": {{"name": ...}}}}; got {choice!r}')
        if choice == "none":
            return None
        mode: Literal["auto", "required", "named"] = choice  # type: ignore[assignment]
    else:
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad("tool_choice", 'a named tool_choice is {"type": "function", "function": {"name": ...}}')
        named = fn["name"]
        if named not in {f.name for f in functions}:
            raise _bad("tool_choice", f"tool_choice names the function {named!r}, which is not in tools")
        mode = "named"
    result = ToolPlan(tuple(functions), mode, named, body.parallel_tool_calls, parser)
    if result.format() is not None:
        _check_schemas(result)
    return result


def _check_schemas(plan_: ToolPlan) -> None:
    from pdserve.engine.server.structured_fields import FieldError, check_spec

    for i, f in enumerate(plan_.functions):
        if plan_.named is not None and f.name != plan_.named:
            continue
        param = f"tools[{i}].function.parameters"
        try:
            check_spec(StructuredOutputsParams(json=canonical_json(f.parameters)), param)
        except FieldError as exc:
            raise _bad(exc.param, str(exc)) from None


# -- the chat template's inputs ---------------------------------------------------------------------


def template_knows_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template reads `tools` (and so renders tool calls and results itself)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: transformers picks "tool_use" when tools are given
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and re.search(r"\btools\b", template) is not None


def _arguments(raw: Any, param: str) -> dict[str, Any]:
    """A history call's arguments as the dict templates expect (clients send the JSON text)."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise _bad(param, f"{param} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise _bad(param, f"{param} must be a JSON object")
    return raw


def _history_calls(message: ChatMessage, i: int) -> list[tuple[str | None, str, dict[str, Any]]]:
    """(id, name, arguments) of an assistant message's tool_calls."""
    out = []
    for j, call in enumerate(message.tool_calls or ()):
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(call, dict):
            raise _bad(where, f"{where} must be an object")
        if call.get("type", "function") != "function":
            raise _bad(f"{where}.type", f'{where}.type must be "function"')
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f"{where}.function", f"{where}.function must be an object with a name")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise _bad(f"{where}.id", f"{where}.id must be a string")
        out.append((call_id, fn["name"], _arguments(fn.get("arguments", {}), f"{where}.function.arguments")))
    return out


def template_messages(messages: Sequence[ChatMessage], parser: type[ToolParser], knows_tools: bool,
                      functions: Sequence[FunctionSpec] | None) -> list[dict[str, Any]]:
    """The messages for the chat template. `functions`: the tools to describe to a model whose
    template ignores them (None: none to describe).

    A template that reads `tools` gets the history in the shape such templates share: assistant
    `tool_calls` with arguments as dicts, and role "tool" messages. A template that never mentions
    tools (smollm2's plain chatml) would drop the calls and choke on a null content, and the model
    would never learn the tools exist: for it the tools are described in a system-prompt block, in
    the parser's own call format (so what the model is taught is what the parser reads), and
    earlier calls and results are written into the text in that same format."""
    names: dict[str, str] = {}  # call id -> function name, for the results
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        try:
            text = m.text()
        except ValueError as exc:
            raise _bad(f"messages[{i}].content", str(exc)) from None
        if m.tool_calls and m.role != "assistant":
            raise _bad(f"messages[{i}].tool_calls", "only assistant messages carry tool_calls")
        if m.role == "assistant" and m.tool_calls:
            calls = _history_calls(m, i)
            names.update((cid, name) for cid, name, _ in calls if cid)
            if knows_tools:
                out.append({"role": "assistant", "content": text, "tool_calls": [
                    {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                    for cid, name, args in calls]})
            else:
                written = parser.render_calls([(name, args) for _, name, args in calls])
                out.append({"role": "assistant", "content": f"{text}\n{written}" if text else written})
            continue
        if m.role == "tool":
            if m.tool_call_id is None:
                raise _bad(f"messages[{i}].tool_call_id", "a tool message needs the tool_call_id it answers")
            name = m.name or names.get(m.tool_call_id)
            if knows_tools:
                out.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": text,
                            **({"name": name} if name else {})})
            else:  # consecutive results form one user turn, as hermes-style templates write them
                if out and out[-1].get("_results") is not None:
                    out[-1]["_results"].append((name, text))
                else:
                    out.append({"role": "user", "_results": [(name, text)]})
            continue
        if m.tool_call_id is not None:
            raise _bad(f"messages[{i}].tool_call_id", "only tool messages carry a tool_call_id")
        out.append({"role": m.role, "content": text})
    for message in out:
        results = message.pop("_results", None)
        if results is not None:
            message["content"] = parser.render_results(results)
    if functions and not knows_tools:
        block = parser.describe_tools(list(functions))
        if out and out[0]["role"] == "system":
            out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block)
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


# -- responses --------------------------------------------------------------------------------------


def call_chunks(calls: list[ToolCall], first_index: int) -> list[dict[str, Any]]:
    """`delta.tool_calls` entries for completed calls, as OpenAI streams them: the call's opening
    (index, id, type, name, empty arguments), then its arguments."""
    out = []
    for k, call in enumerate(calls):
        index = first_index + k
        out.append({"index": index, "id": call.id, "type": "function",
                    "function": {"name": call.name, "arguments": ""}})
        out.append({"index": index, "function": {"arguments": call.arguments}})
    return out
