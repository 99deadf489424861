"""Reading one request's body for a pick: JSON, model, and the prompt's token ids.

Only what placing the request needs is checked here: the body must be a JSON object within the
size limit, and name this pool's model. Anything else the engine validates itself (it answers the
client's 400 through the gateway); a body the engine's own request schema refuses is placed
without a prompt hint and never disaggregated.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from pdserve.engine.server.errors import APIError
from pdserve.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.router.app import chat_prompt, rendered_chars, tokenize_within
from pdserve.router.local_tokenizer import LocalTokenizer
from pdserve.router.pd import RoutedRequest
from pdserve.router.prefix import estimate_tokens

log = logging.getLogger("pdserve.epp")

ROUTES = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def route_of(path: str) -> str | None:
    """"completions", "chat", or None for any other path (placed, never disaggregated)."""
    return ROUTES.get(path.split("?", 1)[0].rstrip("/") or "/")


def read_json(raw: bytes, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object; APIError 413/400 as the router's would answer."""
    if len(raw) > max_bytes:
        raise APIError(413, f"Request body too large: {len(raw)} bytes, over the limit of {max_bytes}.",
                       code="request_too_large")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise APIError(400, f"The request body is not valid UTF-8: {exc.reason} at byte {exc.start}.") from None
    except json.JSONDecodeError as exc:
        raise APIError(400, f"The request body is not valid JSON: {exc.msg} (line {exc.lineno}, "
                            f"column {exc.colno}).") from None
    except RecursionError:
        raise APIError(400, "The request body is nested too deeply.") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    return data


def check_model(body: dict[str, Any], served: str) -> None:
    model = body.get("model")
    if model is None:
        return  # e.g. a path that takes no model: the engine judges it
    if model != served:
        shown = model if isinstance(model, str) else json.dumps(model)[:100]
        raise APIError(404, f"The model `{shown[:200]}` does not exist.", param="model", code="model_not_found")


@dataclass
class PromptReader:
    tokenizer: LocalTokenizer | None
    tool_parser: Any

    async def routed(self, route: str, body: dict[str, Any]) -> RoutedRequest | None:
        """The request as the router's P/D flow sees it (token ids, prompt length, single prompt),
        or None when the engines' request schema refuses the body."""
        try:
            if route == "completions":
                return await self._completion(body)
            return await self._chat(body)
        except (ValidationError, APIError, ValueError, TypeError) as exc:
            log.debug("placing a %s request without a prompt hint: %s", route, exc)
            return None

    async def _completion(self, body: dict[str, Any]) -> RoutedRequest:
        parsed = CompletionRequest.model_validate(body)
        prompts = parsed.prompts()
        routed = RoutedRequest("completions", body, {}, stream=parsed.stream, single_prompt=len(prompts) == 1)
        if routed.single_prompt:
            prompt = prompts[0]
            if self.tokenizer is not None:
                routed.token_ids = await tokenize_within(self.tokenizer, self.tokenizer.completion, prompt)
            elif isinstance(prompt, list):
                routed.token_ids = list(prompt)
            routed.prompt_tokens = len(routed.token_ids) if routed.token_ids is not None else (
                estimate_tokens(len(prompt)) if isinstance(prompt, str) else None)
        return routed

    async def _chat(self, body: dict[str, Any]) -> RoutedRequest:
        parsed = ChatCompletionRequest.model_validate(body)
        routed = RoutedRequest("chat", body, {}, stream=parsed.stream)
        messages, tools = chat_prompt(parsed, self.tool_parser, self.tokenizer)
        if self.tokenizer is not None:
            routed.token_ids = await tokenize_within(self.tokenizer, self.tokenizer.chat, messages,
                                                     parsed.add_generation_prompt, parsed.chat_template_kwargs, tools)
        routed.prompt_tokens = len(routed.token_ids) if routed.token_ids is not None else estimate_tokens(
            rendered_chars(messages, tools))
        return routed
