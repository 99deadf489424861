"""The core client of a data-parallel pod: N EngineCore processes behind one API server.

Each rank is a whole engine (scheduler, KV cache, TP workers, KV connector) started through its
own AsyncMPClient. This client puts each new request on one rank (DPBalancer: lowest
`waiting * 4 + running`), remembers which rank holds it so aborts go there, and merges the
ranks' outputs into one stream tagged with `engine_index`. Load comes from the coordinator's
feed when `coordinator_publish_address` is set, and always from this client's in-flight counts.
A request that names its rank (`data_parallel_rank`, from the router's X-PDServe-DP-Rank header:
the router scored the ranks as endpoints of their own) goes to that rank instead.

Lock-step pods (`data_parallel_lockstep`): this client is the wave coordinator of its ranks
(engine/core/dp_wave.py). A rank that starts a wave says so on its outputs; the client then
broadcasts START_DP_WAVE to the other ranks. Rank 0's `wave_complete` pauses the pod's wave.

One dead rank makes the whole client dead: its requests fail with EngineDeadError (503 at the
server), /health turns 503, and the pod is restarted, as with a single engine. One unresponsive
rank (stopped, or stuck in a step) makes /health 503 too, naming the rank; its requests wait.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pdserve.engine.config import EngineConfig
from pdserve.engine.core.dp_wave import WaveCoordinator
from pdserve.engine.core.liveness import RankLiveness
from pdserve.engine.cores import usable_cores
from pdserve.engine.frontend.dp_balance import DPBalancer
from pdserve.engine.frontend.mp_client import AsyncMPClient, EngineDeadError, MPClientBase, next_output
from pdserve.engine.protocol import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType

log = logging.getLogger("pdserve.engine.dp_client")


class _FeedEngine(msgspec.Struct):
    """The part of a coordinator update's engine entry the balancer reads (unknown keys are skipped)."""

    id: str
    waiting: int = 0
    running: int = 0
    stale: bool = False


class _Feed(msgspec.Struct):
    engines: list[_FeedEngine] = []


def rank_engine_id(engine_id: str, rank: int) -> str:
    return f"{engine_id}-dp{rank}"


