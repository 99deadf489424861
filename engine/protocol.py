"""Messages between the frontend and the EngineCore.

The same structs travel in-process (InprocClient) and over ZMQ as msgpack (array_like keeps the
encoding compact: fields by position, no names on the wire).
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from pdserve.engine.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token or a stop string
    LENGTH = 1  # max_tokens or the model's context length
    ABORT = 2  # cancelled by the client or the engine

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    # Set by the P/D router: where to pull KV from, or a request to keep KV for a remote decode.
    kv_transfer_params: dict[str, Any] | None = None
    # Mixed into the first block's hash so tenants can opt out of sharing a prefix cache.
    cache_salt: str | None = None
    client_index: int = 0
    # The data-parallel rank a router pinned the request to (a DP pod's client reads it; cores ignore it).
    data_parallel_rank: int | None = None


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of the tokens sampled in one step: row i belongs to one generated token.

    Column 0 holds the sampled token; the rest hold the top-k tokens in descending order.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]  # rank of the sampled token among all tokens (1 = most likely)


class PromptLogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of the prompt tokens one step computed: row i is prompt position first_position + i.

    Laid out as LogprobsLists (column 0: the prompt's own token, then the top-k). The first prompt
    position has no logprob, so first_position is at least 1. A request recomputed after a
    preemption may send positions again; the frontend keeps the first copy.
    """

    first_position: int
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    # Asked for with SamplingParams.prompt_logprobs: the prompt positions computed this step. A
    # prefill chunk that samples nothing still sends an output carrying only these.
    prompt_logprobs: PromptLogprobsLists | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    kv_cache_mapped: float = 0.0  # the fraction of the KV cache's memory mapped ahead of first use (1: all)
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    prefix_cache_queries: int = 0  # tokens looked up, cumulative
    prefix_cache_hits: int = 0  # tokens found, cumulative
    num_preemptions: int = 0  # cumulative
    step_counter: int = 0
    num_prompt_tokens: int = 0  # cumulative, computed
    num_generation_tokens: int = 0  # cumulative
    # Disaggregated prefill/decode (zero without a KV connector).
    num_waiting_for_remote_kvs: int = 0
    kv_blocks_held_for_remote: int = 0  # finished prefills' blocks kept until the decode side pulls them
    prompt_tokens_computed: int = 0  # cumulative: prompt tokens this engine ran through the model
    kv_external_tokens: int = 0  # cumulative: prompt tokens loaded through the connector
    kv_transfers: int = 0  # cumulative, both directions
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_failures: int = 0
    kv_transfers_expired: int = 0  # held blocks freed by the abort timeout
    # Lock-step data parallelism (zero otherwise): the rank's wave, and its steps inside waves.
    dp_wave: int = 0
    dp_steps: int = 0  # cumulative: every step taken while a wave ran, dummy ones included
    dp_dummy_steps: int = 0  # cumulative: steps run only to keep pace with busy ranks
    dp_step_seconds: float = 0.0  # cumulative time of those steps
    dp_dummy_seconds: float = 0.0
    # Cumulative: a decode side's renewals of prefill engines' KV leases that failed (p2p).
    kv_lease_renewal_failures: int = 0


class UtilityOutput(msgspec.Struct, array_like=True, gc=False):
    call_id: int
    result: Any = None
    failure_message: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    outputs: list[EngineCoreOutput] = []
    engine_index: int = 0
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    # Requests the core finished on its own without emitting an output for them (e.g. aborted).
    finished_requests: list[str] | None = None
    # Lock-step data parallelism: a paused rank got a request and started this wave; rank 0
    # found every rank idle and ended this wave.
    start_wave: int | None = None
    wave_complete: int | None = None


class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of every frontend → core message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    WAKEUP = b"\x03"
    START_DP_WAVE = b"\x04"  # lock-step data parallelism: start this wave (payload: the wave number)
