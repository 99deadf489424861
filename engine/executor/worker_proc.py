"""The body of one tensor-parallel worker process, started by the MultiprocExecutor.

A worker builds its `Worker` (device, process group, model shard), creates its response queue,
reports that queue's handle on its status pipe, then serves RPCs from the broadcast queue until
it is told to shut down or its parent goes away.

Wire format (pickled through the shared-memory queues):

    broadcast  (method, args, kwargs, reply_rank)       reply_rank None: every rank answers
    response   (REPLY_OK, value) | (REPLY_ERROR, RemoteError)
    status     (STATUS_READY, QueueHandle) | (STATUS_ERROR, RemoteError)   -- startup
               (STATUS_FATAL, RemoteError)                                  -- just before exiting
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from pdserve.engine import ipc_files

SHUTDOWN = "__shutdown__"

REPLY_OK = 0
REPLY_ERROR = 1

STATUS_READY = "ready"
STATUS_ERROR = "error"
STATUS_FATAL = "fatal"

# After the parent is gone the main loop notices within a millisecond when it is idle; one stuck in
# a forward or a collective gets this long before the process ends itself.
PARENT_GONE_GRACE_S = 2.0
# How long the queue handshake may take once every rank has loaded its model.
HANDSHAKE_TIMEOUT_S = 60.0

# A rank that fails and exits uses this code, so the parent can tell it from a signal.
EXIT_FATAL = 3

log = logging.getLogger("pdserve.engine.worker_proc")


@dataclass
class RemoteError:
    """An exception raised in a worker, in a form that always survives pickling."""

    rank: int
    pid: int
    summary: str  # "ValueError: ..."
    traceback: str
    exception: bytes | None  # the pickled exception when it pickles and unpickles cleanly

    @classmethod
    def capture(cls, rank: int, exc: BaseException) -> "RemoteError":
        blob: bytes | None
        try:
            blob = pickle.dumps(exc)
            pickle.loads(blob)  # some exceptions pickle but cannot be rebuilt; find out here
        except Exception:
            blob = None
        summary = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return cls(rank, os.getpid(), summary, "".join(traceback.format_exception(exc)), blob)

    def rebuild(self) -> BaseException:
        """The original exception when possible (so callers can catch ValueError and the like),
        else a RuntimeError; either way the worker's traceback is attached as a note."""
        exc: BaseException | None = None
        if self.exception is not None:
            try:
                exc = pickle.loads(self.exception)
            except Exception:
                exc = None
        if not isinstance(exc, BaseException):
            exc = RuntimeError(f"worker rank {self.rank} (pid {self.pid}) raised {self.summary}")
        exc.add_note(f"raised in tensor-parallel worker rank {self.rank} (pid {self.pid}); its traceback:\n"
                     f"{self.traceback.rstrip()}")
        return exc


def worker_main(config: Any, rank: int, distributed_init_method: str, broadcast_handle: Any,
                status_conn: Connection, death_conn: Connection, num_threads: int | None) -> None:
    """Entry point of the spawned process."""
    # Ctrl-C reaches the whole process group; the parent owns shutdown and will tell us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM (the parent's terminate() for a straggler) should run finally blocks and unlink our queue.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    _configure_logging(rank)
    parent_gone = threading.Event()
    threading.Thread(target=_watch_parent, args=(death_conn, parent_gone), name="parent-watch",
                     daemon=True).start()
    proc = WorkerProc(config, rank, distributed_init_method, broadcast_handle, status_conn, parent_gone,
                      num_threads)
    sys.exit(proc.run())


def _configure_logging(rank: int) -> None:
    root = logging.getLogger("pdserve")
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [tp rank {rank} pid %(process)d] "
                                           f"%(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(os.environ.get("PDSERVE_LOG_LEVEL", "WARNING").upper())


def _watch_parent(death_conn: Connection, parent_gone: threading.Event) -> None:
    # The parent never writes to this pipe: recv() returns only with EOF, when the parent's end is
    # closed, which the kernel does for it when it dies, however it dies.
    try:
        death_conn.recv()
    except (EOFError, OSError):
        pass
    parent_gone.set()
    time.sleep(PARENT_GONE_GRACE_S)
    os._exit(1)


