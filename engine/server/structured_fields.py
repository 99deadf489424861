"""Request fields that constrain the output (OpenAI's `response_format`; vLLM's `structured_outputs`
and its older `guided_*` fields) -> one `StructuredOutputsParams`, checked before the request
reaches an engine, so that a bad spec is a 400 naming its field, not a failed request later.

Two steps: `structured_outputs_of` (cheap, on any thread: shapes, one constraint at most) and
`check_spec` (compiles with xgrammar, ms to seconds for a big schema: the server runs it on its
tokenizer thread). xgrammar and jsonschema are imported by `check_spec` only: the router parses
bodies with these models and must start without them.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.structured_output.params import KINDS, StructuredOutputsParams, canonical_json


class FieldError(ValueError):
    """A bad request field; `param` names it (the server answers 400 with it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# -- request shapes ---------------------------------------------------------------------------------


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`, as OpenAI and its SDK's `beta.chat.completions.parse` send it."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: Union[dict[str, Any], None] = Field(default=None, alias="schema")
    # OpenAI's "best effort unless strict": here the schema is always enforced, so both mean strict.
    strict: bool | None = None


RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")  # structural_tag carries its own fields
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` object: one constraint, plus whitespace control."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: Union[dict[str, Any], str, None] = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Union[dict[str, Any], str, None] = None
    disable_any_whitespace: bool = False


# -- request -> params ------------------------------------------------------------------------------


def _schema_text(schema: Any, param: str) -> str:
    try:
        text = canonical_json(schema)
    except ValueError as exc:  # json.JSONDecodeError included
        raise FieldError(param, f"{param} is not valid JSON: {exc}") from None
    if not isinstance(json.loads(text), dict):
        raise FieldError(param, f"{param} must be a JSON Schema object")
    return text


def _tag_text(tag: Any, param: str) -> str:
    """A structural tag as xgrammar's JSON text; vLLM's older {"structures", "triggers"} form is
    rewritten into xgrammar's triggered_tags format, which means the same."""
    if isinstance(tag, str):
        try:
            tag = json.loads(tag)
        except ValueError as exc:
            raise FieldError(param, f"{param} is not valid JSON: {exc}") from None
    if not isinstance(tag, dict):
        raise FieldError(param, f"{param} must be a structural tag object")
    if "format" not in tag and "structures" in tag:
        structures = tag.get("structures")
        if not isinstance(structures, list) or not all(isinstance(s, dict) for s in structures):
            raise FieldError(param, f"{param}.structures must be a list of objects")
        tags = [{"type": "tag", "begin": s.get("begin"), "end": s.get("end"),
                 "content": {"type": "json_schema", "json_schema": s.get("schema", {})}} for s in structures]
        tag = {"type": "structural_tag",
               "format": {"type": "triggered_tags", "triggers": tag.get("triggers"), "tags": tags}}
    return json.dumps(dict(tag, type="structural_tag"), separators=(",", ":"), ensure_ascii=False)


def _from_response_format(rf: ResponseFormat) -> tuple[dict[str, Any], str] | None:
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return {"json_object": True}, "response_format"
    if rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise FieldError("response_format", "response_format of type json_schema needs json_schema.schema")
        return {"json": _schema_text(rf.json_schema.schema_, "response_format")}, "response_format"
    extra = dict(rf.model_extra or {})
    return {"structural_tag": _tag_text(extra, "response_format")}, "response_format"


def _from_structured_outputs(so: StructuredOutputsRequest) -> tuple[dict[str, Any], str]:
    given = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
             "json_object": so.json_object or None, "structural_tag": so.structural_tag}
    kinds = [k for k in KINDS if given.get(k) is not None]
    if len(kinds) != 1:
        raise FieldError("structured_outputs", "structured_outputs must set exactly one of "
                         f"{', '.join(KINDS)}; got {', '.join(kinds) or 'none'}")
    kind = kinds[0]
    param = f"structured_outputs.{kind}"
    value = given[kind]
    if kind == "json":
        value = _schema_text(value, param)
    elif kind == "structural_tag":
        value = _tag_text(value, param)
    return {kind: value, "disable_any_whitespace": so.disable_any_whitespace}, param


def structured_outputs_of(body: Any) -> tuple[StructuredOutputsParams, str] | None:
    """The constraint a request asks for and the field it came from, or None for free text.
    Raises FieldError for a malformed one or for more than one."""
    found: list[tuple[dict[str, Any], str]] = []
    rf = getattr(body, "response_format", None)
    if rf is not None and (spec := _from_response_format(rf)) is not None:
        found.append(spec)
    if getattr(body, "structured_outputs", None) is not None:
        found.append(_from_structured_outputs(body.structured_outputs))
    if getattr(body, "guided_json", None) is not None:
        found.append(({"json": _schema_text(body.guided_json, "guided_json")}, "guided_json"))
    for kind in ("regex", "choice", "grammar"):
        value = getattr(body, f"guided_{kind}", None)
        if value is not None:
            found.append(({kind: value}, f"guided_{kind}"))
    if not found:
        return None
    if len(found) > 1:
        names = [param.split(".")[0] for _, param in found]
        raise FieldError(names[1], f"only one output constraint may be given; got {' and '.join(names)}")
    fields, param = found[0]
    if "choice" in fields:
        choice = fields["choice"]
        if not choice or not all(isinstance(c, str) and c for c in choice):
            raise FieldError(param, f"{param} must be a non-empty list of non-empty strings")
    try:
        return StructuredOutputsParams(**fields), param
    except ValueError as exc:
        raise FieldError(param, str(exc)) from None


