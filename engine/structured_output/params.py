"""What a request asks its output to match: the one boundary type between the API server, the
engine core (which compiles and advances grammars) and the router.

Exactly one constraint is set. The spec travels with the request's SamplingParams, so it must be
msgspec-encodable; `json` is kept as compact JSON text, never a dict. Key order is kept, not
sorted: a schema's property order is the order the output's fields are generated in (as OpenAI
does), and it matters for answers ("reasoning" before "answer"). Equal text shares one grammar.
"""

from __future__ import annotations

import json as _json
from typing import Any

import msgspec

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True, frozen=True):
    json: str | None = None  # a JSON schema as compact JSON text (see `canonical_json`)
    json_object: bool = False  # any JSON object ({"type": "json_object"})
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # GBNF / EBNF, xgrammar's dialect
    structural_tag: str | None = None  # xgrammar structural tag, JSON text
    # JSON kinds: do not allow free whitespace between tokens (vLLM's disable_any_whitespace).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        set_kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(KINDS)}; got {', '.join(set_kinds) or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> Any:
        return getattr(self, self.kind)

    def key(self) -> tuple[str, str, bool]:
        """The compiled-grammar cache key: equal keys compile to the same grammar."""
        spec = self.spec
        text = _json.dumps(spec) if isinstance(spec, list) else str(spec)
        return (self.kind, text, self.disable_any_whitespace)


def canonical_json(schema: Any) -> str:
    """A schema (dict or JSON text) as compact JSON text, its key order kept; ValueError if it is not JSON."""
    if isinstance(schema, str):
        schema = _json.loads(schema)
    return _json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
