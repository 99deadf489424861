"""The EngineCore: one scheduler, one executor, and the step that joins them.

`step()` is schedule → execute → update. The multi-process EngineCoreProc wraps this same object
in a busy loop with ZMQ threads; the offline LLM calls it directly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from pdserve.engine.config import EngineConfig
from pdserve.engine.core.kv_cache_utils import make_block_hasher
from pdserve.engine.core.sched_output import StepTiming
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.executor.abstract import Executor, executor_class_for
from pdserve.engine.protocol import EngineCoreOutputs, EngineCoreRequest
from pdserve.engine.request import Request, RequestStatus
from pdserve.kvstore.base import KVConnectorRole
from pdserve.kvstore.factory import create_connector

log = logging.getLogger("pdserve.engine.core")
# With only KV transfers in flight, a step computes nothing: poll them at this pace, not a spin.
KV_POLL_INTERVAL_S = 0.002
# With only grammars compiling, a step waits at most this long for one to finish rather than
# spin; a compile that ends wakes it at once. Short, so new requests are not kept waiting.
GRAMMAR_POLL_INTERVAL_S = 0.002


@dataclass
class StepRecord:
    """perf_counter stamps of one step: start → scheduled → executed → updated."""

    start: float
    scheduled: float
    executed: float
    updated: float
    timing: StepTiming | None


def check_kv_capacity(config: EngineConfig, num_blocks: int) -> None:
    """Refuse a KV cache that cannot hold one sequence of max_model_len tokens: such an engine
    would accept long requests only to abort them (or preempt them forever)."""
    capacity = num_blocks * config.cache.block_size
    max_model_len = config.model.max_model_len
    if capacity < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks of {config.cache.block_size} = {capacity} tokens, fewer than "
            f"one sequence of max_model_len {max_model_len} tokens; lower --max-model-len to at most {capacity}, "
            f"or give the cache more room (--num-kv-blocks, --kv-cache-memory-bytes on CPU, "
            f"--gpu-memory-utilization on GPU)")


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        self.config = config
        start = time.perf_counter()
        self.executor = (executor_class or executor_class_for(config))(config)
        num_blocks = self.executor.determine_num_kv_blocks()
        try:
            check_kv_capacity(config, num_blocks)
        except ValueError:
            self.executor.shutdown()
            raise
        worker_infos = self.executor.initialize_kv_cache(num_blocks)
        config.num_kv_blocks = num_blocks
        self.connector = create_connector(config, KVConnectorRole.SCHEDULER)
        if self.connector is not None:
            self.connector.set_worker_info(worker_infos)
        self.scheduler = Scheduler(config, num_blocks, self.connector)
        self.warm_kv_cache(0.0)  # one chunk, and how far there is to go (nothing on a GPU)
        # Block hashes key the prefix cache, and the KV store connectors' blocks.
        self.block_hasher = make_block_hasher(config.cache.block_size) \
            if config.cache.enable_prefix_caching or config.kv_transfer else None
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
        if not self.has_work():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats(), timestamp=time.time()), False
        if not self.scheduler.has_ready_requests and not self._has_kv_transfers():
            # Only grammars compiling. Running requests never get here: they never wait on a compile.
            self.scheduler.structured_output.wait_for_compile(GRAMMAR_POLL_INTERVAL_S)
            if not self.scheduler.has_ready_requests:
                return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats(), timestamp=time.time()), False
        start = time.perf_counter()
        # The connector's word for the workers, looked at before schedule() hands it over.
        connector_pending = self.connector is not None and self.connector.has_pending_work()
        sched_output = self.scheduler.schedule()
        if sched_output.total_num_scheduled_tokens == 0:
            if not (connector_pending or self.scheduler.has_kv_transfers):
                return EngineCoreOutputs(outputs=self.scheduler.take_finished_outside_step(),
                                         scheduler_stats=self.scheduler.make_stats(), timestamp=time.time()), False
            # Nothing to compute, but the workers must report transfers (and receive the
            # metadata that registers them).
            time.sleep(KV_POLL_INTERVAL_S)
            outputs = self.scheduler.update_from_output(sched_output, self.executor.execute_model(sched_output))
            return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.scheduler.make_stats(),
                                     timestamp=time.time()), False
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

    def warm_kv_cache(self, seconds: float) -> bool:
        """Map the KV cache's pages ahead of their first write for up to `seconds` (an idle
        engine's use of its time: worker/kv_memory.py); whether some are left."""
        self.scheduler.kv_cache_mapped = self.executor.warm_kv_cache(seconds)
        return self.scheduler.kv_cache_mapped < 1.0

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    def has_work(self) -> bool:
        """Requests to run (or whose grammar compiles), or KV transfers to follow (blocks held for a
        remote decode)."""
        return self.scheduler.has_unfinished_requests or self._has_kv_transfers()

    def _has_kv_transfers(self) -> bool:
        # The connector may have word for the workers with nothing else to do (a release, or an
        # aborted request's lease to drop): a step must carry it, also on an idle engine.
        return self.scheduler.has_kv_transfers or (self.connector is not None and self.connector.has_pending_work())

    # -- utility calls (reachable over the wire as UTILITY requests) ---------------------------

    def get_stats(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self.scheduler.make_stats())

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def ping(self) -> str:
        return "pong"

    def release_kv_hold(self, engine_id: str, request_id: str, prompt_digest: str) -> bool:
        """The router says nobody will pull this finished prefill's KV: free its held blocks (on
        every TP rank) with the next step rather than at the end of their lease. True when this
        engine (`engine_id`: a data-parallel pod's ranks each have their own) holds them for that
        prompt."""
        request = self.scheduler.held_for_send.get(request_id)
        if engine_id != self.config.engine_id or request is None or self.connector is None:
            return False
        return self.connector.release_held(request, prompt_digest)

    def shutdown(self) -> None:
        self.scheduler.structured_output.shutdown()
        if self.connector is not None:
            self.connector.shutdown()
        self.executor.shutdown()
