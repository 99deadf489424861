"""The worker runs inside the EngineCore's own process (tensor_parallel_size == 1)."""

from __future__ import annotations

from typing import Any

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.executor.abstract import Executor
from pdserve.engine.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        if config.parallel.cpu_cores is not None:
            from pdserve.engine.executor.multiproc import worker_threads

            threads = worker_threads(1, config.parallel.cpu_cores)
            if threads is not None:
                torch.set_num_threads(threads)
        self.worker = Worker(config, rank=0)
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None) -> Any:
        result = self.worker.call(method, *args, **(kwargs or {}))
        return result if unique_reply_rank is not None else [result]

    def shutdown(self) -> None:
        self.worker.shutdown()