def _free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_cpu_share(size: int, cores: int) -> int:
    """Cores per rank. Every rank left at one thread per core of the pod oversubscribes the cores
    as soon as two ranks are busy (measured: 900 tokens in 1 s on one busy rank, 15 s each with
    both busy, DP=2 on 2 cores)."""
    return max(1, cores // size)


def rank_configs(config: EngineConfig) -> list[EngineConfig]:
    """One config per rank: its rank, its own engine id (the coordinator lists each rank)."""
    size = config.parallel.data_parallel_size
    init_method = None
    if config.parallel.data_parallel_lockstep:
        init_method = config.parallel.data_parallel_init_method or f"tcp://127.0.0.1:{_free_tcp_port()}"
    configs = []
    share = rank_cpu_share(size, config.parallel.cpu_cores or usable_cores())
    for rank in range(size):
        c = copy.copy(config)
        c.parallel = copy.copy(config.parallel)
        c.parallel.data_parallel_rank = rank
        c.parallel.cpu_cores = share
        c.parallel.data_parallel_init_method = init_method
        c.engine_id = rank_engine_id(config.engine_id, rank)
        configs.append(c)
    return configs


def make_async_client(config: EngineConfig) -> "AsyncMPClient | DPAsyncMPClient":
    if config.parallel.data_parallel_size > 1:
        return DPAsyncMPClient(config)
    return AsyncMPClient(config)


class DPAsyncMPClient:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.size = config.parallel.data_parallel_size
        self.lockstep = config.parallel.data_parallel_lockstep
        self.balancer = DPBalancer(self.size)
        self.waves = WaveCoordinator()
        self.owner: dict[str, int] = {}  # request id -> the rank that holds it
        self.outputs_queue: asyncio.Queue | None = None
        self._tasks: list[asyncio.Task] = []
        self._feed_ctx: zmq.asyncio.Context | None = None
        self._closed = False
        self.clients = self._start_ranks(rank_configs(config))
        # The pod's KV capacity per request is one rank's: requests never span ranks.
        config.num_kv_blocks = min(c.config.num_kv_blocks for c in self.clients)
        self.num_kv_blocks = config.num_kv_blocks
        self._rank_of_id = {rank_engine_id(config.engine_id, r): r for r in range(self.size)}
        log.info("%d data-parallel ranks ready%s", self.size, " (lock-step waves)" if self.lockstep else "")

    def _start_ranks(self, configs: list[EngineConfig]) -> list[AsyncMPClient]:
        # Ranks load their models at the same time (and lock-step ranks wait for each other).
        with ThreadPoolExecutor(max_workers=len(configs), thread_name_prefix="dp-start") as pool:
            futures = [pool.submit(AsyncMPClient, c, rank) for rank, c in enumerate(configs)]
            clients, error = [], None
            for future in futures:
                try:
                    clients.append(future.result())
                except BaseException as exc:  # keep waiting for the others, to shut them down
                    error = error or exc
        if error is not None:
            for client in clients:
                client.shutdown()
            raise error
        return clients

    # -- state the server reads ---------------------------------------------------------------

    @property
    def dead(self) -> bool:
        return any(c.dead for c in self.clients)

    @property
    def dead_reason(self) -> str:
        for rank, client in enumerate(self.clients):
            if client.dead:
                return f"data-parallel rank {rank}: {client.dead_reason}"
        return ""

    def check_liveness(self) -> list[RankLiveness]:
        """Every rank's progress; the server calls the pod unresponsive when any rank is."""
        self._ensure_tasks()
        return [status for client in self.clients for status in client.check_liveness()]

    # -- requests -----------------------------------------------------------------------------

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._ensure_tasks()
        if self.dead:
            raise EngineDeadError(self.dead_reason)
        pinned = request.data_parallel_rank
        if pinned is not None and not 0 <= pinned < self.size:
            raise ValueError(f"no data-parallel rank {pinned} (this pod has {self.size})")
        # A router that scores ranks as endpoints of their own has already chosen one.
        rank = self.balancer.pick() if pinned is None else self.balancer.assign(pinned)
        self.owner[request.request_id] = rank
        try:
            await self.clients[rank].add_request_async(request)
        except BaseException:
            self._forget([request.request_id])
            raise

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self.owner.get(request_id)
            if rank is not None:
                by_rank.setdefault(rank, []).append(request_id)
        self._forget(request_ids)
        for rank, ids in by_rank.items():
            if not self.clients[rank].dead:
                await self.clients[rank].abort_requests_async(ids)

    def _forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            rank = self.owner.pop(request_id, None)
            if rank is not None:
                self.balancer.finished(rank)

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_tasks()
        assert self.outputs_queue is not None
        return await next_output(self.outputs_queue)

    async def call_utility_async(self, method: str, *args: Any, timeout: float | None = 30.0) -> Any:
        self._ensure_tasks()
        results = await asyncio.gather(*(c.call_utility_async(method, *args, timeout=timeout) for c in self.clients))
        if method == "get_stats":
            return _merge_stats(results)
        if all(isinstance(r, bool) for r in results):
            return all(results)
        return results[0]

    # -- background tasks ---------------------------------------------------------------------

    def _ensure_tasks(self) -> None:
        if self.outputs_queue is not None:
            return
        loop = asyncio.get_running_loop()
        self.outputs_queue = asyncio.Queue()
        self._tasks = [loop.create_task(self._forward(rank), name=f"dp-outputs-{rank}") for rank in range(self.size)]
        if self.config.coordinator_publish_address:
            self._tasks.append(loop.create_task(self._follow_feed(self.config.coordinator_publish_address),
                                                name="dp-feed"))

    async def _forward(self, rank: int) -> None:
        assert self.outputs_queue is not None
        client = self.clients[rank]
        while True:
            try:
                outputs = await client.get_output_async()
            except EngineDeadError as exc:
                self.outputs_queue.put_nowait(EngineDeadError(f"data-parallel rank {rank}: {exc}"))
                return
            outputs.engine_index = rank
            if outputs.start_wave is not None and self.waves.on_start(outputs.start_wave):
                await self._broadcast_start(outputs.start_wave, rank)
            if outputs.wave_complete is not None:
                self.waves.on_complete(outputs.wave_complete)
            finished = [o.request_id for o in outputs.outputs if o.finished] + (outputs.finished_requests or [])
            if finished:
                self._forget(finished)
            if outputs.outputs or outputs.scheduler_stats is not None or outputs.finished_requests:
                self.outputs_queue.put_nowait(outputs)

    async def _broadcast_start(self, wave: int, origin: int) -> None:
        for rank, client in enumerate(self.clients):
            if rank != origin and not client.dead:
                try:
                    await client._send(EngineCoreRequestType.START_DP_WAVE, wave)
                except EngineDeadError:
                    pass  # its forwarder reports the death

    async def _follow_feed(self, address: str) -> None:
        from pdserve.engine import internal_auth
        from pdserve.engine.core.load_reporter import parse_host_port, tcp_endpoint

        self._feed_ctx = zmq.asyncio.Context()
        sub = self._feed_ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        # The coordinator publishes only to holders of the internal key (CURVE).
        internal_auth.secure_client(sub, internal_auth.load_internal_key())
        sub.connect(tcp_endpoint(*parse_host_port(address)))
        decoder = msgspec.msgpack.Decoder(_Feed)
        while True:
            body = await sub.recv()
            try:
                feed = decoder.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.debug("ignoring a malformed coordinator update: %s", exc)
                continue
            for engine in feed.engines:
                rank = self._rank_of_id.get(engine.id)
                if rank is not None and not engine.stale:
                    self.balancer.update_feed(rank, engine.waiting, engine.running)

    # -- shutdown -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        # The ranks drain at the same time rather than one after another.
        for client in self.clients:
            if client._reader is not None and not client._reader.done():
                client._reader.cancel()  # from this thread: the event loop's objects are not thread-safe
        with ThreadPoolExecutor(max_workers=len(self.clients), thread_name_prefix="dp-stop") as pool:
            list(pool.map(MPClientBase.shutdown, self.clients))
        if self._feed_ctx is not None:
            self._feed_ctx.destroy(linger=0)


def _merge_stats(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for stats in per_rank:
        for key, value in stats.items():
            merged[key] = merged.get(key, 0) + value
    if per_rank:
        merged["kv_cache_usage"] = merged.get("kv_cache_usage", 0.0) / len(per_rank)
        merged["kv_cache_mapped"] = min(stats.get("kv_cache_mapped", 0.0) for stats in per_rank)
    merged["per_rank"] = per_rank
    return merged
