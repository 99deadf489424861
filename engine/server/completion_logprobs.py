"""Logprobs of /v1/completions: OpenAI's legacy format (with `echo`, the prompt's tokens first), and
vLLM's `prompt_logprobs` field.

A scoring client (lm-evaluation-harness's `local-completions`) sends the text to score as the
prompt with `echo`, `logprobs` and one or zero new tokens, and sums `token_logprobs` over the
prompt; the first prompt token has no logprob (null), as in OpenAI's API.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from pdserve.engine.outputs import CompletionOutput, Logprob, PromptLogprobs

# JSON has no -inf: OpenAI and vLLM report this floor instead.
LOWEST_LOGPROB = -9999.0


def _json_logprob(value: float) -> float:
    return value if value >= LOWEST_LOGPROB else LOWEST_LOGPROB


@dataclass
class EchoedPrompt:
    token_ids: list[int]
    logprobs: PromptLogprobs | None  # None when not asked for (echo without logprobs)


def _shown(token_id: int, entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The token itself and the k most likely ones (the engine may have computed more)."""
    return [(t, lp) for t, lp in entry.items() if t == token_id or (lp.rank is not None and lp.rank <= k)]


class _LegacyLogprobs:
    def __init__(self, k: int, decode: Callable[[int], str], offset: int) -> None:
        self.k, self.decode, self.offset = k, decode, offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token_id: int, entry: dict[int, Logprob] | None) -> None:
        if entry is None:  # the prompt's first token: nothing comes before it
            text, logprob, top = self.decode(token_id), None, None
        else:
            chosen = entry.get(token_id) or Logprob(float("-inf"), None, self.decode(token_id))
            text, logprob = chosen.decoded_token or "", _json_logprob(chosen.logprob)
            top = {(lp.decoded_token or ""): _json_logprob(lp.logprob) for _, lp in _shown(token_id, entry, self.k)}
        self.tokens.append(text)
        self.token_logprobs.append(logprob)
        self.top_logprobs.append(top)
        self.text_offset.append(self.offset)
        self.offset += len(text)


def legacy_logprobs(c: CompletionOutput, k: int, decode: Callable[[int], str], echoed: EchoedPrompt | None = None,
                    offset: int = 0) -> tuple[dict[str, Any] | None, int]:
    """A choice's `logprobs` (None without any) and the text offset after its last token; streamed
    chunks pass that offset on, so offsets count from the start of the choice's text."""
    if c.logprobs is None and (echoed is None or echoed.logprobs is None):
        return None, offset
    out = _LegacyLogprobs(k, decode, offset)
    if echoed is not None:
        for token_id, entry in zip(echoed.token_ids, echoed.logprobs or [None] * len(echoed.token_ids)):
            out.add(token_id, entry)
    for token_id, entry in zip(c.token_ids, c.logprobs or []):
        out.add(token_id, entry)
    return {"tokens": out.tokens, "token_logprobs": out.token_logprobs, "top_logprobs": out.top_logprobs,
            "text_offset": out.text_offset}, out.offset


def vllm_prompt_logprobs(token_ids: list[int], logprobs: PromptLogprobs | None, k: int) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` on a choice: per prompt token (null first), token id -> logprob, rank,
    decoded token, for the token itself and the k most likely ones."""
    if logprobs is None:
        return None
    return [None if entry is None else {
        str(t): {"logprob": _json_logprob(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
        for t, lp in _shown(token_id, entry, k)} for token_id, entry in zip(token_ids, logprobs)]


def prompt_only(c: CompletionOutput) -> CompletionOutput:
    """The choice of a `max_tokens: 0` echo: the engine generated one token (it always does), which
    the answer leaves out."""
    return dataclasses.replace(c, text="", token_ids=[], cumulative_logprob=None,
                               logprobs=[] if c.logprobs is not None else None,
                               finish_reason="length" if c.finish_reason is not None else None, stop_reason=None)
