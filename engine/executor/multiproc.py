"""One worker process per tensor-parallel rank, driven over shared-memory queues.

The executor writes each RPC once to a broadcast queue that every worker reads, and reads each
worker's answer from that worker's own response queue (see shm_queue.py). Worker processes are
started with `spawn`: forking a process that already runs torch's thread pools is unsafe.

Failure model: a worker that dies is an engine that died. A monitor thread waits on the worker
processes' sentinels; the moment one exits unexpectedly the executor is marked failed, and every
wait on a queue (which polls a cancel callback about once a millisecond) stops and raises
WorkerDiedError. Nothing blocks forever on a dead peer. The other way round, each worker watches
a pipe whose only writer is this process, and exits when the kernel closes it, so workers never
outlive their parent, even one killed with SIGKILL.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import multiprocessing
import multiprocessing.util  # noqa: F401 - imported before our atexit hook so that ours runs first
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from pdserve.engine import ipc_files
from pdserve.engine.config import EngineConfig
from pdserve.engine.cores import usable_cores
from pdserve.engine.executor.abstract import Executor
from pdserve.engine.executor.shm_queue import QueueCancelled, QueueHandle, ShmMessageQueue
from pdserve.engine.executor.worker_proc import (
    EXIT_FATAL,
    REPLY_ERROR,
    SHUTDOWN,
    STATUS_ERROR,
    STATUS_FATAL,
    STATUS_READY,
    RemoteError,
    worker_main,
)
from pdserve.engine.model.layers import check_head_split

log = logging.getLogger("pdserve.engine.executor")

# Shutdown: how long workers get to leave on their own, then after SIGTERM, then after SIGKILL.
JOIN_TIMEOUT_S = 3.0
TERMINATE_TIMEOUT_S = 2.0
KILL_TIMEOUT_S = 2.0
# An error reply may be the echo of a peer's death; how long to look for that death first.
DEATH_GRACE_S = 0.1
# Queue handshake once every worker has loaded its model (sockets on localhost: instant in practice).
HANDSHAKE_TIMEOUT_S = 60.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process exited while the executor still needed it."""

    def __init__(self, rank: int, pid: int | None, exitcode: int | None, detail: str = "") -> None:
        self.rank, self.pid, self.exitcode, self.detail = rank, pid, exitcode, detail
        message = f"tensor-parallel worker rank {rank} (pid {pid}) died with {_describe_exit(exitcode)}"
        if detail:
            message += f": {detail}"
        super().__init__(message)

    def __reduce__(self) -> tuple:
        return type(self), (self.rank, self.pid, self.exitcode, self.detail)


