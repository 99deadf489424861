"""A one-writer, many-reader message queue in shared memory, for the EngineCore and its TP workers.

The multiprocess executor broadcasts every scheduler step to all tensor-parallel workers and
collects one reply per worker. Those messages are small (a few KB to a few hundred KB) and
latency-critical (one per engine step), so they go through a ring of chunks in a POSIX
shared-memory segment instead of a socket: the writer pickles the message straight into a chunk,
every reader copies it out once, and nobody makes a system call on the fast path (the writer
makes one only to wake a reader that went to sleep, see _wait).

Layout of the segment (all offsets 64-byte aligned so that flags of different chunks never share a
cache line)::

    control   magic, version, n_readers, max_chunks, max_chunk_bytes, closed flag;
              an "attached" byte per reader; an "asleep" byte per reader
    metadata  per chunk: [written flag][read flag of reader 0] ... [read flag of reader N-1]
    data      per chunk: [kind u8, 7 pad][payload length u64][payload: max_chunk_bytes]

A raw payload is the bytes; a pickled one is [buffer count u32, 4 pad][stream length u64][pickle
stream][buffer lengths u64 ...][out-of-band buffers ...].

Protocol, for chunk c (the writer and each reader walk the ring in the same order):

* the writer may (re)fill c when ``written == 0`` (never used) or every read flag is 1. It then
  stores ``written = 0``, clears the read flags, copies the payload, and stores ``written = 1``;
* reader r takes c when its own read flag is 0 and ``written == 1``; it copies the message out and
  stores its read flag = 1. Only reader r ever sets that flag and only the writer clears it, and the
  writer clears it only after it saw it set, so no byte has two concurrent writers.

A reader that falls behind holds its read flag at 0, so after ``max_chunks`` unread messages the
writer blocks (back-pressure); nothing is ever overwritten.

Messages larger than a chunk travel over a ZMQ PUB socket (XPUB, so the writer can count
subscriptions); the chunk then carries only a marker saying "the next message is on the socket".
Because the marker takes its place in the ring, order is preserved, and because a reader receives
the socket message before it releases the marker's chunk, at most ``max_chunks`` socket messages
are ever queued per reader (the socket high-water marks are unlimited: a PUB socket drops messages
at its HWM, and we must never lose one).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pickle
import platform
import struct
import sys
import threading
import time
import weakref
from multiprocessing import shared_memory
from typing import Any, Callable

import msgspec
import zmq

from pdserve.engine import ipc_files

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "DEFAULT_MAX_CHUNKS",
    "QueueCancelled",
    "QueueClosed",
    "QueueHandle",
    "ShmMessageQueue",
]

# One chunk holds one message. 1 MiB covers every regular engine message (a scheduler step with
# a few long new prompts is a few hundred KB, a step's sampled tokens and logprobs tens of KB);
# anything bigger is rare and takes the socket. 16 chunks let the writer run 16 messages ahead of
# the slowest reader (the engine is at most a couple of steps ahead, plus utility calls) before it
# blocks. The segment is 16 MiB of address space per queue, but tmpfs allocates pages only when
# touched, so a queue of small messages costs a few pages per chunk; that matters in containers,
# whose /dev/shm is often only 64 MiB.
DEFAULT_MAX_CHUNK_BYTES = 1 << 20
DEFAULT_MAX_CHUNKS = 16

# How a waiter waits (see _wait). An engine step takes tens of milliseconds, and this code runs on
# machines with fewer cores than busy processes (2 cores: an EngineCore, its workers, a frontend):
#
# * spin, a few polls only: when the peer shares our core, spinning just delays it. Measured
#   1 KB round trips with both processes pinned to one core: ~40 µs with SPIN_S <= 3 µs, ~55 µs
#   with 10 µs, ~100 µs with 30 µs (230 µs with 100 µs); on two cores all give ~15 µs;
# * sched_yield() until YIELD_S: as quick as spinning for a peer on another core (the call
#   returns at once when nothing else wants our core), and hands our core to a peer that needs
#   it. It burns up to YIELD_S of CPU per wait (2.5% of a 20 ms step);
# * then sleep. On Linux the sleeps are futex waits on the chunk the reader waits for, and the
#   writer wakes sleepers when it publishes, so a sleeping reader notices a message one scheduler
#   wake-up after it arrives (tens of µs on bare metal, ~0.15 ms on our 2-core VM) and costs
#   nothing meanwhile. It still wakes every FUTEX_NAP_S to check cancel(), its timeout and
#   "closed", and every FUTEX_IDLE_NAP_S once the wait is older than IDLE_AFTER_S (nothing was
#   due: the worker is idle), because each wake-up costs 50-100 µs of CPU on a VM;
# * where there is no futex (or PDSERVE_SHM_QUEUE_FUTEX=0), and for the writer waiting on a slow
#   reader (back-pressure, rare), plain sleeps back off from SLEEP_START_S to HOT_SLEEP_CAP_S, so
#   a message is still noticed within about half a millisecond during a busy wait, and after
#   IDLE_AFTER_S to IDLE_SLEEP_CAP_S (the first message after an idle spell pays up to that).
#
# Measured on the 2-core VM (benchmarks/bench_queue.py): waiting out 20 ms steps costs ~5% of a
# core with the futex (half of it the yield phase) and ~6.5% without; an idle reader ~0.7% over
# its first 6 s (the first second at FUTEX_NAP_S), less after.
SPIN_S = 3e-6
YIELD_S = 500e-6
SLEEP_START_S = 50e-6
HOT_SLEEP_CAP_S = 500e-6
IDLE_AFTER_S = 1.0
IDLE_SLEEP_CAP_S = 20e-3
FUTEX_NAP_S = 5e-3
FUTEX_IDLE_NAP_S = 50e-3
CANCEL_EVERY_S = 1e-3  # cancel() may cost a system call (is_alive); call it at most this often

_MAGIC = 0x51534450  # "PDSQ"
_VERSION = 2
_CONTROL = struct.Struct("<IHHIIQ")  # magic, version, n_readers, max_chunks, pad, max_chunk_bytes
_CLOSED_OFF = 24
_WAKES_OFF = 25  # 1 if the writer wakes sleeping readers (it has the futex): only then may they nap long
_ATTACHED_OFF = 64  # one byte per reader; then, 64-byte aligned, one "asleep" byte per reader
_HDR = struct.Struct("<B7xQ")  # kind, payload length
_PICKLE_PREFIX = struct.Struct("<I4xQ")  # out-of-band buffer count, length of the pickle stream
_FRONT = struct.Struct("<B7xQI4xQ")  # _HDR then _PICKLE_PREFIX: one unpack on the reader's fast path
_U64 = struct.Struct("<Q")

# Message kinds, stored in the chunk header.
_RAW = 1  # bytes in the chunk
_PICKLE = 2  # _PICKLE_PREFIX, the pickle stream, n out-of-band buffer lengths (u64), the buffers
_REMOTE_RAW = 4  # the bytes are the next message on the socket
_REMOTE_PICKLE = 5  # the next socket message is [pickle stream, *out-of-band buffers]

_READY = b"pdserve-shm-queue-ready"
_SOCKET_LINGER_MS = 1000  # let queued large messages reach live readers when the writer closes


class QueueCancelled(Exception):
    """The `cancel` callback returned True while waiting (for instance: a peer process died)."""


class QueueClosed(EOFError):
    """The writer closed the queue and every message it sent has been read."""


class QueueHandle(msgspec.Struct, frozen=True):
    """Everything a reader needs to attach, in another process (picklable, msgpack-encodable)."""

    shm_name: str
    n_readers: int
    max_chunks: int
    max_chunk_bytes: int
    zmq_address: str


# Memory ordering. The protocol needs the payload stores to become visible before the flag store
# that publishes them, and a reader's flag load to happen before its payload loads (and its
# payload loads before the store that releases the chunk). CPython never reorders: every
# memoryview access is a separate C call the compiler cannot move others across. The CPU might:
# x86-64 (TSO) keeps stores in order with stores, loads with loads, and loads before later stores,
# which is all this protocol relies on (it never needs a store to be ordered before a later load),
# and glibc ends its non-temporal memcpy path with an sfence; so x86 issues no fence at all.
# ARM and POWER reorder freely, and Python has no fence instruction, so there we borrow one from a
# lock: acquire has acquire semantics and release has release semantics, and a release followed
# by an acquire is ordered too (AArch64 LDAR after STLR), so acquire-release-acquire-release
# orders every access before it against every access after it. About 1 µs, three per message on
# each side; on x86 that would be most of the cost of a small message, hence the switch.
_TSO = platform.machine().lower() in {"x86_64", "amd64", "i386", "i486", "i586", "i686", "x86"}
_fence_lock = threading.Lock()


def _lock_fence() -> None:
    _fence_lock.acquire()
    _fence_lock.release()
    _fence_lock.acquire()
    _fence_lock.release()


_NEEDS_FENCE = not _TSO


def _full_fence() -> None:
    """Orders earlier stores before later loads too (what waking a sleeper needs), on x86 as well:
    there the lock's compare-and-swap is a locked instruction, a full barrier by itself."""
    _fence_lock.acquire()
    _fence_lock.release()