# -- checking a spec --------------------------------------------------------------------------------

# JSON Schema keywords xgrammar 0.2.8 accepts but does not enforce: measured by compiling a schema
# with each and matching an instance that breaks only that keyword (tests/server/
# test_structured_outputs.py re-measures them). Output would then silently break the schema.
UNENFORCED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies", "contains",
              "maxContains")
# `format` values xgrammar enforces; others (idn-email, iri, regex, unknown names) it lets through.
ENFORCED_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "uuid", "uri", "uri-reference",
                              "uri-template", "ipv4", "ipv6", "hostname", "json-pointer", "relative-json-pointer"})
# Where subschemas sit: keyword -> how its value holds them.
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems")


def unenforced_keyword(schema: Any, path: str = "#") -> tuple[str, str] | None:
    """The first (keyword, where) in the schema that xgrammar would not enforce, or None."""
    if not isinstance(schema, dict):
        return None
    for keyword in UNENFORCED:
        if keyword in schema:
            return keyword, path
    if schema.get("uniqueItems") is True:
        return "uniqueItems", path
    if isinstance(schema.get("format"), str) and schema["format"] not in ENFORCED_FORMATS:
        return f"format {schema['format']!r}", path
    for bound in ("minLength", "maxLength"):  # xgrammar keeps the pattern/format and drops the length
        for shape in ("pattern", "format"):
            if bound in schema and shape in schema:
                return f"{bound} together with {shape}", path
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "allOf (with more than one subschema)", path  # xgrammar keeps only part of it
    # oneOf is enforced as anyOf: fine when the branches exclude each other, as pydantic's
    # discriminated unions (which say so with `discriminator`) do; otherwise a value may match two.
    if "oneOf" in schema and "discriminator" not in schema:
        return "oneOf without a discriminator (only anyOf is enforced)", path
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"$ref to {ref!r} (only local references are resolved)", path
    for keyword in _ONE:
        found = unenforced_keyword(schema.get(keyword), f"{path}/{keyword}")
        if found:
            return found
    for keyword in _MAP:
        value = schema.get(keyword)
        if isinstance(value, dict):
            for name, sub in value.items():
                if (found := unenforced_keyword(sub, f"{path}/{keyword}/{name}")):
                    return found
    for keyword in _LIST:
        value = schema.get(keyword)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                if (found := unenforced_keyword(sub, f"{path}/{keyword}/{i}")):
                    return found
    return None


def check_spec(spec: StructuredOutputsParams, param: str) -> None:
    """Raises FieldError(param) if the grammar engine cannot build the constraint or would not
    enforce all of it. Slow for big schemas (it compiles one): call it off the event loop."""
    problem = _problem(spec.kind, spec.spec if spec.kind != "choice" else None, spec.disable_any_whitespace)
    if problem is not None:
        raise FieldError(param, f"{param}: {problem}")


@functools.lru_cache(maxsize=512)
def _problem(kind: str, text: Any, disable_any_whitespace: bool) -> str | None:
    """What is wrong with a spec, or None; cached, since clients send the same schema again and again."""
    import xgrammar as xgr

    try:
        if kind == "json":
            schema = json.loads(text)
            from jsonschema import Draft202012Validator
            from jsonschema.exceptions import SchemaError

            try:
                Draft202012Validator.check_schema(schema)
            except SchemaError as exc:
                where = "/".join(str(p) for p in exc.absolute_path)
                return f"not a valid JSON Schema: {exc.message}" + (f" (at #/{where})" if where else "")
            found = unenforced_keyword(schema)
            if found is not None:
                keyword, where = found
                return (f"the schema uses {keyword} at {where}, which the grammar engine (xgrammar) does not "
                        "enforce; output could break it, so it is refused")
            xgr.Grammar.from_json_schema(text, any_whitespace=not disable_any_whitespace, strict_mode=True)
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(text)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(text)
    except Exception as exc:  # xgrammar reports every malformed spec as RuntimeError/ValueError with its reason
        return f"cannot be compiled: {_reason(exc)}"
    return None


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix ("[time] file.cc:123: ")."""
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        head, _, rest = text.partition("] ")
        head2, sep, tail = rest.partition(": ")
        if sep and (".cc:" in head2 or ".h:" in head2):
            return tail.strip()
    return text.splitlines()[0] if text else type(exc).__name__
