"""The EngineCore's view of one request: tokens, progress, blocks' hashes and status."""

from __future__ import annotations

import enum
import time
from typing import Any, Callable

from pdserve.engine.protocol import EngineCoreRequest, FinishReason
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured_output.request_state import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_GRAMMAR = 1  # its structured-output grammar is still compiling
    WAITING_FOR_REMOTE_KVS = 2
    RUNNING = 3
    PREEMPTED = 4
    # Everything after this is finished.
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        priority: int = 0,
        kv_transfer_params: dict[str, Any] | None = None,
        cache_salt: str | None = None,
        client_index: int = 0,
        block_hasher: Callable[["Request"], list[bytes]] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.priority = priority
        self.kv_transfer_params = kv_transfer_params
        self.cache_salt = cache_salt
        self.client_index = client_index

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit on first schedule; -1 until then
        self.num_preemptions = 0
        self.kv_load_failed = False  # a KV connector load failed once: compute the prompt here
        self.max_tokens = sampling_params.max_tokens
        self.stop_token_ids = sampling_params.all_stop_token_ids
        # The grammar its output must follow. A P/D prefill leg (do_remote_decode) has none: its
        # one sampled token is discarded, and the decode engine constrains from the first token.
        self.structured_output: StructuredOutputRequest | None = None
        so_params = sampling_params.structured_outputs
        if so_params is not None and not (kv_transfer_params or {}).get("do_remote_decode"):
            self.structured_output = StructuredOutputRequest(so_params)

        # Hashes of this request's full blocks, extended as tokens arrive (see kv_cache_utils).
        self._block_hasher = block_hasher
        self.block_hashes: list[bytes] = []
        self._update_block_hashes()

    @classmethod
    def from_engine_core_request(
        cls, req: EngineCoreRequest, block_hasher: Callable[["Request"], list[bytes]] | None
    ) -> "Request":
        return cls(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            eos_token_id=req.eos_token_id,
            arrival_time=req.arrival_time,
            priority=req.priority,
            kv_transfer_params=req.kv_transfer_params,
            cache_salt=req.cache_salt,
            client_index=req.client_index,
            block_hasher=block_hasher,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