if not _TSO:
    _full_fence = _lock_fence  # noqa: F811


# Waking sleepers. A reader about to sleep stores its "asleep" byte, then (full fence) reads the
# futex word (the 4 bytes at its next chunk's written flag) and checks once more for a message;
# the writer stores written = 1, then (full fence) reads the "asleep" bytes and, if any is set,
# wakes that word. With both fences one of the two must see the other's store, so either the
# reader finds the message or the writer wakes it; and if the publish lands between the reader's
# read of the word and its futex wait, the kernel sees the word changed and does not sleep. The
# writer's fence is a lock round trip (~0.3 µs) on every message; the wake system call happens
# only when a reader is actually asleep.
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98, "loongarch64": 98,
              "ppc64le": 221, "ppc64": 221, "s390x": 238, "i386": 240, "i686": 240, "armv7l": 240}
_U32 = struct.Struct("=I")  # the kernel compares the futex word as a native-endian u32


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Futex:
    """futex(2) on words of the shared segment (not FUTEX_PRIVATE: other processes map it)."""

    def __init__(self, syscall: Any, number: int) -> None:
        self._syscall = syscall
        self._number = number

    def wait(self, address: int, expected: int, seconds: float) -> None:
        # Returns on a wake-up, a timeout, a signal, or at once if the word is no longer
        # `expected`; the caller re-checks its condition in every case.
        whole = int(seconds)
        timeout = _Timespec(whole, int((seconds - whole) * 1e9))
        self._syscall(self._number, address, _FUTEX_WAIT, expected, ctypes.byref(timeout), None, 0)

    def wake(self, address: int) -> None:
        self._syscall(self._number, address, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


def _load_futex() -> _Futex | None:
    number = _SYS_FUTEX.get(platform.machine().lower())
    if not sys.platform.startswith("linux") or number is None:
        return None  # elsewhere readers just sleep with backoff
    if os.environ.get("PDSERVE_SHM_QUEUE_FUTEX", "1") == "0":
        return None  # to compare, or to rule it out
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32,
                        ctypes.POINTER(_Timespec), ctypes.c_void_p, ctypes.c_uint32]
    return _Futex(syscall, number)


