"""Tool-call parsers by name (`--tool-call-parser`)."""

from __future__ import annotations

from typing import TypeVar

from pdserve.engine.server.tool_parsers.base import ToolParser

P = TypeVar("P", bound=type[ToolParser])
_PARSERS: dict[str, type[ToolParser]] = {}


def register(cls: P) -> P:
    if cls.name in _PARSERS:
        raise ValueError(f"tool-call parser {cls.name!r} is registered twice")
    _PARSERS[cls.name] = cls
    return cls


def get_parser(name: str) -> type[ToolParser]:
    try:
        return _PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(parser_names())}") from None


def parser_names() -> list[str]:
    return sorted(_PARSERS)
