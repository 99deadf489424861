"""Which request fields pdserve accepts: a field it does not implement is a 400 naming it, never a
silent ignore.

A request body may hold three kinds of fields:
- the fields the request models declare: implemented (helpers add theirs by declaring them);
- OpenAI fields that have no effect on a self-hosted server and are safe to accept: `NO_OP_FIELDS`,
  each with the values for which "no effect" is true (store=true, for one, would promise storage);
- everything else: refused, with a hint where we know why (`HINTS`).

A field sent as null counts as not sent, at every level: clients (and the openai SDK, re-sending an
assistant message it parsed) spell "unset" that way.

This runs as a `mode="before"` validator of the request models, so the router, which parses bodies
with the same models, refuses them too before routing anything. Errors are pydantic
`ValidationError`s whose one location is the field's path (`messages[1].content[0]`), which the
servers' `parse_body` turns into a 400 with that path as `param`.
"""

from __future__ import annotations

from typing import Any, Callable

from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError


def field_error(param: str, message: str, value: Any = None) -> ValidationError:
    """A validation error located at `param` (a path like `messages[0].content[1]`)."""
    detail = InitErrorDetails(type=PydanticCustomError("request_field", message),
                              loc=(param,), input=value)
    return ValidationError.from_exception_data("request", [detail])


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def _is_str_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


# field -> (is this value a no-op?, what the accepted values are). Each comment says why it has no effect.
NO_OP_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    # Tags for OpenAI's stored completions and dashboards; nothing is stored here.
    "metadata": (_is_str_map, "an object of string values"),
    # Storing completions for OpenAI's distillation/evals: only "do not store" can be honoured.
    "store": (lambda v: v is False, "false (completions are not stored)"),
    # OpenAI's processing tiers; one engine has one tier, which is what "auto"/"default" ask for.
    "service_tier": (lambda v: v in ("auto", "default"), '"auto" or "default"'),
    # Output modalities; a text model produces text only.
    "modalities": (lambda v: v == ["text"], '["text"]'),
    # OpenAI's prompt-cache routing hint and abuse-monitoring id: the prefix cache here is automatic,
    # and the router already routes by prefix; nobody monitors with the id.
    "prompt_cache_key": (_is_text, "a string"),
    "safety_identifier": (_is_text, "a string"),
    # vLLM's xgrammar backend is ours too ("auto" picks it).
    "guided_decoding_backend": (lambda v: v in ("xgrammar", "auto"), '"xgrammar" or "auto"'),
}

HINTS: dict[str, str] = {
    # Deprecated by OpenAI in favour of tools; mapping them would keep a second spelling alive.
    "functions": "it is deprecated: use tools",
    "function_call": "it is deprecated: use tool_choice",
    "audio": "this server generates text only",
    "prediction": "predicted outputs (speculative decoding from a given text) are not implemented",
    "web_search_options": "there is no web search here",
    "reasoning_effort": "no served model has a reasoning-effort control",
    "verbosity": "no served model has a verbosity control",
    "guided_whitespace_pattern": "use disable_any_whitespace in structured_outputs instead",
    "cache_salt": "per-request cache isolation is not implemented",
}


def declared_fields(model: type[BaseModel]) -> set[str]:
    names = set()
    for name, info in model.model_fields.items():
        names.add(info.alias or name)
    return names


def unsupported(param: str, key: str, value: Any) -> ValidationError:
    hint = HINTS.get(key)
    return field_error(param, f"unsupported field '{key}'" + (f": {hint}" if hint else ": pdserve does not implement it"),
                       value)


def check_object(data: Any, model: type[BaseModel], prefix: str = "", *, no_ops: bool = False) -> Any:
    """`data` with null undeclared fields removed (and, with `no_ops`, the no-op fields once
    checked); raises for any other undeclared field."""
    if not isinstance(data, dict):
        return data  # pydantic reports the wrong type itself
    declared = declared_fields(model)
    kept = {}
    for key, value in data.items():
        param = f"{prefix}{key}"
        if key in declared:
            kept[key] = value
        elif value is None:
            continue
        elif no_ops and key in NO_OP_FIELDS:
            accepts, expected = NO_OP_FIELDS[key]
            if not accepts(value):
                raise field_error(param, f"{key} must be {expected} here; got {value!r}", value)
        else:
            raise unsupported(param, key, value)
    return kept


def check_messages(messages: Any, message_model: type[BaseModel]) -> Any:
    """Messages with only known fields, and content that is text: a text model cannot see an image,
    hear audio or read a file, and answering as if it had would mislead."""
    if not isinstance(messages, list):
        return messages
    checked = []
    for i, message in enumerate(messages):
        message = check_object(message, message_model, f"messages[{i}].")
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                if not isinstance(part, dict):
                    raise field_error(where, "a content part must be an object", part)
                kind = part.get("type")
                if kind != "text":
                    raise field_error(where, f"content parts of type {kind!r} are not supported: only text parts are",
                                      part)
                extra = [k for k, v in part.items() if k not in ("type", "text") and v is not None]
                if extra:
                    raise unsupported(f"{where}.{extra[0]}", extra[0], part[extra[0]])
                parts.append({"type": "text", "text": part.get("text")})
            message = dict(message, content=parts)
        checked.append(message)
    return checked