_FUTEX = _load_futex()


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


class _Layout:
    def __init__(self, n_readers: int, max_chunks: int, max_chunk_bytes: int) -> None:
        if n_readers < 1:
            raise ValueError("n_readers must be at least 1")
        if max_chunks < 1:
            raise ValueError("max_chunks must be at least 1")
        if max_chunk_bytes < _PICKLE_PREFIX.size:
            raise ValueError(f"max_chunk_bytes must be at least {_PICKLE_PREFIX.size}")
        self.asleep = _ATTACHED_OFF + _align(n_readers)
        control = self.asleep + _align(n_readers)
        meta_stride = _align(1 + n_readers)
        data_start = _align(control + meta_stride * max_chunks, 4096)
        data_stride = _align(_HDR.size + max_chunk_bytes)
        self.written = [control + c * meta_stride for c in range(max_chunks)]
        self.read = [w + 1 for w in self.written]
        self.data = [data_start + c * data_stride for c in range(max_chunks)]
        self.size = data_start + data_stride * max_chunks


def _open_segment(name: str) -> tuple[Any, memoryview]:
    """Map an existing segment without telling the resource tracker.

    Python 3.11's SharedMemory(name) registers the segment with the resource tracker, which then
    unlinks it when *this* process's tracker exits: a reader would destroy the writer's segment,
    or warn about a "leak" it does not own. Unregistering afterwards is no cure: processes started
    with multiprocessing share their parent's tracker, whose record is a set, so the reader's
    unregister would drop the writer's own registration and the writer's unlink would then fail
    inside the tracker (a KeyError traceback on stderr). So readers map the segment themselves and
    the tracker only ever hears about it from the writer.
    """
    try:
        import _posixshmem
    except ImportError:  # Windows: no tracker there, SharedMemory is fine
        shm = shared_memory.SharedMemory(name=name)
        return shm, shm.buf
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    try:
        mm = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    return mm, memoryview(mm)


