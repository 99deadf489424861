"""Clients for an EngineCore running in another process (EngineCoreProc), over ZMQ.

The frontend binds three sockets: a handshake ROUTER (HELLO → addresses → READY), the input
ROUTER it sends requests on, and the output PULL it receives results on. A watcher thread waits
on the engine process; if it exits, or sends ENGINE_CORE_DEAD, every caller gets EngineDeadError
instead of waiting forever. A live core that stops making progress is *unresponsive* instead: the
async client follows the core's heartbeats (engine/core/liveness.py) and says why in
`check_liveness`, while its requests stay in flight in case it recovers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import threading
import time
from collections import deque
from multiprocessing.connection import wait as wait_for_processes
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pdserve.engine import ipc_files
from pdserve.engine.config import EngineConfig
from pdserve.engine.core.engine_core_proc import ENGINE_CORE_DEAD, run_engine_core
from pdserve.engine.core.liveness import HEARTBEAT_MARKER, CoreHeartbeat, CoreLiveness, RankLiveness
from pdserve.engine.frontend.core_client import EngineCoreClient
from pdserve.engine.protocol import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType
from pdserve.engine.serial import MsgpackDecoder, MsgpackEncoder

log = logging.getLogger("pdserve.engine.client")

STARTUP_TIMEOUT_S = float(os.environ.get("PDSERVE_ENGINE_STARTUP_TIMEOUT", "900"))
# The process sentinel fires before zmq's I/O thread has handed over the last frames a dying
# engine flushed (its sockets linger), so readers keep polling this long after a death.
DEATH_GRACE_S = 1.0


class EngineDeadError(RuntimeError):
    """The EngineCore process died or reported a fatal error; in-flight requests are lost."""


def _ipc_address(kind: str) -> str:
    return f"ipc://{ipc_files.socket_path(kind)}"


async def next_output(queue: "asyncio.Queue[EngineCoreOutputs | Exception]") -> EngineCoreOutputs:
    """The next outputs from a client's queue. An exception put there (the engine died) is raised,
    and left in place so that every later caller sees it too."""
    item = await queue.get()
    if isinstance(item, Exception):
        queue.put_nowait(item)
        raise item
    return item


class MPClientBase:
    """Starts the engine process and owns the sockets; subclasses decide sync or asyncio I/O."""

    def __init__(self, config: EngineConfig, engine_index: int = 0) -> None:
        self.config = config
        self.engine_index = engine_index
        self.engine_identity = engine_index.to_bytes(2, "little")
        self.liveness = CoreLiveness.starting()
        self._heartbeat_decoder = msgspec.msgpack.Decoder(CoreHeartbeat)
        self.dead_reason = ""
        self.dead_at: float | None = None  # monotonic time the engine was found dead
        self._closed = False
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self.call_ids = itertools.count()
        sync_ctx = zmq.Context()
        self._sync_ctx = sync_ctx
        handshake_address = _ipc_address("handshake")
        self.input_address, self.output_address = _ipc_address("input"), _ipc_address("output")
        handshake = sync_ctx.socket(zmq.ROUTER)
        handshake.bind(handshake_address)
        # The input and output sockets are bound before the engine starts, so none of its
        # messages can arrive before we listen.
        self._sync_input = sync_ctx.socket(zmq.ROUTER)
        self._sync_input.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sync_input.bind(self.input_address)
        self.output_socket = sync_ctx.socket(zmq.PULL)
        self.output_socket.bind(self.output_address)

        mp = multiprocessing.get_context("spawn")
        reader, self._parent_pipe = mp.Pipe(duplex=False)
        self.proc = mp.Process(target=run_engine_core, name=f"EngineCore_{engine_index}",
                               args=(config, handshake_address, engine_index, reader))
        self.proc.start()
        reader.close()
        try:
            self.num_kv_blocks = self._handshake(handshake)
            self._wait_input_registration()
        except BaseException:
            self.shutdown()
            raise
        finally:
            handshake.close(linger=0)
            ipc_files.remove_socket(handshake_address)
        self._watcher = threading.Thread(target=self._watch_process, daemon=True, name="engine-watch")
        self._watcher.start()

    # -- start-up -------------------------------------------------------------------------------

    def _recv_or_die(self, sock: zmq.Socket, what: str, deadline: float) -> list[bytes]:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while time.monotonic() < deadline:
            if poller.poll(200):
                return sock.recv_multipart()
            if not self.proc.is_alive():
                raise EngineDeadError(f"the engine process exited with code {self.proc.exitcode} before {what}")
        raise TimeoutError(f"the engine did not send {what} within {STARTUP_TIMEOUT_S:.0f}s")

    def _handshake(self, sock: zmq.Socket) -> int:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        identity, hello = self._recv_or_die(sock, "HELLO", deadline)
        if msgspec.msgpack.decode(hello).get("type") != "HELLO":
            raise EngineDeadError("bad handshake from the engine")
        sock.send_multipart([identity, msgspec.msgpack.encode(
            {"input_address": self.input_address, "output_address": self.output_address})])
        _, ready = self._recv_or_die(sock, "READY", deadline)
        message = msgspec.msgpack.decode(ready)
        if message.get("type") != "READY":
            raise EngineDeadError("bad handshake from the engine")
        self.config.num_kv_blocks = message["num_kv_blocks"]
        return message["num_kv_blocks"]

    def _wait_input_registration(self) -> None:
        identity, _ = self._recv_or_die(self._sync_input, "its input registration", time.monotonic() + 30)
        self.engine_identity = identity

    def _watch_process(self) -> None:
        wait_for_processes([self.proc.sentinel])
        if not self._closed:
            self._mark_dead(f"the engine process exited unexpectedly (exit code {self.proc.exitcode})")

    def _mark_dead(self, reason: str) -> None:
        if not self.dead:
            self.dead_at = time.monotonic()
            self.dead_reason = reason
            log.error("engine core is dead: %s", reason)
            self._on_dead()

    def _on_dead(self) -> None:
        """Hook for subclasses to wake their waiters."""

    @property
    def dead(self) -> bool:
        return self.dead_at is not None

    def _death_settled(self) -> bool:
        """Dead, and long enough ago that nothing it sent can still be on its way."""
        return self.dead_at is not None and time.monotonic() - self.dead_at >= DEATH_GRACE_S

    def _decode_outputs(self, frames: list[Any]) -> EngineCoreOutputs | None:
        first = frames[0]
        raw = first.bytes if hasattr(first, "bytes") else first
        if len(frames) == 1 and raw == ENGINE_CORE_DEAD:
            self._mark_dead("the engine core reported a fatal error")
            return None
        if len(frames) == 2 and raw == HEARTBEAT_MARKER:
            second = frames[1]
            self.liveness.on_heartbeat(self._heartbeat_decoder.decode(second.bytes if hasattr(second, "bytes")
                                                                      else second))
            return None
        return self.decoder.decode(frames)

    def _request_frames(self, kind: EngineCoreRequestType, payload: Any) -> list[Any]:
        frames = [self.engine_identity, kind.value]
        if payload is not None:
            frames += self.encoder.encode(payload)
        return frames

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        proc = getattr(self, "proc", None)
        if proc is not None and proc.is_alive():
            proc.terminate()  # SIGTERM: the engine drains what is left, then exits
            proc.join(timeout=float(os.environ.get("PDSERVE_DRAIN_SECONDS", "30")) + 10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._parent_pipe.close()
        self._sync_ctx.destroy(linger=0)
        for address in (self.input_address, self.output_address):
            ipc_files.remove_socket(address)


class SyncMPClient(MPClientBase, EngineCoreClient):
    """For the offline LLM: blocking calls, the engine in a background process."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.input_socket = self._sync_input
        self.pending: deque[EngineCoreOutputs] = deque()
        self.poller = zmq.Poller()
        self.poller.register(self.output_socket, zmq.POLLIN)

    def _check(self) -> None:
        if self.dead:
            raise EngineDeadError(self.dead_reason)

    def _send(self, kind: EngineCoreRequestType, payload: Any = None) -> None:
        self._check()
        self.input_socket.send_multipart(self._request_frames(kind, payload), copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def _receive(self) -> EngineCoreOutputs:
        while True:
            # Read what the engine sent before it died (e.g. the last outputs of a drain) first.
            if self.poller.poll(100):
                outputs = self._decode_outputs(self.output_socket.recv_multipart(copy=False))
                if outputs is not None:
                    return outputs
            if self._death_settled():
                raise EngineDeadError(self.dead_reason)

    def get_output(self) -> EngineCoreOutputs:
        if self.pending:
            return self.pending.popleft()
        return self._receive()

    def call_utility(self, method: str, *args: Any) -> Any:
        call_id = next(self.call_ids)
        self._send(EngineCoreRequestType.UTILITY, (call_id, method, list(args)))
        while True:
            outputs = self._receive()
            result = outputs.utility_output
            if result is not None and result.call_id == call_id:
                if result.failure_message:
                    raise RuntimeError(f"engine utility {method} failed: {result.failure_message}")
                if outputs.outputs:
                    self.pending.append(msgspec.structs.replace(outputs, utility_output=None))
                return result.result
            self.pending.append(outputs)


class AsyncMPClient(MPClientBase):
    """For the server: asyncio calls; outputs arrive through `get_output_async`."""

    def __init__(self, config: EngineConfig, engine_index: int = 0) -> None:
        # Set before the engine starts: a failed start calls shutdown(), which reads them.
        self.outputs_queue: asyncio.Queue | None = None
        self.utility_futures: dict[int, asyncio.Future] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self._reader: asyncio.Task | None = None
        super().__init__(config, engine_index)
        # The sockets are made synchronous for the handshake; shadows drive them from asyncio.
        self.input_socket = zmq.asyncio.Socket.shadow(self._sync_input.underlying)
        self.async_output = zmq.asyncio.Socket.shadow(self.output_socket.underlying)

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self.loop = asyncio.get_running_loop()
            self.outputs_queue = asyncio.Queue()
            # Silence counts from here: until now nobody read the heartbeats.
            self.liveness = CoreLiveness.starting()
            self._reader = self.loop.create_task(self._read_outputs(), name="engine-output-reader")

    def check_liveness(self) -> list[RankLiveness]:
        """This core's progress, as its heartbeats tell it (starts the output reader if needed)."""
        self._ensure_reader()
        view = self.liveness
        return [RankLiveness(self.engine_index, view.reason(self.config.step_timeout), view.step_running_s,
                             view.silence_s)]

    async def _read_outputs(self) -> None:
        assert self.outputs_queue is not None
        while True:
            # Poll with a timeout so a death is noticed while idle, but only once the socket is
            # empty: outputs the engine sent before dying still reach their requests.
            if not await self.async_output.poll(timeout=100):
                self.liveness.on_caught_up()
                if self._death_settled():
                    self._fail_waiters()
                    return
                continue
            outputs = self._decode_outputs(await self.async_output.recv_multipart(copy=False))
            if outputs is None:
                continue
            if outputs.utility_output is not None:
                future = self.utility_futures.pop(outputs.utility_output.call_id, None)
                if future is not None and not future.done():
                    future.set_result(outputs.utility_output)
                if not outputs.outputs and outputs.scheduler_stats is None:
                    continue
            self.outputs_queue.put_nowait(outputs)

    def _fail_waiters(self) -> None:
        error = EngineDeadError(self.dead_reason)
        if self.outputs_queue is not None:
            self.outputs_queue.put_nowait(error)
        for future in self.utility_futures.values():
            if not future.done():
                future.set_exception(error)
        self.utility_futures.clear()

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_reader()
        assert self.outputs_queue is not None
        return await next_output(self.outputs_queue)

    async def _send(self, kind: EngineCoreRequestType, payload: Any = None) -> None:
        self._ensure_reader()
        if self.dead:
            raise EngineDeadError(self.dead_reason)
        await self.input_socket.send_multipart(self._request_frames(kind, payload), copy=False)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self._send(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and not self.dead:
            await self._send(EngineCoreRequestType.ABORT, list(request_ids))

    async def call_utility_async(self, method: str, *args: Any, timeout: float | None = 30.0) -> Any:
        self._ensure_reader()
        assert self.loop is not None
        call_id = next(self.call_ids)
        future = self.loop.create_future()
        self.utility_futures[call_id] = future
        await self._send(EngineCoreRequestType.UTILITY, (call_id, method, list(args)))
        result = await asyncio.wait_for(future, timeout)
        if result.failure_message:
            raise RuntimeError(f"engine utility {method} failed: {result.failure_message}")
        return result.result

    def shutdown(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
        super().shutdown()
