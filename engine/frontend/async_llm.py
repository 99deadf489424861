"""The asyncio engine the server uses: `async for output in engine.generate(...)`.

One task reads the EngineCore's outputs, runs them through the OutputProcessor in one pass, and
hands each request's RequestOutput to that request's collector. A collector holds at most one
pending output: if its consumer is slower than the engine, new deltas merge into the pending one
instead of queueing without bound. Cancelling a generate() (a client that went away) aborts the
request in the core, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, AsyncGenerator, Callable

from pdserve.engine.config import EngineArgs, EngineConfig
from pdserve.engine.core.liveness import RankLiveness, pod_unresponsive_reason
from pdserve.engine.frontend.input_processor import InputProcessor, PromptType
from pdserve.engine.frontend.limits import RequestLimits
from pdserve.engine.frontend.dp_client import DPAsyncMPClient, make_async_client
from pdserve.engine.frontend.mp_client import AsyncMPClient, EngineDeadError
from pdserve.engine.frontend.output_processor import IterationStats, OutputProcessor, ParentRequest
from pdserve.engine.frontend.tokenizer import load_tokenizer
from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.engine.protocol import SchedulerStats
from pdserve.engine.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger("pdserve.engine.async_llm")

# Called after every batch of outputs with the core's scheduler stats, the frontend's latencies,
# and the index of the engine core (data-parallel rank) the batch came from.
StatsListener = Callable[[SchedulerStats | None, IterationStats, int], None]


class RequestOutputCollector:
    def __init__(self, kind: RequestOutputKind) -> None:
        self.kind = kind
        self.pending: RequestOutput | Exception | None = None
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | Exception) -> None:
        if self.pending is None or isinstance(item, Exception) or isinstance(self.pending, Exception):
            self.pending = item
        elif self.kind == RequestOutputKind.DELTA:
            self.pending = _merge_deltas(self.pending, item)
        else:
            self.pending = item  # cumulative outputs supersede each other
        self.ready.set()

    async def get(self) -> RequestOutput:
        while self.pending is None:
            await self.ready.wait()
        item, self.pending = self.pending, None
        self.ready.clear()
        if isinstance(item, Exception):
            raise item
        return item


def _merge_deltas(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    by_index: dict[int, CompletionOutput] = {c.index: c for c in older.outputs}
    for c in newer.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            by_index[c.index] = c
            continue
        logprobs = None if prev.logprobs is None and c.logprobs is None else (prev.logprobs or []) + (c.logprobs or [])
        by_index[c.index] = CompletionOutput(c.index, prev.text + c.text, prev.token_ids + c.token_ids,
                                             c.cumulative_logprob, logprobs, c.finish_reason, c.stop_reason)
    return replace(newer, outputs=[by_index[i] for i in sorted(by_index)])


def start_with_tokenizer(config: EngineConfig) -> tuple["AsyncMPClient | DPAsyncMPClient", Any]:
    """The engine core client, started, and the tokenizer. The tokenizer loads on a thread while
    the core process starts (its imports and the model's load run there): most of a tokenizer's
    load is transformers' imports, and overlapping them saves about a second of every start
    on a machine with a free core. A tokenizer that fails to load stops the started core."""
    with ThreadPoolExecutor(1, thread_name_prefix="tokenizer") as pool:
        loading = pool.submit(load_tokenizer, config.model.tokenizer)
        client = make_async_client(config)
        try:
            return client, loading.result()
        except BaseException:
            client.shutdown()
            raise


class AsyncLLM:
    def __init__(self, config: EngineConfig, client: "AsyncMPClient | DPAsyncMPClient | None" = None,
                 limits: RequestLimits | None = None) -> None:
        self.config = config
        self.limits = limits or RequestLimits()
        if client is None:
            self.client, self.tokenizer = start_with_tokenizer(config)
        else:
            self.client, self.tokenizer = client, load_tokenizer(config.model.tokenizer)
        self.input_processor = InputProcessor(config.model, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        if config.num_kv_blocks:  # known once the core's READY arrived
            self.input_processor.kv_capacity_tokens = config.num_kv_blocks * config.cache.block_size
        self.collectors: dict[str, RequestOutputCollector] = {}
        self.stats_listeners: list[StatsListener] = []
        self.last_scheduler_stats: SchedulerStats | None = None
        self._handler: asyncio.Task | None = None
        self.dead_error: Exception | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, limits: RequestLimits | None = None) -> "AsyncLLM":
        return cls(args.create_engine_config(), limits=limits)

    @property
    def model_name(self) -> str:
        return self.config.model.served_model_name

    @property
    def errored(self) -> bool:
        return self.dead_error is not None or self.client.dead

    @property
    def num_waiting_requests(self) -> int:
        """Core requests submitted and not yet running. The running count comes with the core's
        latest step, so until the next one arrives, just-admitted requests still count."""
        stats = self.last_scheduler_stats
        return max(0, len(self.output_processor.states) - (stats.num_running_reqs if stats else 0))

    # -- requests -------------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *, priority: int = 0,
                          kv_transfer_params: dict[str, Any] | None = None,
                          dp_rank: int | None = None) -> RequestOutputCollector:
        """Validate and submit. Raises ValueError for bad input and EngineDeadError if the core is gone.

        `dp_rank` puts the request (all its `n` children) on that data-parallel rank instead of
        the pod's own balancer pick."""
        if self.errored:
            raise EngineDeadError(str(self.dead_error or self.client.dead_reason))
        if request_id in self.collectors:
            raise ValueError(f"request id {request_id!r} is already in use")
        if dp_rank is not None and not 0 <= dp_rank < self.config.parallel.data_parallel_size:
            raise ValueError(f"no data-parallel rank {dp_rank} (this engine has "
                             f"{self.config.parallel.data_parallel_size})")
        self.limits.check_sampling(params)
        # No await from here until the request is registered, so concurrent calls count each other.
        self.limits.check_waiting(self.num_waiting_requests)
        self._ensure_handler()
        if params.n == 1:
            children = [(self.input_processor.process(request_id, prompt, params, priority=priority,
                                                      kv_transfer_params=kv_transfer_params), None, 0)]
        else:
            parent = ParentRequest(request_id, params)
            children = [(self.input_processor.process(parent.child_id(i), prompt, parent.child_params(params, i),
                                                      priority=priority), parent, i) for i in range(params.n)]
        collector = RequestOutputCollector(params.output_kind)
        self.collectors[request_id] = collector
        try:
            for (text, core_request), parent, index in children:
                core_request.data_parallel_rank = dp_rank
                self.output_processor.add_request(core_request, text, parent, index)
                await self.client.add_request_async(core_request)
        except BaseException:
            await self.abort(request_id)
            raise
        return collector

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, *,
                       priority: int = 0, kv_transfer_params: dict[str, Any] | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        collector = await self.add_request(request_id, prompt, sampling_params, priority=priority,
                                           kv_transfer_params=kv_transfer_params)
        finished = False
        try:
            while not finished:
                output = await collector.get()
                finished = output.finished
                yield output
        finally:
            # Cancelled (client disconnect) or abandoned: free the request's blocks in the core.
            if not finished:
                await asyncio.shield(self.abort(request_id))

    async def abort(self, request_id: str) -> None:
        self.collectors.pop(request_id, None)
        core_ids = self.output_processor.abort_requests([request_id])
        if core_ids and not self.client.dead:
            try:
                await self.client.abort_requests_async(core_ids)
            except EngineDeadError:
                pass

    # -- the output loop ------------------------------------------------------------------------

    def _ensure_handler(self) -> None:
        if self._handler is None or self._handler.done():
            self._handler = asyncio.get_running_loop().create_task(self._handle_outputs(), name="output-handler")

    async def _handle_outputs(self) -> None:
        try:
            while True:
                outputs = await self.client.get_output_async()
                processed = self.output_processor.process_outputs(outputs.outputs)
                for output in processed.request_outputs:
                    collector = self.collectors.get(output.request_id)
                    if collector is not None:
                        collector.put(output)
                        if output.finished:
                            del self.collectors[output.request_id]
                if processed.reqs_to_abort:
                    await self.client.abort_requests_async(processed.reqs_to_abort)
                if outputs.scheduler_stats is not None:
                    self.last_scheduler_stats = outputs.scheduler_stats
                iteration = self.output_processor.take_stats()
                for listener in self.stats_listeners:
                    listener(outputs.scheduler_stats, iteration, outputs.engine_index)
        except EngineDeadError as exc:
            self._fail_everything(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave requests waiting forever
            log.exception("output handler failed")
            self._fail_everything(EngineDeadError(f"output handler failed: {exc}"))

    def _fail_everything(self, error: Exception) -> None:
        self.dead_error = error
        for collector in self.collectors.values():
            collector.put(error)
        self.collectors.clear()

    # -- engine-wide calls ----------------------------------------------------------------------

    async def check_health(self) -> None:
        if self.errored:
            raise EngineDeadError(str(self.dead_error or self.client.dead_reason))

    def liveness(self) -> list[RankLiveness]:
        """Each engine core's progress from its heartbeats; empty once the engine is dead. Call it
        on the event loop: the first call starts reading the cores' outputs."""
        if self.errored:
            return []
        self._ensure_handler()
        return self.client.check_liveness()

    def unresponsive_reason(self) -> str | None:
        """Why the engine is unresponsive (a core stopped, or a step past the step timeout), or None."""
        return pod_unresponsive_reason(self.liveness())

    async def get_stats(self) -> dict[str, Any]:
        return await self.client.call_utility_async("get_stats")

    async def reset_prefix_cache(self) -> bool:
        return await self.client.call_utility_async("reset_prefix_cache")

    async def release_kv_hold(self, engine_id: str, request_id: str, prompt_digest: str,
                              timeout: float = 10.0) -> bool:
        """Free a finished prefill's KV kept for a decode leg that will not come (the router's
        POST /v1/kv/release). A data-parallel pod asks each rank: only the one whose engine id the
        params name holds it. True when it was held for that prompt."""
        clients = self.client.clients if isinstance(self.client, DPAsyncMPClient) else [self.client]
        results = await asyncio.gather(*(c.call_utility_async("release_kv_hold", engine_id, request_id,
                                                              prompt_digest, timeout=timeout) for c in clients))
        return any(results)

    def shutdown(self) -> None:
        if self._handler is not None and not self._handler.done():
            self._handler.cancel()
        self.client.shutdown()