class _Resources:
    """What close() and the exit-time finalizer release; holds no reference to the queue."""

    def __init__(self) -> None:
        self.buf: memoryview | None = None
        self.mapping: Any = None  # SharedMemory (writer) or mmap (reader)
        self.unlink = False
        self.socket: zmq.Socket | None = None
        self.ipc_path: str | None = None
        self.anchor: Any = None  # a ctypes view giving the mapping's address; pins the buffer
        self.wake_on_close: list[int] = []  # writer: futex words that sleeping readers wait on
        self.futex: _Futex | None = None

    def release(self) -> None:
        self.anchor = None
        sock, self.socket = self.socket, None
        if sock is not None:
            try:
                sock.close(linger=_SOCKET_LINGER_MS if self.unlink else 0)
            except zmq.ZMQError:
                pass
        buf, self.buf = self.buf, None
        mapping, self.mapping = self.mapping, None
        if mapping is not None:
            if self.unlink and buf is not None:
                buf[_CLOSED_OFF] = 1  # readers drain what is left, then raise QueueClosed
                if self.futex is not None:
                    _full_fence()
                    for address in self.wake_on_close:
                        self.futex.wake(address)
            if isinstance(mapping, shared_memory.SharedMemory):
                try:
                    mapping.close()
                except BufferError:  # a view still exported somewhere; the mapping dies with it
                    pass
                if self.unlink:
                    try:
                        mapping.unlink()
                    except FileNotFoundError:
                        pass
            else:
                if buf is not None:
                    buf.release()
                try:
                    mapping.close()
                except BufferError:
                    pass
        if self.ipc_path is not None:
            ipc_files.remove_socket(self.ipc_path)
            self.ipc_path = None


class _ChunkSink:
    """The file a queue's pickler writes to: the claimed chunk, or, once the message outgrows
    the chunk, a list of pieces bound for the socket."""

    __slots__ = ("buf", "start", "pos", "end", "spill")

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.start = self.pos = self.end = 0
        self.spill: list[bytes] | None = None

    def reset(self, start: int, end: int) -> None:
        self.start = self.pos = start
        self.end = end
        self.spill = None

    def write(self, data: Any) -> int:
        if type(data) is bytes:
            n = len(data)
        else:
            data = _flat(data)
            n = data.nbytes
        if self.spill is None:
            pos = self.pos
            if pos + n <= self.end:
                self.buf[pos:pos + n] = data
                self.pos = pos + n
                return n
            self.spill = [bytes(self.buf[self.start:pos])]
        self.spill.append(data if type(data) is bytes else bytes(data))
        return n


def _flat(data: Any) -> memoryview:
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")  # raises TypeError for non-contiguous buffers, as it should
    return view