class WorkerProc:
    def __init__(self, config: Any, rank: int, distributed_init_method: str, broadcast_handle: Any,
                 status_conn: Connection, parent_gone: threading.Event, num_threads: int | None) -> None:
        self.config = config
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.broadcast_handle = broadcast_handle
        self.status_conn = status_conn
        self.parent_gone = parent_gone
        self.num_threads = num_threads
        self.worker: Any = None
        self.broadcast: Any = None
        self.response: Any = None

    def run(self) -> int:
        try:
            try:
                self._start()
            except BaseException as exc:  # noqa: BLE001 - every startup failure goes to the parent
                self._report(STATUS_ERROR, RemoteError.capture(self.rank, exc))
                return 1
            return self._serve()
        finally:
            self._close()

    def _start(self) -> None:
        import torch

        from pdserve.engine.executor.shm_queue import ShmMessageQueue
        from pdserve.engine.worker.worker import Worker

        if self.num_threads is not None:
            # The ranks share the machine's cores: each takes its share instead of all of them.
            torch.set_num_threads(self.num_threads)
        self.worker = Worker(self.config, self.rank, self.distributed_init_method)
        self.worker.init_device()
        self.worker.load_model()
        self.broadcast = ShmMessageQueue.attach(self.broadcast_handle, self.rank)
        self.response = ShmMessageQueue.create(1)
        self.status_conn.send((STATUS_READY, self.response.handle()))
        self.broadcast.wait_until_ready(HANDSHAKE_TIMEOUT_S)
        self.response.wait_until_ready(HANDSHAKE_TIMEOUT_S)
        log.info("worker ready")

    def _serve(self) -> int:
        from pdserve.engine.executor.shm_queue import QueueCancelled, QueueClosed

        cancel = self.parent_gone.is_set
        while True:
            try:
                method, args, kwargs, reply_rank = self.broadcast.dequeue(cancel=cancel)
            except (QueueCancelled, QueueClosed):
                log.warning("executor went away; exiting")
                return 1
            if method == SHUTDOWN:
                return 0
            answers = reply_rank is None or reply_rank == self.rank
            try:
                result = self.worker.call(method, *args, **(kwargs or {}))
            except Exception as exc:  # noqa: BLE001
                error = RemoteError.capture(self.rank, exc)
                if not answers:
                    # Nobody is listening for our reply, and our state may now differ from the
                    # other ranks' (a half-applied step): carry on and we would corrupt or hang
                    # the next collective. Exit, so the executor reports this rank as dead.
                    log.error("%s failed on a rank that does not reply; exiting\n%s", method, error.traceback)
                    self._report(STATUS_FATAL, error)
                    return EXIT_FATAL
                reply: tuple = (REPLY_ERROR, error)
            else:
                if not answers:
                    continue
                reply = (REPLY_OK, result)
            try:
                try:
                    self.response.enqueue(reply, cancel=cancel)
                except (QueueCancelled, QueueClosed):
                    raise
                except Exception as exc:  # noqa: BLE001 - e.g. a result that does not pickle
                    # Pickling happens before anything is written, so the queue is still in step.
                    self.response.enqueue((REPLY_ERROR, RemoteError.capture(self.rank, exc)), cancel=cancel)
            except (QueueCancelled, QueueClosed):
                log.warning("executor went away; exiting")
                return 1

    def _report(self, kind: str, payload: Any) -> None:
        try:
            self.status_conn.send((kind, payload))
        except (OSError, ValueError):
            pass  # the parent is gone; nobody to tell

    def _close(self) -> None:
        if self.parent_gone.is_set():
            # The executor that owned the broadcast queue's socket file cannot remove it any more.
            # Its shared memory is left to the resource tracker, which unlinks what a dead process
            # registered once every process sharing the tracker has exited.
            ipc_files.remove_socket(self.broadcast_handle.zmq_address)
        if self.worker is not None:
            try:
                self.worker.shutdown()
            except Exception:  # noqa: BLE001 - a broken process group must not keep us alive
                log.exception("worker shutdown failed")
        for queue in (self.broadcast, self.response):
            if queue is not None:
                queue.close()
        self.status_conn.close()
