"""What the scheduler hands the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen, or one resumed after preemption (sent whole again)."""

    req_id: str
    token_ids: list[int]  # prompt plus any tokens generated before a preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """Requests the runner already holds: only what changed."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner should forget: finished, aborted or preempted since the last step.
    finished_req_ids: set[str]
    # What the KV connector's worker side needs this step (loads to start, blocks to hold).
    kv_connector_metadata: Any = None
    # Structured outputs: for each request that samples under a grammar this step, one int32 row
    # of ceil(vocab / 32) words (bit t set: token t allowed), in the order of the ids below.
    grammar_bitmask: np.ndarray | None = None
    structured_output_request_ids: list[str] = field(default_factory=list)

    @classmethod
    def empty(cls, finished_req_ids: set[str] | None = None) -> "SchedulerOutput":
        return cls([], CachedRequestData(), {}, 0, finished_req_ids or set())


@dataclass
class StepTiming:
    """Where one step's time went on the worker (seconds), and what the step held."""

    prepare_s: float = 0.0  # building the flat batch and attention metadata
    forward_s: float = 0.0  # the model forward, logits included
    sample_s: float = 0.0  # sampling and recording the tokens
    num_reqs: int = 0
    num_tokens: int = 0
    num_decodes: int = 0
    decode_context_tokens: int = 0  # sum of context lengths of the decode requests


@dataclass
class ModelRunnerOutput:
    """Sampled tokens for the requests that reached the end of their known tokens this step.

    Requests in the middle of a chunked prefill are absent from `sampled_token_ids`.
    """

    sampled_token_ids: dict[str, list[int]]
    # Per request: (token_ids rows, logprobs rows, ranks), one row per sampled token.
    logprobs: dict[str, tuple[list[list[int]], list[list[float]], list[int]]] = field(default_factory=dict)
    # Per request asking for prompt logprobs: those of the prompt positions this step computed
    # (engine.protocol.PromptLogprobsLists), present for prefill chunks that sampled nothing too.
    prompt_logprobs: dict[str, Any] = field(default_factory=dict)
    timing: StepTiming | None = None
    # KV connector results (None without a connector): requests done sending or receiving,
    # loads that failed (a subset of finished_recving), and transfer counters since last step.
    finished_sending: set[str] | None = None
    finished_recving: set[str] | None = None
    failed_recving: set[str] | None = None
    kv_stats: Any = None