class ShmMessageQueue:
    """One writer, `n_readers` readers; every reader receives every message, in order.

    Create it in the writer with `create()`, pass `handle()` to each reader process, `attach()`
    there with a distinct rank, and call `wait_until_ready()` on all sides before traffic. A queue
    object is meant for one thread at a time.
    """

    def __init__(self, handle: QueueHandle, layout: _Layout, resources: _Resources, reader_rank: int | None):
        self._handle = handle
        self._buf: memoryview = resources.buf  # type: ignore[assignment]
        self._sock: zmq.Socket = resources.socket  # type: ignore[assignment]
        self._rank = reader_rank
        self._pos = 0
        self._ready = False
        self._closed = False
        self._subscribed = 0  # writer: subscriptions seen on the XPUB socket
        self._n_chunks = handle.max_chunks
        self._capacity = handle.max_chunk_bytes
        # Per chunk, the offsets this side touches, looked up once per message.
        if reader_rank is None:
            self._slots = [(w, r, r + handle.n_readers, d) for w, r, d in zip(layout.written, layout.read, layout.data)]
        else:
            self._slots = [(r + reader_rank, w, d) for w, r, d in zip(layout.written, layout.read, layout.data)]
        # Futex words live in the mapping; ctypes needs their addresses. (The anchor is dropped
        # before the mapping is closed, which an exported buffer would otherwise prevent.)
        # A reader naps on the futex only if this writer will wake it (both normally agree; the
        # flag keeps a mismatch from turning into 50 ms naps).
        self._futex = _FUTEX if reader_rank is None or self._buf[_WAKES_OFF] else None
        resources.anchor = ctypes.c_char.from_buffer(self._buf)
        self._base = ctypes.addressof(resources.anchor)
        asleep = layout.asleep
        if reader_rank is None:
            self._asleep = (asleep, asleep + handle.n_readers)
            resources.futex = self._futex
            resources.wake_on_close = [self._base + w for w in layout.written]
        else:
            self._asleep_flag = asleep + reader_rank
        self._ones = b"\x01" * handle.n_readers
        self._zeros = bytes(handle.n_readers)
        # One pickler per queue, reused (memo cleared per message): building one costs more than
        # pickling a small message.
        self._oob: list[pickle.PickleBuffer] = []
        self._sink = _ChunkSink(self._buf)
        self._pickler = pickle.Pickler(self._sink, protocol=5, buffer_callback=self._oob.append)
        self._inband_pickler: pickle.Pickler | None = None
        self._finalizer = weakref.finalize(self, resources.release)

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(cls, n_readers: int, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
               max_chunks: int = DEFAULT_MAX_CHUNKS) -> "ShmMessageQueue":
        """Make the segment and the overflow socket; the caller is the writer."""
        layout = _Layout(n_readers, max_chunks, max_chunk_bytes)
        res = _Resources()
        res.unlink = True
        try:
            shm = shared_memory.SharedMemory(name=ipc_files.segment_name("queue"), create=True, size=layout.size)
            res.mapping, res.buf = shm, shm.buf
            _CONTROL.pack_into(shm.buf, 0, _MAGIC, _VERSION, n_readers, max_chunks, 0, max_chunk_bytes)
            shm.buf[_WAKES_OFF] = _FUTEX is not None
            sock = zmq.Context.instance().socket(zmq.XPUB)
            res.socket = sock
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # one subscription message per reader, not per topic
            address = _bind(sock, res)
        except BaseException:
            res.release()
            raise
        handle = QueueHandle(shm_name=shm.name, n_readers=n_readers, max_chunks=max_chunks,
                             max_chunk_bytes=max_chunk_bytes, zmq_address=address)
        return cls(handle, layout, res, None)

    def handle(self) -> QueueHandle:
        return self._handle

    @classmethod
    def attach(cls, handle: QueueHandle, reader_rank: int) -> "ShmMessageQueue":
        """Map the writer's segment and subscribe to its overflow socket, as reader `reader_rank`."""
        if not 0 <= reader_rank < handle.n_readers:
            raise ValueError(f"reader_rank {reader_rank} out of range for {handle.n_readers} readers")
        layout = _Layout(handle.n_readers, handle.max_chunks, handle.max_chunk_bytes)
        res = _Resources()
        try:
            res.mapping, res.buf = _open_segment(handle.shm_name)
            buf = res.buf
            if len(buf) < layout.size:
                raise ValueError(f"shared memory {handle.shm_name} is smaller than its handle describes")
            magic, version, n_readers, max_chunks, _, max_chunk_bytes = _CONTROL.unpack_from(buf, 0)
            if (magic, version) != (_MAGIC, _VERSION) or (n_readers, max_chunks, max_chunk_bytes) != (
                    handle.n_readers, handle.max_chunks, handle.max_chunk_bytes):
                raise ValueError(f"shared memory {handle.shm_name} does not match its handle")
            if buf[_ATTACHED_OFF + reader_rank]:
                raise ValueError(f"reader rank {reader_rank} is already attached to {handle.shm_name}")
            buf[_ATTACHED_OFF + reader_rank] = 1
            sock = zmq.Context.instance().socket(zmq.SUB)
            res.socket = sock
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(handle.zmq_address)
        except BaseException:
            res.release()
            raise
        return cls(handle, layout, res, reader_rank)

    def wait_until_ready(self, timeout: float = 30.0) -> None:
        """Return once every reader is attached and subscribed (call it in the writer and every reader).

        The writer counts subscriptions on its XPUB socket and then publishes a ready message;
        a reader returns when it receives that message, which proves its subscription is live,
        so no later overflow message can be dropped for want of a subscriber.
        """
        if self._ready:
            return
        self._check_open()
        deadline = time.monotonic() + timeout
        sock = self._sock
        if self._rank is None:
            while self._subscribed < self._handle.n_readers:
                if not sock.poll(_poll_ms(deadline)):
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"only {self._subscribed} of {self._handle.n_readers} readers "
                                           f"subscribed within {timeout} s")
                    continue
                event = sock.recv()
                if event[:1] == b"\x01":
                    self._subscribed += 1
            sock.send(_READY)
        else:
            while True:
                if sock.poll(_poll_ms(deadline)):
                    if sock.recv() != _READY:
                        raise RuntimeError("unexpected message before the ready message")
                    break
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the writer did not report ready within {timeout} s")
        self._ready = True

    # ------------------------------------------------------------------ writer

    def enqueue(self, obj: Any, timeout: float | None = None, cancel: Callable[[], bool] | None = None) -> None:
        """Pickle `obj` (protocol 5) and send it.

        The pickler writes straight into the claimed chunk, and out-of-band buffers (numpy arrays
        and the like) are copied in after the stream: no intermediate bytes object, which for a
        large message costs more than the copy itself. A message that outgrows the chunk is
        collected as it is written and goes over the socket instead.
        """
        written, data = self._claim(timeout, cancel)
        start = data + _HDR.size
        body = start + _PICKLE_PREFIX.size
        end = start + self._capacity
        sink, oob = self._sink, self._oob
        try:
            sink.reset(body, end)
            self._pickler.clear_memo()
            self._pickler.dump(obj)
            raws = []
            if oob:
                try:
                    raws = [b.raw() for b in oob]
                except BufferError:  # a non-contiguous out-of-band buffer: keep everything in-band
                    raws = []
                    sink.reset(body, end)
                    if self._inband_pickler is None:
                        self._inband_pickler = pickle.Pickler(sink, protocol=5)
                    self._inband_pickler.clear_memo()
                    self._inband_pickler.dump(obj)
        finally:
            oob.clear()  # the raw views keep what they need alive; drop the caller's objects
        buf = self._buf
        if sink.spill is None:
            pos = sink.pos
            if raws:
                tail = pos + 8 * len(raws) + sum(r.nbytes for r in raws)
            if not raws or tail <= end:
                _PICKLE_PREFIX.pack_into(buf, start, len(raws), pos - body)
                for r in raws:
                    _U64.pack_into(buf, pos, r.nbytes)
                    pos += 8
                for r in raws:
                    buf[pos:pos + r.nbytes] = r
                    pos += r.nbytes
                _HDR.pack_into(buf, data, _PICKLE, pos - start)
                self._publish(written)
                return
            stream = bytes(buf[body:pos])
        else:
            stream = b"".join(sink.spill)
            sink.spill = None
        # The stream is ours and immutable: sent without a copy. The out-of-band buffers belong
        # to the caller, who may change them as soon as we return: copied.
        self._send_remote([stream, *raws], [False] + [True] * len(raws))
        _HDR.pack_into(buf, data, _REMOTE_PICKLE, len(stream) + sum(r.nbytes for r in raws))
        self._publish(written)

    def enqueue_bytes(self, data: bytes | bytearray | memoryview, timeout: float | None = None,
                      cancel: Callable[[], bool] | None = None) -> None:
        """Send bytes as they are (for callers that already hold msgpack); readers get bytes back."""
        immutable = type(data) is bytes
        view = data if immutable else _flat(data)
        n = len(view) if immutable else view.nbytes
        written, offset = self._claim(timeout, cancel)
        buf = self._buf
        if n <= self._capacity:
            start = offset + _HDR.size
            buf[start:start + n] = view
            _HDR.pack_into(buf, offset, _RAW, n)
        else:
            self._send_remote([view], [not immutable])
            _HDR.pack_into(buf, offset, _REMOTE_RAW, n)
        self._publish(written)

    def _publish(self, written: int) -> None:
        """Flag the claimed chunk as written, wake sleeping readers, move to the next chunk."""
        if _NEEDS_FENCE:
            _lock_fence()  # the payload is visible before the flag that publishes it
        self._buf[written] = 1
        if self._futex is not None:
            self._wake_sleepers(written)
        self._advance()

    def _claim(self, timeout: float | None, cancel: Callable[[], bool] | None) -> tuple[int, int]:
        """Wait until the next chunk is free and take it from the readers: (written flag, data offset).

        Whatever happens between this and publishing (a pickling error, a timeout on the ready
        handshake) leaves the chunk unpublished with written == 0: free for the next attempt.
        """
        buf = self._buf
        if buf is None:
            raise ValueError("queue is closed")
        if self._rank is not None:
            raise RuntimeError("a reader cannot enqueue")
        written, read0, read1, data = self._slots[self._pos]
        ones = self._ones
        if buf[written] and buf[read0:read1] != ones:

            def free() -> bool:
                return buf[written] == 0 or buf[read0:read1] == ones

            _wait(free, _deadline(timeout), cancel, None, "the slowest reader to free a chunk")
        if _NEEDS_FENCE:
            _lock_fence()  # the readers' last loads of this chunk come before our stores
        buf[written] = 0
        if _NEEDS_FENCE:
            _lock_fence()  # readers must see written == 0 before they see their read flag cleared
        buf[read0:read1] = self._zeros
        return written, data

    def _wake_sleepers(self, written: int) -> None:
        _full_fence()  # our written = 1 store before our loads of the "asleep" bytes
        a0, a1 = self._asleep
        if self._buf[a0:a1] != self._zeros:
            self._futex.wake(self._base + written)  # type: ignore[union-attr]

    def _advance(self) -> None:
        c = self._pos + 1
        self._pos = c if c < self._n_chunks else 0

    def _send_remote(self, frames: list, copies: list[bool]) -> None:
        # Sent before the marker is published, so a reader that sees the marker finds the
        # message already on its way.
        if not self._ready:
            self.wait_until_ready()
        sock = self._sock
        last = len(frames) - 1
        for i, (frame, copy) in enumerate(zip(frames, copies)):
            sock.send(frame, zmq.SNDMORE if i < last else 0, copy=copy)

    # ------------------------------------------------------------------ reader

    def dequeue(self, timeout: float | None = None, cancel: Callable[[], bool] | None = None) -> Any:
        """Return the next message: the unpickled object, or bytes if it was sent with enqueue_bytes."""
        return self._recv(timeout, cancel, False)

    def dequeue_bytes(self, timeout: float | None = None, cancel: Callable[[], bool] | None = None) -> bytes:
        """Return the next message, which must have been sent with enqueue_bytes.

        A pickled message raises TypeError and stays in the queue (dequeue() still gets it).
        """
        return self._recv(timeout, cancel, True)

    def _recv(self, timeout: float | None, cancel: Callable[[], bool] | None, raw_only: bool) -> Any:
        buf = self._buf
        if buf is None:
            raise ValueError("queue is closed")
        if self._rank is None:
            raise RuntimeError("the writer cannot dequeue")
        own, written, data = self._slots[self._pos]
        deadline: float | None = None
        while True:
            if buf[own] or buf[written] != 1:
                if deadline is None:
                    deadline = _deadline(timeout)
                self._wait_for_message(own, written, deadline, cancel)
            if not _NEEDS_FENCE:
                break  # loads stay in program order: own == 0, then written == 1, is a real observation
            # Our read flag at 0 means the writer cleared it (or it was never set), and the writer
            # stored written = 0 before clearing it; so written == 1 seen *after* that load,
            # fenced, can only be the store that follows this round's payload.
            _lock_fence()
            if buf[written] == 1:
                break
        if _NEEDS_FENCE:
            _lock_fence()  # payload loads after the flag loads
        kind, length, count, stream_len = _FRONT.unpack_from(buf, data)
        start = data + _HDR.size
        if kind == _PICKLE:
            if raw_only:
                raise TypeError("the next message was pickled (sent with enqueue); read it with dequeue()")
            body = start + _PICKLE_PREFIX.size
            try:
                if not count:
                    return pickle.loads(buf[body:body + stream_len])
                return _loads_oob(buf, body, stream_len, count)
            finally:
                # Consumed even if unpickling failed: a message that cannot be read must not wedge
                # the queue.
                if _NEEDS_FENCE:
                    _lock_fence()  # our payload loads are done before the writer may reuse the chunk
                buf[own] = 1
                self._advance()
        if kind == _RAW:
            out = bytes(buf[start:start + length])
            if _NEEDS_FENCE:
                _lock_fence()
            buf[own] = 1
            self._advance()
            return out
        if kind == _REMOTE_RAW or kind == _REMOTE_PICKLE:
            if raw_only and kind == _REMOTE_PICKLE:
                raise TypeError("the next message was pickled (sent with enqueue); read it with dequeue()")
            if not self._ready:
                self.wait_until_ready(_remaining(deadline, 30.0))
            if deadline is None:
                deadline = _deadline(timeout)
            frames = self._recv_socket(deadline, cancel)  # raises before we release: retried next time
            if _NEEDS_FENCE:
                _lock_fence()
            buf[own] = 1
            self._advance()
            if kind == _REMOTE_RAW:
                return frames[0].bytes
            return pickle.loads(frames[0].buffer, buffers=[bytearray(f.buffer) for f in frames[1:]])
        raise RuntimeError(f"corrupt queue: unknown message kind {kind} in chunk {self._pos}")

    def _wait_for_message(self, own: int, written: int, deadline: float | None,
                          cancel: Callable[[], bool] | None) -> None:
        buf = self._buf

        def ready() -> bool:
            return buf[own] == 0 and buf[written] == 1

        nap = None
        futex = self._futex
        if futex is not None:
            flag = self._asleep_flag
            address = self._base + written

            def nap(seconds: float) -> None:
                buf[flag] = 1
                try:
                    _full_fence()  # our "asleep" store before our loads of the flags
                    expected = _U32.unpack_from(buf, written)[0]
                    if not ready():
                        futex.wait(address, expected, seconds)
                finally:
                    buf[flag] = 0

        _wait(ready, deadline, cancel, self._writer_closed, "a message", nap)

    def _recv_socket(self, deadline: float | None, cancel: Callable[[], bool] | None) -> list:
        sock = self._sock
        while True:
            # The message was sent before its marker was published: it is normally here already.
            if sock.poll(0 if deadline is not None and deadline <= time.monotonic() else
                         min(_poll_ms(deadline), max(1, int(CANCEL_EVERY_S * 1000)))):
                return sock.recv_multipart(copy=False)
            if cancel is not None and cancel():
                raise QueueCancelled("cancelled while waiting for an overflow message")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError("timed out waiting for an overflow message on the socket")

    def _writer_closed(self) -> bool:
        return self._buf[_CLOSED_OFF] == 1

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Writer: mark the queue closed and unlink the segment. Reader: detach. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._buf = self._sink.buf = None  # type: ignore[assignment]
        self._sock = None  # type: ignore[assignment]
        self._finalizer()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("queue is closed")

    def __enter__(self) -> "ShmMessageQueue":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def is_writer(self) -> bool:
        return self._rank is None

    @property
    def reader_rank(self) -> int | None:
        return self._rank

    def __repr__(self) -> str:
        role = "writer" if self._rank is None else f"reader {self._rank}"
        return (f"ShmMessageQueue({self._handle.shm_name}, {role}, {self._handle.n_readers} readers, "
                f"{self._handle.max_chunks} x {self._handle.max_chunk_bytes} B{', closed' if self._closed else ''})")


