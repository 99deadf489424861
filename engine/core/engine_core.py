"""The EngineCore: one scheduler, one executor, and the step that joins them.

`step()` is schedule → execute → update. The multi-process EngineCoreProc wraps this same object
in a busy loop with ZMQ threads; the offline LLM calls it directly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.core.kv_cache_utils import make_block_hasher
from pdserve.engine.core.sched_output import StepTiming
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.executor.abstract import Executor, executor_class_for
from pdserve.engine.protocol import EngineCoreOutputs, EngineCoreRequest
from pdserve.engine.request import Request, RequestStatus

log = logging.getLogger("pdserve.engine.core")


@dataclass
class StepRecord:
    """perf_counter stamps of one step: start → scheduled → executed → updated."""

    start: float
    scheduled: float
    executed: float
    updated: float
    timing: StepTiming | None


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        self.config = config
        start = time.perf_counter()
        self.executor = (executor_class or executor_class_for(config))(config)
        num_blocks = self.executor.determine_num_kv_blocks()
        self.executor.initialize_kv_cache(num_blocks)
        config.num_kv_blocks = num_blocks
        self.scheduler = Scheduler(config, num_blocks)
        self.block_hasher = make_block_hasher(config.cache.block_size) if config.cache.enable_prefix_caching else None
        # Per-step timings, kept only when a benchmark asks (record_steps()).
        self.step_records: list[StepRecord] | None = None
        log.info("engine core ready: %d KV blocks of %d tokens, %.1fs", num_blocks, config.cache.block_size,
                 time.perf_counter() - start)

    def validate_request(self, req: EngineCoreRequest) -> None:
        """Reject what would break the engine; the frontend checks first, with friendlier messages."""
        mc = self.config.model
        if not req.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(req.prompt_token_ids) >= mc.max_model_len:
            raise ValueError(f"the prompt has {len(req.prompt_token_ids)} tokens; this model's maximum context "
                             f"length is {mc.max_model_len} tokens, and at least one must be left to generate")
        if min(req.prompt_token_ids) < 0 or max(req.prompt_token_ids) >= mc.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {mc.vocab_size})")
        # A request that outgrows the whole pool would preempt itself forever: refuse it up front.
        max_tokens = req.sampling_params.max_tokens or mc.max_model_len
        needed = min(len(req.prompt_token_ids) + max_tokens, mc.max_model_len)
        capacity = self.scheduler.kv_cache_manager.num_blocks * self.config.cache.block_size
        if needed > capacity:
            raise ValueError(f"the request may need {needed} tokens of KV cache, but the cache holds {capacity}; "
                             f"lower max_tokens or give the engine more KV blocks")

    def add_request(self, req: EngineCoreRequest) -> None:
        self.validate_request(req)
        self.scheduler.add_request(Request.from_engine_core_request(req, self.block_hasher))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> tuple[EngineCoreOutputs, bool]:
        """Run one step. Returns the outputs and whether the model ran."""
        if not self.scheduler.has_unfinished_requests:
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats(), timestamp=time.time()), False
        start = time.perf_counter()
        sched_output = self.scheduler.schedule()
        if sched_output.total_num_scheduled_tokens == 0:
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats(), timestamp=time.time()), False
        scheduled = time.perf_counter()
        runner_output = self.executor.execute_model(sched_output)
        executed = time.perf_counter()
        outputs = self.scheduler.update_from_output(sched_output, runner_output)
        if self.step_records is not None:
            self.step_records.append(StepRecord(start, scheduled, executed, time.perf_counter(), runner_output.timing))
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.scheduler.make_stats(),
                                 timestamp=time.time()), True

    def record_steps(self, enable: bool = True) -> None:
        self.step_records = [] if enable else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    # -- utility calls (reachable over the wire as UTILITY requests) ---------------------------

    def get_stats(self) -> dict[str, Any]:
        stats = self.scheduler.make_stats()
        return {
            "num_running_reqs": stats.num_running_reqs,
            "num_waiting_reqs": stats.num_waiting_reqs,
            "num_preemptions": stats.num_preemptions,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "kv_blocks_total": stats.kv_blocks_total,
            "kv_blocks_free": stats.kv_blocks_free,
            "kv_cache_usage": stats.kv_cache_usage,
            "num_prompt_tokens": stats.num_prompt_tokens,
            "num_generation_tokens": stats.num_generation_tokens,
            "step_counter": stats.step_counter,
        }

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def ping(self) -> str:
        return "pong"

    def shutdown(self) -> None:
        self.executor.shutdown()
