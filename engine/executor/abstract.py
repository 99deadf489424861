"""What the EngineCore needs from whatever runs the workers."""

from __future__ import annotations

import abc
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.core.sched_output import ModelRunnerOutput, SchedulerOutput


class Executor(abc.ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._kv_aggregator: KVOutputAggregator | None = None

    @abc.abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None) -> Any:
        """Call `method` on every worker; return every reply, or only `unique_reply_rank`'s."""

    def determine_num_kv_blocks(self) -> int:
        # Every rank must fit the cache: take the smallest.
        return min(self.collective_rpc("determine_num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> list[dict[str, Any]]:
        """Allocate every rank's cache; returns what each rank's KV connector reports (rank order)."""
        infos = self.collective_rpc("initialize_kv_cache", (num_blocks,))
        self._kv_aggregator = KVOutputAggregator(len(infos)) if any(i is not None for i in infos) and len(infos) > 1 \
            else None
        return infos

    def warm_kv_cache(self, seconds: float) -> float:
        """Let every rank map its KV cache ahead of use for up to `seconds` (worker/kv_memory.py);
        the fraction mapped on the rank furthest behind."""
        return min(self.collective_rpc("warm_kv_cache", (seconds,)))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        aggregator = self._kv_aggregator
        if aggregator is None:
            return self.collective_rpc("execute_model", (scheduler_output,), unique_reply_rank=0)
        # With a KV connector every rank reports its own transfers; a request is done only when
        # all ranks are done with it.
        return aggregator.merge(self.collective_rpc("execute_model", (scheduler_output,)))

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    def register_failure_callback(self, callback) -> None:
        """Call `callback` as soon as a worker dies. Workers in-process cannot die alone: no-op."""

    @abc.abstractmethod
    def shutdown(self) -> None: ...


class KVOutputAggregator:
    """Joins the ranks' KV connector reports: a transfer is finished once every rank said so."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._sending: dict[str, int] = {}
        self._recving: dict[str, int] = {}
        self._failed: set[str] = set()

    def _count(self, pending: dict[str, int], reported: list[set[str] | None]) -> set[str]:
        done = set()
        for ids in reported:
            for request_id in ids or ():
                pending[request_id] = pending.get(request_id, 0) + 1
                if pending[request_id] == self.world_size:
                    del pending[request_id]
                    done.add(request_id)
        return done

    def merge(self, outputs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
        output = outputs[0]
        output.finished_sending = self._count(self._sending, [o.finished_sending for o in outputs])
        output.finished_recving = self._count(self._recving, [o.finished_recving for o in outputs])
        for o in outputs:
            self._failed |= o.failed_recving or set()
        output.failed_recving = self._failed & output.finished_recving
        self._failed -= output.failed_recving
        for o in outputs[1:]:
            if o.kv_stats is not None:
                if output.kv_stats is None:
                    output.kv_stats = o.kv_stats
                else:
                    output.kv_stats.add(o.kv_stats)
        return output


def executor_class_for(config: EngineConfig) -> type[Executor]:
    if config.parallel.tensor_parallel_size == 1:
        from pdserve.engine.executor.uniproc import UniProcExecutor

        return UniProcExecutor
    from pdserve.engine.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor
