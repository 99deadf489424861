"""Per-request sampling settings, with vLLM's names and meaning.

A `msgspec.Struct` so the same object crosses process boundaries without conversion. Invalid
values raise `ValueError` naming the field, at construction time, before a request reaches an
engine.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import msgspec

from pdserve.engine.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True, dict=True):
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    logprobs: int | None = None  # number of top logprobs per generated token, besides the sampled one
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # A grammar the output must match (JSON schema, regex, choice, ...); None: free text.
    structured_outputs: StructuredOutputsParams | None = None
    # Free-form per-request settings for extensions, e.g. {"kv_transfer_params": {...}}.
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s] or None
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(field: str, rule: str) -> ValueError:
            return ValueError(f"{field} must be {rule}, got {getattr(self, field)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "at least 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        # Finite as well: an infinite temperature or penalty turns the -inf of a masked token (a
        # grammar's, a stop's) into NaN (-inf / inf), and sampling from NaN picks token 0 whatever
        # the mask says. JSON's 1e999 reaches here as inf.
        if not 0.0 < self.repetition_penalty < math.inf:
            raise bad("repetition_penalty", "greater than 0 and finite")
        if not 0.0 <= self.temperature < math.inf:
            raise bad("temperature", "non-negative and finite")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "-1, 0 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "at least 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", "non-negative")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad("prompt_logprobs", "non-negative")
        if self.stop_token_ids is not None and any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        # What torch's generators take and what crosses to the engine (msgpack's int64 or uint64);
        # a bigger one failed to encode after the request was accepted (a 500).
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", f"an integer in [{SEED_MIN}, {SEED_MAX}]")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self.stop_token_ids or ())

    def clone(self, **changes: Any) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)
