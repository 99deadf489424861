"""Defaulting and OpenAPI validation of an InferenceService, as the API server does them.

`pdserve operator render` has no API server in front of it, and a test server (kmock) neither
defaults nor validates; both paths go through here so they see exactly what a cluster would store.
"""

from __future__ import annotations

import copy
from typing import Any

import jsonschema

from pdserve.operator.crd import openapi_schema

_SCHEMA = openapi_schema()
# OpenAPI v3.0 schemas use draft-4 semantics (a boolean exclusiveMinimum); unknown
# `x-kubernetes-*` keywords are ignored by jsonschema, which is why CEL has Python twins.
_VALIDATOR = jsonschema.Draft4Validator(_SCHEMA)


def apply_defaults(value: Any, schema: dict[str, Any] | None = None) -> Any:
    """Fill absent fields with their schema defaults, top-down, in place; returns `value`.

    Same order as the apiextensions defaulting: a default is set first and then defaulted itself,
    so `default: {}` on an object brings in the defaults of its children.
    """
    schema = _SCHEMA if schema is None else schema
    if isinstance(value, dict):
        for key, prop in schema.get("properties", {}).items():
            if key not in value and "default" in prop:
                value[key] = copy.deepcopy(prop["default"])
            if key in value:
                apply_defaults(value[key], prop)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value.keys() - schema.get("properties", {}).keys():
                apply_defaults(value[key], extra)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_defaults(item, schema["items"])
    return value


def schema_errors(obj: dict[str, Any]) -> list[str]:
    """OpenAPI errors of a (defaulted) resource, as `path: message` lines; [] when valid."""
    errors = sorted(_VALIDATOR.iter_errors(obj), key=lambda e: list(e.absolute_path))
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}" for e in errors]


def defaulted(obj: dict[str, Any]) -> dict[str, Any]:
    """A defaulted deep copy of a resource."""
    return apply_defaults(copy.deepcopy(obj))
