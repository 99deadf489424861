"""What users get back: `RequestOutput` with one `CompletionOutput` per sampled sequence."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


# One dict per generated token: the sampled token and the top-k alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token, as SampleLogprobs; the first token has no logprob (None).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    # Asked for with SamplingParams.prompt_logprobs; set once every prompt position is known (from
    # the first generated token on), and then carried by every later output of the request.
    prompt_logprobs: PromptLogprobs | None = None
