"""One data-parallel rank of a lock-step pod (`pdserve serve --data-parallel-lockstep`).

It is an EngineCoreProc whose busy loop follows the wave protocol (engine/core/dp_wave.py):
while a wave runs it steps every iteration, a dummy step when it has nothing of its own, and
every SYNC_INTERVAL steps it all-reduces with the other ranks whether any is still busy. Ranks
without lock-step need none of this: they are plain EngineCoreProcs that differ only in their
rank and engine id.

Messages with the frontend's wave coordinator (engine/frontend/dp_client.py) ride on the usual
sockets: START_DP_WAVE requests in, `start_wave` / `wave_complete` fields on outputs out.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.core.dp_wave import DPGroup, RankWave
from pdserve.engine.core.engine_core_proc import DEFAULT_DRAIN_SECONDS, EngineCoreProc
from pdserve.engine.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from pdserve.engine.protocol import EngineCoreOutputs, EngineCoreRequestType
from pdserve.engine.sampling_params import SamplingParams

log = logging.getLogger("pdserve.engine.dp_core_proc")

DUMMY_REQUEST_ID = "__pdserve_dp_dummy__"
# Idle ranks send their counters to the frontend this often while they run dummy steps.
DUMMY_STATS_EVERY = 8


class DummyBatch:
    """A one-token forward through the real model and workers, on a KV block kept for it alone."""

    def __init__(self, config: EngineConfig, pool: Any) -> None:
        # Reserved for the life of the engine: the dummy token's KV lands here, never in a
        # block a request or the prefix cache owns.
        self.block_id = pool.get_new_blocks(1)[0].block_id
        self.params = SamplingParams(temperature=0.0, max_tokens=1)

    def scheduler_output(self) -> SchedulerOutput:
        # Listed as finished too, so the runner drops the previous step's dummy before adding this one.
        new = NewRequestData(DUMMY_REQUEST_ID, [0], 1, self.params, [self.block_id], 0)
        return SchedulerOutput([new], CachedRequestData(), {DUMMY_REQUEST_ID: 1}, 1, {DUMMY_REQUEST_ID})


class DPEngineCoreProc(EngineCoreProc):
    def __init__(self, config: EngineConfig, handshake_address: str, engine_index: int = 0,
                 drain_seconds: float = DEFAULT_DRAIN_SECONDS) -> None:
        parallel = config.parallel
        if not parallel.data_parallel_init_method:
            raise ValueError("a lock-step data-parallel rank needs parallel.data_parallel_init_method")
        self.dp_rank = parallel.data_parallel_rank
        self.wave = RankWave()
        super().__init__(config, handshake_address, engine_index, drain_seconds)
        self.dummy = DummyBatch(config, self.core.scheduler.kv_cache_manager.pool)
        # Every rank blocks here until all have loaded their models: a wave needs them all.
        self.group = DPGroup(self.dp_rank, parallel.data_parallel_size, parallel.data_parallel_init_method)

    # -- inputs -------------------------------------------------------------------------------

    def _handle_input(self, kind: bytes, payload: Any) -> bool:
        if kind == EngineCoreRequestType.START_DP_WAVE.value:
            if self.wave.start(payload):
                log.debug("rank %d joins wave %d", self.dp_rank, payload)
            return False
        changed = super()._handle_input(kind, payload)
        if kind == EngineCoreRequestType.ADD.value and not self.wave.running and self.core.has_unfinished_requests():
            # A request reached a paused rank: start the next wave here, and have the others join.
            self.wave.start(self.wave.wave)
            log.debug("rank %d starts wave %d", self.dp_rank, self.wave.wave)
            self.output_queue.put(EngineCoreOutputs(start_wave=self.wave.wave))
        return changed

    # -- the busy loop ------------------------------------------------------------------------

    def _stats(self):
        stats = self.core.scheduler.make_stats()
        w = self.wave
        stats.dp_wave, stats.dp_steps, stats.dp_dummy_steps = w.wave, w.steps, w.dummy_steps
        stats.dp_step_seconds, stats.dp_dummy_seconds = w.step_seconds, w.dummy_seconds
        return stats

    def run_busy_loop(self) -> None:
        while True:
            if self.thread_failure is not None:
                self.core.executor.check_health()
                raise RuntimeError("the engine cannot continue") from self.thread_failure
            paused_and_idle = not self.wave.running and not self.core.has_work()
            if self.drain_deadline is not None:
                if paused_and_idle:
                    return
                if time.monotonic() >= self.drain_deadline and self.core.has_unfinished_requests():
                    # Out of time: abort, then keep stepping with the others until the wave ends.
                    self._abort_everything("the engine is shutting down")
            if self.reporter is not None:
                self.reporter.wave = self.wave.wave
                self.reporter.maybe_report(self.core.scheduler)
            changed = self._drain_inputs(block=not self.wave.running and not self.core.has_work())
            if not self.wave.running:
                # Paused: only leftovers (KV transfers of finished prefills) may need polling.
                if self.core.has_work() and not self.core.has_unfinished_requests():
                    outputs, _ = self.core.step()
                    if outputs.outputs:
                        self.output_queue.put(outputs)
                elif changed:
                    self.output_queue.put(EngineCoreOutputs(scheduler_stats=self._stats(), timestamp=time.time()))
                continue
            self._wave_step()

    def _wave_step(self) -> None:
        # Timed like a plain core's step, so a rank stuck inside one (or in the wave's collective,
        # waiting on a frozen peer) turns /health 503 and stops vouching for itself.
        self.step_clock.begin()
        try:
            self._wave_step_body()
        finally:
            self.step_clock.end()

    def _wave_step_body(self) -> None:
        started = time.perf_counter()
        dummy = not self.core.has_unfinished_requests()
        if dummy:
            self.core.executor.execute_model(self.dummy.scheduler_output())
            if self.core.has_work():  # KV transfers still in flight: let the scheduler follow them
                outputs, _ = self.core.step()
                if outputs.outputs:
                    self.output_queue.put(outputs)
        else:
            outputs, _ = self.core.step()
            outputs.scheduler_stats = self._stats()
            self.output_queue.put(outputs)
        sync = self.wave.count_step(dummy, time.perf_counter() - started)
        if dummy and self.wave.dummy_steps % DUMMY_STATS_EVERY == 0:
            self.output_queue.put(EngineCoreOutputs(scheduler_stats=self._stats(), timestamp=time.time()))
        if sync and not self.group.any_busy(self.core.has_work()):
            done = self.wave.finish()
            log.debug("rank %d: wave %d complete after %d steps", self.dp_rank, done, self.wave.steps)
            self.output_queue.put(EngineCoreOutputs(scheduler_stats=self._stats(), timestamp=time.time(),
                                                    wave_complete=done if self.dp_rank == 0 else None))