def _loads_oob(buf: memoryview, body: int, stream_len: int, count: int) -> Any:
    pos = body + stream_len
    lengths = struct.unpack_from(f"<{count}Q", buf, pos)
    pos += 8 * count
    # Copied out (bytearray, so arrays come back writable): the chunk is about to be reused.
    buffers = []
    for n in lengths:
        buffers.append(bytearray(buf[pos:pos + n]))
        pos += n
    return pickle.loads(buf[body:body + stream_len], buffers=buffers)


def _bind(sock: zmq.Socket, res: _Resources) -> str:
    # ipc is the faster transport for the large messages that come this way; tcp on loopback
    # where ipc is missing or the socket path would be too long for sockaddr_un.
    if zmq.has("ipc"):
        path = ipc_files.socket_path("queue")
        if len(path) < 100:
            address = f"ipc://{path}"
            sock.bind(address)
            res.ipc_path = path
            return address
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    return f"tcp://127.0.0.1:{port}"


_sched_yield = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))


def _deadline(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if timeout < 0:
        raise ValueError("timeout must be non-negative or None")
    return time.monotonic() + timeout


def _remaining(deadline: float | None, default: float) -> float:
    return default if deadline is None else max(0.0, deadline - time.monotonic())


def _poll_ms(deadline: float | None) -> int:
    if deadline is None:
        return 100
    return max(0, min(100, int((deadline - time.monotonic()) * 1000 + 0.999)))


def _wait(ready: Callable[[], bool], deadline: float | None, cancel: Callable[[], bool] | None,
          closed: Callable[[], bool] | None, what: str, nap: Callable[[float], None] | None = None) -> None:
    """Return once ready() is true: spin, then yield, then sleep with capped backoff (see SPIN_S).

    With `nap` (a sleep the writer cuts short), the sleeps are naps of FUTEX_NAP_S or
    FUTEX_IDLE_NAP_S instead.

    Raises TimeoutError at `deadline` (time.monotonic()), QueueCancelled when cancel() is true,
    QueueClosed when closed() is true and ready() stays false.
    """
    now = start = time.monotonic()
    next_check = start  # cancel and closed are checked on the first slow iteration, then every ms
    sleep_s = SLEEP_START_S
    sched_yield = _sched_yield
    while True:
        if ready():
            return
        now = time.monotonic()
        if now >= next_check:
            next_check = now + CANCEL_EVERY_S
            if cancel is not None and cancel():
                raise QueueCancelled(f"cancelled while waiting for {what}")
            if closed is not None and closed():
                if _NEEDS_FENCE:
                    _lock_fence()  # closed is stored after the last message is published
                if ready():
                    return
                raise QueueClosed("the writer closed the queue")
        if deadline is not None and now >= deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        waited = now - start
        if waited < SPIN_S:
            continue
        if waited < YIELD_S:
            sched_yield()
            continue
        if nap is not None:
            seconds = FUTEX_NAP_S if waited < IDLE_AFTER_S else FUTEX_IDLE_NAP_S
            nap(seconds if deadline is None else max(min(seconds, deadline - now), 0.0))
            continue
        time.sleep(sleep_s if deadline is None else max(min(sleep_s, deadline - now), 0.0))
        sleep_s = min(sleep_s * 2, HOT_SLEEP_CAP_S if waited < IDLE_AFTER_S else IDLE_SLEEP_CAP_S)
