"""The EngineCore in its own process, reached over ZMQ.

Three threads: the input thread receives requests (DEALER), decodes them and does the per-request
preprocessing (validation, block hashing); the main thread runs the busy loop (schedule, execute,
update); the output thread encodes results into reused buffers and PUSHes them. The model's time
is spent in the main thread only; serialization and socket work overlap with it.

Start-up: HELLO to the frontend's handshake socket, receive the data-socket addresses, load the
model, then READY with the KV block count. A fatal error sends ENGINE_CORE_DEAD before exiting,
so the frontend fails requests instead of waiting. The output thread also sends a heartbeat with
the step counter and the current step's age (engine/core/liveness.py), so the frontend notices a
core that is stopped or stuck inside a step. SIGTERM/SIGINT drain: new requests are
refused, running ones finish (or are aborted when the grace period ends), then the process exits 0.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from pdserve.engine.config import EngineConfig
from pdserve.engine.core.engine_core import EngineCore
from pdserve.engine.core.liveness import HEARTBEAT_INTERVAL_S, HEARTBEAT_MARKER, CoreHeartbeat, StepClock
from pdserve.engine.core.load_reporter import LoadReporter
from pdserve.engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    SchedulerStats,
    UtilityOutput,
)
from pdserve.engine.request import Request
from pdserve.engine.serial import MsgpackDecoder, MsgpackEncoder

log = logging.getLogger("pdserve.engine.core_proc")

ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"
DEFAULT_DRAIN_SECONDS = float(os.environ.get("PDSERVE_DRAIN_SECONDS", "30"))
# Utility calls a frontend may make; anything else is refused.
UTILITY_METHODS = {"get_stats", "reset_prefix_cache", "ping", "release_kv_hold"}
_WAKE, _STOP = object(), object()
_REUSED_BUFFER_LIMIT = 1 << 20
# An idle engine maps its KV cache ahead of use (worker/kv_memory.py) once no input has come for
# KV_WARM_AFTER_S (a client's next request usually comes sooner: no slice then delays it), a slice
# of KV_WARM_SLICE_S at a time with KV_WARM_PAUSE_S between slices: at most a quarter of a core, so
# an idle engine does not take much from the others sharing the machine (`pdserve up`, a test run).
KV_WARM_AFTER_S = 0.05
KV_WARM_SLICE_S = 0.005
KV_WARM_PAUSE_S = 0.015


class EngineCoreProc:
    def __init__(self, config: EngineConfig, handshake_address: str, engine_index: int = 0,
                 drain_seconds: float = DEFAULT_DRAIN_SECONDS) -> None:
        self.engine_index = engine_index
        self.identity = engine_index.to_bytes(2, "little")
        self.drain_seconds = drain_seconds
        self.ctx = zmq.Context()
        # Outputs get a context of their own: the process ends with os._exit, which kills zmq's
        # I/O thread with whatever it has not written yet (a drain's last outputs). Terminating
        # this context at shutdown waits, up to the linger, until they are sent; the main context
        # cannot be terminated while the input thread blocks on its socket.
        self.output_ctx = zmq.Context()
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self.drain_deadline: float | None = None
        # An I/O thread that dies takes the engine with it: the busy loop re-raises this.
        self.thread_failure: BaseException | None = None
        self.output_address = ""
        # When the busy loop's current step started: the output thread's heartbeat and the load
        # reporter's heartbeat thread read it to tell a long step from a stuck one.
        self.step_clock = StepClock()

        handshake = self.ctx.socket(zmq.DEALER)
        handshake.setsockopt(zmq.LINGER, 1000)
        handshake.connect(handshake_address)
        handshake.send(msgspec.msgpack.encode({"type": "HELLO", "engine_index": engine_index, "pid": os.getpid()}))
        init = msgspec.msgpack.decode(handshake.recv())

        self.core = EngineCore(config)
        # A worker that dies while the loop is idle would go unnoticed until the next request.
        self.core.executor.register_failure_callback(self._on_worker_failure)
        self.reporter: LoadReporter | None = None
        if config.coordinator_address:
            self.core.scheduler.kv_cache_manager.pool.enable_events()
            self.reporter = LoadReporter(config, self.ctx)
            self.reporter.start_heartbeat(step_clock=self.step_clock, step_timeout=config.step_timeout)

        input_ready = threading.Event()
        self.output_address = init["output_address"]
        self.input_thread = threading.Thread(target=self._guarded, args=(self._input_loop, init["input_address"],
                                                                          input_ready), name="engine-input", daemon=True)
        self.output_thread = threading.Thread(target=self._guarded, args=(self._output_loop, self.output_address),
                                              name="engine-output", daemon=True)
        self.input_thread.start()
        self.output_thread.start()
        input_ready.wait()
        handshake.send(msgspec.msgpack.encode({"type": "READY", "num_kv_blocks": config.num_kv_blocks,
                                               "max_model_len": config.model.max_model_len}))
        handshake.close()

    # -- threads ------------------------------------------------------------------------------

    def _on_worker_failure(self) -> None:
        self.thread_failure = RuntimeError("a tensor-parallel worker died")
        self.input_queue.put((EngineCoreRequestType.WAKEUP.value, None))

    def _guarded(self, body: Any, *args: Any) -> None:
        try:
            body(*args)
        except zmq.ContextTerminated:
            pass  # shutting down
        except BaseException as exc:
            log.error("%s thread failed:\n%s", threading.current_thread().name, traceback.format_exc())
            self.thread_failure = exc
            self.input_queue.put((EngineCoreRequestType.WAKEUP.value, None))

    def _input_loop(self, address: str, ready: threading.Event) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, self.identity)
        sock.connect(address)
        sock.send(b"")  # lets the frontend's ROUTER learn this engine's identity
        ready.set()
        decode_add = MsgpackDecoder(EngineCoreRequest)
        decode_abort = MsgpackDecoder(list[str])
        decode_utility = MsgpackDecoder(tuple[int, str, list[Any]])
        decode_wave = MsgpackDecoder(int)
        while True:
            frames = sock.recv_multipart(copy=False)
            kind = bytes(frames[0].buffer)
            try:
                if kind == EngineCoreRequestType.ADD.value:
                    self.input_queue.put((kind, self._preprocess(decode_add.decode(frames[1:]))))
                elif kind == EngineCoreRequestType.ABORT.value:
                    self.input_queue.put((kind, decode_abort.decode(frames[1:])))
                elif kind == EngineCoreRequestType.UTILITY.value:
                    self.input_queue.put((kind, decode_utility.decode(frames[1:])))
                elif kind == EngineCoreRequestType.START_DP_WAVE.value:  # handled by DPEngineCoreProc
                    self.input_queue.put((kind, decode_wave.decode(frames[1:])))
                else:
                    self.input_queue.put((EngineCoreRequestType.WAKEUP.value, None))
            except Exception as exc:  # a malformed message must not kill the engine
                log.warning("dropping a malformed %r message: %s", kind, exc)

    def _preprocess(self, req: EngineCoreRequest) -> Request | tuple[str, str]:
        """Validate and hash off the busy loop; a rejection becomes (request_id, reason)."""
        try:
            self.core.validate_request(req)
        except ValueError as exc:
            return req.request_id, str(exc)
        return Request.from_engine_core_request(req, self.core.block_hasher)

    def _output_loop(self, address: str) -> None:
        sock = self.output_ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 4000)
        sock.connect(address)
        encoder = MsgpackEncoder()
        heartbeat_encoder = msgspec.msgpack.Encoder()
        buffer = bytearray()
        next_heartbeat = 0.0
        while True:
            now = time.monotonic()
            if now >= next_heartbeat:
                self._send_heartbeat(sock, heartbeat_encoder)
                next_heartbeat = now + HEARTBEAT_INTERVAL_S
            try:
                item = self.output_queue.get(timeout=max(0.0, next_heartbeat - time.monotonic()))
            except queue.Empty:
                continue
            if item is _STOP:
                break
            if item is ENGINE_CORE_DEAD:
                sock.send(ENGINE_CORE_DEAD)
                break
            frames = encoder.encode_into(item, buffer)
            large = len(buffer) > _REUSED_BUFFER_LIMIT
            # A small body is copied by send (cheaper than tracking a zero-copy send) so its
            # buffer can be reused at once; a large one is handed over and replaced.
            sock.send_multipart(frames, copy=not large)
            del frames  # drop the view of `buffer`, or it cannot be resized next time
            if large:
                buffer = bytearray()
        sock.close(linger=4000)

    def _send_heartbeat(self, sock: zmq.Socket, encoder: msgspec.msgpack.Encoder) -> None:
        heartbeat = CoreHeartbeat(step=self.core.scheduler.step_counter, step_running_s=self.step_clock.age())
        try:
            # A heartbeat the frontend is not reading yet is worth nothing later: never wait on it.
            sock.send_multipart([HEARTBEAT_MARKER, encoder.encode(heartbeat)], zmq.NOBLOCK)
        except zmq.Again:
            pass

    # -- the busy loop ------------------------------------------------------------------------

    def request_drain(self, *_: Any) -> None:
        if self.drain_deadline is None:
            log.info("draining: refusing new requests, finishing %d in flight",
                     self.core.scheduler.num_unfinished_requests)
            self.drain_deadline = time.monotonic() + self.drain_seconds
        self.input_queue.put((EngineCoreRequestType.WAKEUP.value, None))

    def run_busy_loop(self) -> None:
        while True:
            if self.thread_failure is not None:
                self.core.executor.check_health()  # names the dead worker, when that is the cause
                raise RuntimeError("the engine cannot continue") from self.thread_failure
            idle = not self.core.has_unfinished_requests()
            if self.drain_deadline is not None and (idle or time.monotonic() >= self.drain_deadline):
                self._abort_everything("the engine is shutting down")
                return
            if self.reporter is not None:  # after the previous step, and on every idle wake-up
                self.reporter.maybe_report(self.core.scheduler)
            changed = self._drain_inputs(block=not self.core.has_work())
            if self.core.has_unfinished_requests():
                outputs = self._timed_step()
                self.output_queue.put(outputs)
            elif self.core.has_work():
                # Only blocks held for remote decodes: poll their transfers; report when some go.
                held = len(self.core.scheduler.held_for_send)
                outputs = self._timed_step()
                if outputs.outputs or len(self.core.scheduler.held_for_send) != held:
                    self.output_queue.put(outputs)
            elif changed:
                # No step will report the freed blocks: send the stats now (e.g. after aborts).
                self.output_queue.put(EngineCoreOutputs(scheduler_stats=self.core.scheduler.make_stats(),
                                                        timestamp=time.time()))

    def _timed_step(self) -> EngineCoreOutputs:
        self.step_clock.begin()
        try:
            outputs, _ = self.core.step()
        finally:
            self.step_clock.end()
        return outputs

    def _drain_inputs(self, block: bool) -> bool:
        changed = False
        try:
            item = self._wait_for_input() if block else self.input_queue.get_nowait()
            while True:
                changed |= self._handle_input(*item)
                item = self.input_queue.get_nowait()
        except queue.Empty:
            return changed

    def _stats(self) -> SchedulerStats:
        return self.core.scheduler.make_stats()

    def _wait_for_input(self) -> Any:
        """The next input, waiting up to a second. An engine idle for KV_WARM_AFTER_S meanwhile maps
        its KV cache's pages ahead of use, KV_WARM_SLICE_S at a time with pauses between, so a request
        that comes then waits at most a slice; the stats go out when the cache is all mapped."""
        if self.core.scheduler.kv_cache_mapped >= 1.0:
            return self.input_queue.get(timeout=1.0)
        deadline = time.monotonic() + 1.0
        try:
            return self.input_queue.get(timeout=KV_WARM_AFTER_S)
        except queue.Empty:
            pass
        while time.monotonic() < deadline:
            if not self.core.warm_kv_cache(KV_WARM_SLICE_S):
                self.output_queue.put(EngineCoreOutputs(scheduler_stats=self._stats(), timestamp=time.time()))
                break
            try:
                return self.input_queue.get(timeout=KV_WARM_PAUSE_S)
            except queue.Empty:
                pass
        return self.input_queue.get(timeout=max(0.0, deadline - time.monotonic()))

    def _handle_input(self, kind: bytes, payload: Any) -> bool:
        if kind == EngineCoreRequestType.ADD.value:
            if isinstance(payload, tuple):
                self._reject(*payload)
            elif self.drain_deadline is not None:
                self._reject(payload.request_id, "the engine is shutting down")
            else:
                try:
                    self.core.scheduler.add_request(payload)
                except ValueError as exc:
                    self._reject(payload.request_id, str(exc))
            return True
        if kind == EngineCoreRequestType.ABORT.value:
            self.core.abort_requests(payload)
            return True
        if kind == EngineCoreRequestType.UTILITY.value:
            self._call_utility(*payload)
        return False

    def _reject(self, request_id: str, reason: str) -> None:
        log.debug("rejected request %s: %s", request_id, reason)
        self.output_queue.put(EngineCoreOutputs(outputs=[EngineCoreOutput(
            request_id, [], finish_reason=FinishReason.ABORT, stop_reason=f"rejected: {reason}")]))

    def _call_utility(self, call_id: int, method: str, args: list[Any]) -> None:
        result = UtilityOutput(call_id)
        try:
            if method not in UTILITY_METHODS:
                raise ValueError(f"unknown utility method {method!r}")
            result.result = getattr(self.core, method)(*args)
        except Exception as exc:
            result.failure_message = f"{type(exc).__name__}: {exc}"
        self.output_queue.put(EngineCoreOutputs(utility_output=result))

    def _abort_everything(self, reason: str) -> None:
        ids = list(self.core.scheduler.requests)
        if ids:
            log.warning("aborting %d requests: %s", len(ids), reason)
            self.core.abort_requests(ids)
            self.output_queue.put(EngineCoreOutputs(outputs=[
                EngineCoreOutput(i, [], finish_reason=FinishReason.ABORT, stop_reason=reason) for i in ids],
                scheduler_stats=self.core.scheduler.make_stats()))

    def shutdown(self, dead: bool = False) -> None:
        if self.reporter is not None:
            self.reporter.close()
        if self.output_thread.is_alive():
            self.output_queue.put(ENGINE_CORE_DEAD if dead else _STOP)
            self.output_thread.join(timeout=5)
        elif dead:
            sock = self.output_ctx.socket(zmq.PUSH)
            sock.connect(self.output_address)
            sock.send(ENGINE_CORE_DEAD)
            sock.close(linger=2000)
        if not self.output_thread.is_alive():  # else its socket is open and term() would wait forever
            self.output_ctx.term()
        # The main context is not destroyed: the input thread may be blocked on its socket, and
        # closing it from here can abort the process. The caller exits right after.
        self.core.shutdown()


def _watch_parent(pipe: Connection, proc: "list[EngineCoreProc | None]") -> None:
    """Exit when the frontend dies: its end of the pipe closes and recv() raises."""
    try:
        pipe.recv()
    except (EOFError, OSError):
        pass
    log.warning("frontend process is gone; shutting down")
    engine = proc[0]
    if engine is not None:
        try:
            engine.core.shutdown()
        except Exception:
            pass
    os._exit(1)


def run_engine_core(config: EngineConfig, handshake_address: str, engine_index: int = 0,
                    parent_pipe: Connection | None = None) -> None:
    """Entry point of the EngineCore process."""
    from pdserve.engine.logging_config import configure_logging

    configure_logging()
    holder: list[EngineCoreProc | None] = [None]
    if parent_pipe is not None:
        threading.Thread(target=_watch_parent, args=(parent_pipe, holder), daemon=True, name="parent-watch").start()
    # Until the busy loop runs, a signal just ends the process.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGINT, lambda *_: os._exit(0))
    engine = None
    try:
        proc_class = EngineCoreProc
        if config.parallel.data_parallel_lockstep:
            from pdserve.engine.core.dp_engine_core_proc import DPEngineCoreProc as proc_class
        engine = proc_class(config, handshake_address, engine_index)
        holder[0] = engine
        signal.signal(signal.SIGTERM, engine.request_drain)
        signal.signal(signal.SIGINT, engine.request_drain)
        engine.run_busy_loop()
        engine.shutdown()
        log.info("engine core %d exited cleanly", engine_index)
        os._exit(0)
    except Exception:
        log.error("engine core %d failed:\n%s", engine_index, traceback.format_exc())
        if engine is not None:
            engine.shutdown(dead=True)
        os._exit(1)
