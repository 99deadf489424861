"""What the EngineCore needs from whatever runs the workers."""

from __future__ import annotations

import abc
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.engine.core.sched_output import ModelRunnerOutput, SchedulerOutput


class Executor(abc.ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None) -> Any:
        """Call `method` on every worker; return every reply, or only `unique_reply_rank`'s."""

    def determine_num_kv_blocks(self) -> int:
        # Every rank must fit the cache: take the smallest.
        return min(self.collective_rpc("determine_num_kv_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,), unique_reply_rank=0)

    def check_health(self) -> None:
        """Raise if a worker is gone."""

    def register_failure_callback(self, callback) -> None:
        """Call `callback` as soon as a worker dies. Workers in-process cannot die alone: no-op."""

    @abc.abstractmethod
    def shutdown(self) -> None: ...


def executor_class_for(config: EngineConfig) -> type[Executor]:
    if config.parallel.tensor_parallel_size == 1:
        from pdserve.engine.executor.uniproc import UniProcExecutor

        return UniProcExecutor
    from pdserve.engine.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor
