"""One tensor-parallel rank: its device, its slice of the model, its KV cache."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pdserve.engine.distributed import destroy_tensor_parallel, init_tensor_parallel
from pdserve.engine.malloc_tuning import tune_malloc
from pdserve.engine.worker.kv_memory import mem_available
from pdserve.engine.worker.model_runner import ModelRunner

log = logging.getLogger("pdserve.engine.worker")

CPU_KV_CACHE_DEFAULT_BYTES = 4 << 30


def available_memory_bytes() -> int:
    available = mem_available()
    return 8 << 30 if available is None else available


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None) -> None:
        self.config = config
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.device = torch.device("cpu")
        self.runner: ModelRunner | None = None

    def init_device(self) -> None:
        mc = self.config.model
        if mc.device.startswith("cuda"):
            # Data-parallel rank d's TP workers take the GPUs after rank d-1's.
            index = self.config.parallel.data_parallel_rank * self.config.parallel.tensor_parallel_size + self.rank
            self.device = torch.device("cuda", index % max(torch.cuda.device_count(), 1))
            torch.cuda.set_device(self.device)
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
            tune_malloc()
        tp = self.config.parallel.tensor_parallel_size
        init_tensor_parallel(self.rank, tp, self.distributed_init_method or "", backend)
        # Every rank draws the same random numbers, so unseeded sampling agrees across ranks.
        torch.manual_seed(mc.seed)
        self.runner = ModelRunner(self.config, self.device)

    def load_model(self) -> None:
        assert self.runner is not None
        self.runner.load_model(progress=self.rank == 0 and os.environ.get("PDSERVE_PROGRESS", "0") == "1")

    def determine_num_kv_blocks(self) -> int:
        assert self.runner is not None
        cache, sched = self.config.cache, self.config.scheduler
        if cache.num_kv_blocks:
            return cache.num_kv_blocks
        per_block = self.runner.kv_bytes_per_block()
        # Never more than every sequence slot could use at full context length.
        enough = sched.max_num_seqs * self.runner.max_blocks_per_req
        if self.device.type == "cuda":
            budget = self._cuda_kv_budget()
        else:
            budget = cache.kv_cache_memory_bytes or min(CPU_KV_CACHE_DEFAULT_BYTES, int(0.3 * available_memory_bytes()))
        blocks = min(enough, budget // per_block)
        if blocks < 1:
            raise RuntimeError(f"no memory left for the KV cache (a block needs {per_block} bytes, budget {budget})")
        return int(blocks)

    def _cuda_kv_budget(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free
        # Leave room for activations at the largest step the scheduler can build.
        activations = 64 * self.config.scheduler.max_num_batched_tokens * self.config.model.hidden_size * 4
        return int(total * self.config.cache.gpu_memory_utilization) - used_by_others - activations

    def initialize_kv_cache(self, num_blocks: int) -> dict[str, Any] | None:
        assert self.runner is not None
        info = self.runner.initialize_kv_cache(num_blocks)
        self.runner.capture_decode_graphs()  # needs the cache: the captured steps read and write it
        return info

    def warm_kv_cache(self, seconds: float) -> float:
        """Map this rank's KV cache pages ahead of use for up to `seconds`; the fraction mapped."""
        assert self.runner is not None
        return self.runner.kv_warmer.run(seconds)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        assert self.runner is not None
        output = self.runner.execute_model(scheduler_output)
        if self.rank == 0:
            return output
        if self.runner.connector is not None:  # the executor joins every rank's KV transfer reports
            return ModelRunnerOutput({}, finished_sending=output.finished_sending,
                                     finished_recving=output.finished_recving,
                                     failed_recving=output.failed_recving, kv_stats=output.kv_stats)
        return None

    def weight_bytes(self) -> int:
        """Bytes this rank's weights take (int8 ones at their stored size)."""
        from pdserve.engine.model.quant import weight_bytes

        return weight_bytes(self.runner.model)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, method)(*args, **kwargs)

    def shutdown(self) -> None:
        if self.runner is not None and self.runner.connector is not None:
            self.runner.connector.shutdown()
        destroy_tensor_parallel()
