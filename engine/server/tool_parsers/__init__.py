"""Tool-call parsers: model text -> content and function calls, one class per call format."""

from pdserve.engine.server.tool_parsers.base import (FunctionSpec, ParseResult, ParserDelta, ToolCall,
                                                     ToolParser)
from pdserve.engine.server.tool_parsers.registry import get_parser, parser_names

# Registered on import.
from pdserve.engine.server.tool_parsers import hermes, llama3_json, mistral, pythonic  # noqa: E402,F401

DEFAULT_PARSER = "hermes"

__all__ = ["DEFAULT_PARSER", "FunctionSpec", "ParseResult", "ParserDelta", "ToolCall", "ToolParser",
           "get_parser", "parser_names"]