class WorkerStartupError(RuntimeError):
    """A worker could not set up its device, process group or model shard."""


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "an unknown exit status"
    if exitcode < 0:
        import signal

        try:
            return f"exit code {exitcode} (killed by {signal.Signals(-exitcode).name})"
        except ValueError:
            return f"exit code {exitcode}"
    if exitcode == EXIT_FATAL:
        return f"exit code {exitcode} (a call failed on a rank that does not reply)"
    return f"exit code {exitcode}"


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_threads(tp: int, cores: int | None = None) -> int | None:
    """Torch threads per worker: an equal share of `cores` (default: this process's), unless
    OMP_NUM_THREADS says."""
    cores = cores or usable_cores()
    if "OMP_NUM_THREADS" in os.environ:
        try:
            asked = int(os.environ["OMP_NUM_THREADS"])
        except ValueError:
            asked = 0
        if asked * tp > cores:
            # Each rank waits in collectives for the others; spinning threads competing for the
            # same cores make every step many times slower (measured: 7x at 2 ranks x 2 threads
            # on 2 cores).
            log.warning("OMP_NUM_THREADS=%d in each of %d tensor-parallel workers oversubscribes %d cores",
                        asked, tp, cores)
        return None
    return max(1, cores // tp)


@dataclass
class _WorkerHandle:
    rank: int
    process: multiprocessing.process.BaseProcess
    pid: int | None  # kept: a closed process object no longer answers .pid
    status: Connection  # worker -> executor: ready / startup error / fatal error
    death: Connection  # executor's end of the pipe the worker watches; never written
    response: ShmMessageQueue | None = None
    response_handle: QueueHandle | None = None


class _ExecutorState:
    """Everything shutdown needs; holds no reference to the executor, so the atexit hook and the
    monitor thread never keep it alive."""

    def __init__(self, tp: int) -> None:
        self.tp = tp
        self.workers: list[_WorkerHandle] = []
        self.broadcast: ShmMessageQueue | None = None
        self.failure: WorkerDiedError | None = None
        self.failure_reason: str | None = None  # set instead of `failure` for non-death failures
        self.closing = False
        self.rpc_lock = threading.Lock()  # one RPC is broadcast and collected at a time
        self.pending_lock = threading.Lock()
        self.pending_async = 0  # non-blocking RPCs whose replies the I/O thread has not read yet
        self.io_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.monitor: threading.Thread | None = None
        self.monitor_stop_r, self.monitor_stop_w = os.pipe()
        self.failure_callbacks: list[Callable[[], None]] = []
        self.callbacks_lock = threading.Lock()
        self.shutdown_lock = threading.Lock()
        self.shut_down = False

    # -- failure -------------------------------------------------------------------------------

    def stopped(self) -> bool:
        """The queues' cancel callback: stop waiting once a worker died or shutdown began."""
        return self.failure is not None or self.failure_reason is not None or self.closing

    def error(self) -> Exception:
        if self.failure is not None:
            f = self.failure
            return WorkerDiedError(f.rank, f.pid, f.exitcode, f.detail)
        if self.failure_reason is not None:
            return RuntimeError(self.failure_reason)
        return RuntimeError("the executor has been shut down")

    def fail(self, failure: WorkerDiedError) -> None:
        with self.callbacks_lock:
            if self.failure is not None:
                return
            self.failure = failure
            callbacks = list(self.failure_callbacks)
        if not self.closing:
            log.error("%s; the engine cannot continue", failure)
        for callback in callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - one bad callback must not hide the failure from others
                log.exception("executor failure callback raised")

    def check_processes(self) -> None:
        """Record a dead worker now, without waiting for the monitor thread to notice."""
        if self.failure is None and not self.closing:
            for w in self.workers:
                if w.process.exitcode is not None:
                    self.fail(self._death(w))
                    return

    def died_within(self, timeout: float) -> bool:
        """True when a worker is dead or dies within `timeout`; records it."""
        if self.failure is None and not self.closing:
            by_sentinel = {w.process.sentinel: w for w in self.workers}
            ready = wait(list(by_sentinel), timeout)
            if ready:
                self.fail(self._death(min((by_sentinel[s] for s in ready), key=lambda w: w.rank)))
        return self.failure is not None

    def _death(self, w: _WorkerHandle) -> WorkerDiedError:
        detail = ""
        try:
            # A rank that failed on purpose left its traceback on the status pipe before exiting.
            if w.status.poll():
                kind, payload = w.status.recv()
                if kind in (STATUS_FATAL, STATUS_ERROR) and isinstance(payload, RemoteError):
                    detail = f"{payload.summary}\n{payload.traceback.rstrip()}"
        except (EOFError, OSError):
            pass
        # The sentinel fires when the kernel closes the child's files, a moment before the
        # child can be reaped; wait for its exit status, briefly.
        deadline = time.monotonic() + 1.0
        while w.process.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.005)
        return WorkerDiedError(w.rank, w.pid, w.process.exitcode, detail)

    def start_monitor(self) -> None:
        self.monitor = threading.Thread(target=self._monitor, name="tp-worker-monitor", daemon=True)
        self.monitor.start()

    def _monitor(self) -> None:
        by_sentinel = {w.process.sentinel: w for w in self.workers}
        ready = wait([*by_sentinel, self.monitor_stop_r])
        if self.closing or self.monitor_stop_r in ready:
            return
        dead = sorted((by_sentinel[s] for s in ready if s in by_sentinel), key=lambda w: w.rank)
        self.fail(self._death(dead[0]))

    # -- shutdown ------------------------------------------------------------------------------

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers (asking first when `graceful`), then release every queue; idempotent."""
        with self.shutdown_lock:
            if self.shut_down:
                return
            self.shut_down = True
        self.closing = True  # in-flight queue waits see this within a millisecond and give up
        # Let an RPC running in another thread unwind before its queues go away.
        got_lock = self.rpc_lock.acquire(timeout=5.0)
        try:
            if self.io_pool is not None:
                self.io_pool.shutdown(wait=True, cancel_futures=True)
            self._stop_workers(graceful)
            self._stop_monitor()
            self._release_queues()
            for w in self.workers:
                for conn in (w.status, w.death):
                    conn.close()
                if w.process.exitcode is not None:
                    w.process.close()
        finally:
            if got_lock:
                self.rpc_lock.release()

    def _stop_workers(self, graceful: bool) -> None:
        alive = [w for w in self.workers if w.process.is_alive()]
        if not graceful:
            # Workers that never reached their loop cannot hear a shutdown message, and may sit
            # in the process group's rendezvous where SIGTERM does not interrupt them either.
            for w in alive:
                w.process.kill()
        elif alive and self.broadcast is not None:
            try:
                # No cancel callback here: `closing` is set. A timeout instead, for a ring that is
                # full because a dead reader stopped consuming.
                self.broadcast.enqueue((SHUTDOWN, (), None, None), timeout=1.0)
            except (TimeoutError, QueueCancelled, ValueError):
                pass
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for w in alive:
            w.process.join(max(0.0, deadline - time.monotonic()))
        for sig_step, timeout in (("terminate", TERMINATE_TIMEOUT_S), ("kill", KILL_TIMEOUT_S)):
            stragglers = [w for w in self.workers if w.process.is_alive()]
            if not stragglers:
                break
            log.warning("%s tensor-parallel worker(s) %s", sig_step, [w.pid for w in stragglers])
            for w in stragglers:
                getattr(w.process, sig_step)()
            deadline = time.monotonic() + timeout
            for w in stragglers:
                w.process.join(max(0.0, deadline - time.monotonic()))

    def _stop_monitor(self) -> None:
        try:
            os.write(self.monitor_stop_w, b"x")
        except OSError:
            pass
        if self.monitor is not None:
            self.monitor.join(timeout=5.0)
        for fd in (self.monitor_stop_r, self.monitor_stop_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _release_queues(self) -> None:
        for w in self.workers:
            if w.response is not None:
                w.response.close()
            if w.response_handle is not None:
                # The worker unlinks its own queue when it exits normally; one that was killed
                # cannot, and its segment would stay in /dev/shm until the resource tracker exits.
                _remove_orphaned_queue(w.response_handle)
        if self.broadcast is not None:
            self.broadcast.close()


def _remove_orphaned_queue(handle: QueueHandle) -> None:
    try:
        import _posixshmem
    except ImportError:  # no POSIX shared memory: nothing lingers by name
        return
    try:
        _posixshmem.shm_unlink("/" + handle.shm_name)
    except FileNotFoundError:
        pass  # the worker removed it (and told the resource tracker) itself
    else:
        # The dead worker registered the segment with the resource tracker it shares with us,
        # under the name SharedMemory gives it; drop that record or the tracker unlinks it again
        # and warns about a leak when it exits.
        from multiprocessing import resource_tracker

        resource_tracker.unregister("/" + handle.shm_name, "shared_memory")
    ipc_files.remove_socket(handle.zmq_address)


# The rendezvous port is found free, then bound by rank 0 a moment later, in another process: on a
# busy machine another program can take it in between (a fault-suite run: EADDRINUSE on a port that
# free_tcp_port had just found free). A port we chose is chosen again; one the config gave is not.
RENDEZVOUS_PORT_TRIES = 3


def rendezvous_port_taken(error: BaseException, init_method: str) -> bool:
    """Whether worker startup failed because the process group's port (of `init_method`,
    tcp://host:port) was already in use; another port in use (a connector's) is not retried."""
    if not isinstance(error, WorkerStartupError):
        return False
    text = str(error)
    port = init_method.rsplit(":", 1)[-1]
    return ("EADDRINUSE" in text or "address already in use" in text.lower()) and f"port: {port}" in text


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        tp = config.parallel.tensor_parallel_size
        mc = config.model
        # Fail here, with the model's numbers, rather than in every worker after a spawn.
        check_head_split(mc.num_attention_heads, mc.num_key_value_heads, tp)
        self.tp = tp
        given = config.parallel.distributed_init_method
        for attempt in range(1, RENDEZVOUS_PORT_TRIES + 1):
            self.distributed_init_method = given or f"tcp://127.0.0.1:{free_tcp_port()}"
            self._state = state = _ExecutorState(tp)
            # Registered after multiprocessing.util's own exit hook, so it runs first: that hook joins
            # non-daemon children, which would wait forever for workers nobody told to stop.
            atexit.register(state.shutdown)
            # An executor dropped without shutdown() must not keep its workers until exit.
            weakref.finalize(self, state.shutdown)
            try:
                self._start_workers()
                return
            except BaseException as e:
                state.shutdown(graceful=False)
                atexit.unregister(state.shutdown)
                taken = rendezvous_port_taken(e, self.distributed_init_method)
                if given or attempt == RENDEZVOUS_PORT_TRIES or not taken:
                    raise
                log.warning("the rendezvous port of %s was taken before rank 0 could listen on it; "
                            "starting the workers again on another (try %d of %d)",
                            self.distributed_init_method, attempt + 1, RENDEZVOUS_PORT_TRIES)

    # -- startup -------------------------------------------------------------------------------

    def _start_workers(self) -> None:
        state = self._state
        ctx = multiprocessing.get_context("spawn")
        state.broadcast = ShmMessageQueue.create(self.tp)
        threads = worker_threads(self.tp, self.config.parallel.cpu_cores)
        start = time.perf_counter()
        for rank in range(self.tp):
            status_r, status_w = ctx.Pipe(duplex=False)
            death_r, death_w = ctx.Pipe(duplex=False)
            process = ctx.Process(
                target=worker_main, name=f"pdserve-tp{rank}", daemon=False,
                args=(self.config, rank, self.distributed_init_method, state.broadcast.handle(), status_w,
                      death_r, threads))
            process.start()
            # Only the child may hold these ends: EOF on them must mean the other side is gone.
            status_w.close()
            death_r.close()
            state.workers.append(_WorkerHandle(rank, process, process.pid, status_r, death_w))
        self._wait_for_workers()
        for w in state.workers:
            assert w.response_handle is not None
            w.response = ShmMessageQueue.attach(w.response_handle, 0)
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        self._handshake(state.broadcast, deadline)
        for w in state.workers:
            assert w.response is not None
            self._handshake(w.response, deadline)
        state.start_monitor()
        state.check_processes()  # a worker that died between its handshake and the monitor's start
        if state.failure is not None:
            raise state.error()
        log.info("%d tensor-parallel workers ready in %.1fs (%s)", self.tp, time.perf_counter() - start,
                 self.distributed_init_method)

    def _wait_for_workers(self) -> None:
        """Collect every worker's response-queue handle; raise on the first startup failure."""
        waiting = {w.status: w for w in self._state.workers}
        sentinels = {w.process.sentinel: w for w in self._state.workers}
        while waiting:
            ready = wait([*waiting, *(s for s, w in sentinels.items() if w.status in waiting)])
            for obj in ready:
                w = waiting.get(obj) or sentinels.get(obj)  # type: ignore[call-overload]
                if w is None or w.status not in waiting:
                    continue
                try:
                    kind, payload = w.status.recv()
                except (EOFError, OSError):
                    # Exited without a word: killed, or crashed before Python could report.
                    w.process.join(1.0)
                    raise WorkerStartupError(
                        f"tensor-parallel worker rank {w.rank} (pid {w.pid}) exited during startup with "
                        f"{_describe_exit(w.process.exitcode)}") from None
                if kind == STATUS_READY:
                    w.response_handle = payload
                    del waiting[w.status]
                    continue
                # The other ranks are likely stuck waiting for this one in the process group's
                # rendezvous; the caller's shutdown() ends them.
                cause = payload.rebuild() if isinstance(payload, RemoteError) else None
                summary = payload.summary if isinstance(payload, RemoteError) else repr(payload)
                raise WorkerStartupError(
                    f"tensor-parallel worker rank {w.rank} (pid {w.pid}) failed to start: {summary}") from cause

    def _handshake(self, queue: ShmMessageQueue, deadline: float) -> None:
        """wait_until_ready, in slices, so that a worker dying meanwhile fails startup at once."""
        state = self._state
        while True:
            try:
                queue.wait_until_ready(min(0.5, max(0.0, deadline - time.monotonic())))
                return
            except TimeoutError:
                if state.died_within(0):
                    raise state.error() from None
                if time.monotonic() >= deadline:
                    raise WorkerStartupError(f"tensor-parallel workers did not connect their queues within "
                                             f"{HANDSHAKE_TIMEOUT_S:.0f}s") from None

    # -- RPC -----------------------------------------------------------------------------------

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       unique_reply_rank: int | None = None, non_block: bool = False,
                       timeout: float | None = None) -> Any:
        """Run `method` on every worker. Returns every rank's result in rank order, or only
        `unique_reply_rank`'s; with `non_block`, a Future of that. A worker's exception is
        raised here (its own type where it pickles) with the worker's traceback as a note."""
        state = self._state
        if unique_reply_rank is not None and not 0 <= unique_reply_rank < self.tp:
            raise ValueError(f"unique_reply_rank {unique_reply_rank} is not a rank of {self.tp}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with state.rpc_lock:
            self._raise_if_unusable()
            assert state.broadcast is not None
            try:
                state.broadcast.enqueue((method, args, kwargs, unique_reply_rank), timeout=timeout,
                                        cancel=state.stopped)
            except QueueCancelled:
                raise state.error() from None
            except TimeoutError:
                # Some worker has not taken messages for `timeout`: the ring is full and nothing
                # was sent, so the protocol is still in step.
                raise TimeoutError(f"workers did not take {method!r} within {timeout}s") from None
            ranks = list(range(self.tp)) if unique_reply_rank is None else [unique_reply_rank]

            def gather() -> Any:
                try:
                    return self._gather(method, ranks, deadline, unique_reply_rank is not None)
                finally:
                    with state.pending_lock:
                        state.pending_async -= 1

            with state.pending_lock:
                queued_behind = state.pending_async > 0
                if non_block or queued_behind:
                    state.pending_async += 1
            if not (non_block or queued_behind):
                return self._gather(method, ranks, deadline, unique_reply_rank is not None)
            # Replies arrive in call order on each queue, so earlier non-blocking calls' replies
            # must be read first: the single I/O thread reads them all, in order.
            if state.io_pool is None:
                state.io_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tp-rpc-io")
            future = state.io_pool.submit(gather)
        return future if non_block else future.result()

    def _gather(self, method: str, ranks: list[int], deadline: float | None, unique: bool) -> Any:
        state = self._state
        results: list[Any] = []
        first_error: RemoteError | None = None
        for rank in ranks:
            queue = state.workers[rank].response
            assert queue is not None
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                kind, value = queue.dequeue(timeout=remaining, cancel=state.stopped)
            except QueueCancelled:
                raise state.error() from None
            except TimeoutError:
                # Late replies would be read as answers to the next call: nothing can be trusted now.
                state.failure_reason = (f"{method!r} timed out waiting for worker rank {rank}; the executor "
                                        f"is out of step with its workers and cannot be used any more")
                raise TimeoutError(state.failure_reason) from None
            if kind == REPLY_ERROR:
                # Keep reading the other ranks' replies so that the queues stay in step.
                first_error = first_error or value
                results.append(None)
            else:
                results.append(value)
        if first_error is not None:
            # A rank whose peer died fails in its next collective ("Connection reset by peer");
            # the death is the real story, and it is usually already visible or about to be.
            if state.died_within(DEATH_GRACE_S):
                raise state.error() from first_error.rebuild()
            raise first_error.rebuild()
        return results[0] if unique else results

    def _raise_if_unusable(self) -> None:
        state = self._state
        state.check_processes()
        if state.stopped():
            raise state.error()

    # -- health and lifecycle ------------------------------------------------------------------

    def check_health(self) -> None:
        self._raise_if_unusable()

    def register_failure_callback(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from the monitor thread) as soon as a worker dies; at once if one has.

        For a busy loop that is idle when the death happens and so would not otherwise notice."""
        state = self._state
        with state.callbacks_lock:
            if state.failure is None:
                state.failure_callbacks.append(callback)
                return
        callback()

    @property
    def worker_pids(self) -> list[int | None]:
        return [w.pid for w in self._state.workers]

    @property
    def is_failed(self) -> bool:
        return self._state.failure is not None or self._state.failure_reason is not None

    def shutdown(self) -> None:
        state = self._state
        state.shutdown()
        atexit.unregister(state.shutdown)
