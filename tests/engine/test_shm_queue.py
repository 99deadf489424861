"""The shared-memory message queue between the EngineCore and its tensor-parallel workers.

Readers in other processes are started with the 'spawn' context, as the executor does. pytest
imports this file under a name spawned children cannot import, so a child runs this file afresh
with runpy under the name CHILD_RUN_NAME and the bottom of the file dispatches to its role.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import pickle
import random
import runpy
import struct
import subprocess
import sys
import threading
import time
from array import array

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.executor.shm_queue import (
    QueueCancelled,
    QueueClosed,
    QueueHandle,
    ShmMessageQueue,
)

CHILD_RUN_NAME = "__shm_queue_test_child__"
SPAWN = mp.get_context("spawn")
SHM_DIR = "/dev/shm"


def _spawn(role: str, *args) -> mp.Process:
    proc = SPAWN.Process(target=runpy.run_path, args=(__file__,),
                         kwargs={"run_name": CHILD_RUN_NAME, "init_globals": {"CHILD_ROLE": (role, args)}},
                         daemon=True)
    proc.start()
    return proc


def _ready_all(writer: ShmMessageQueue, readers: list[ShmMessageQueue]) -> None:
    # In one process the writer's and the readers' handshakes must run concurrently.
    t = threading.Thread(target=writer.wait_until_ready, kwargs={"timeout": 30})
    t.start()
    for r in readers:
        r.wait_until_ready(timeout=30)
    t.join()


@pytest.fixture
def queue_factory():
    made: list[ShmMessageQueue] = []

    def make(n_readers: int = 1, **kwargs) -> tuple[ShmMessageQueue, list[ShmMessageQueue]]:
        writer = ShmMessageQueue.create(n_readers, **kwargs)
        made.append(writer)
        readers = [ShmMessageQueue.attach(writer.handle(), rank) for rank in range(n_readers)]
        made.extend(readers)
        _ready_all(writer, readers)
        return writer, readers

    yield make
    for q in reversed(made):
        q.close()


# --------------------------------------------------------------------------- 1. the test

N_MESSAGES = 10_000
CHUNK = 32 * 1024
SEED = 20240611


def _message_sizes(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    sizes = []
    for _ in range(n):
        u = rng.random()
        if u < 0.70:
            sizes.append(rng.randint(0, 100))  # most engine messages are tiny
        elif u < 0.90:
            sizes.append(rng.randint(101, 4096))
        elif u < 0.98:
            sizes.append(rng.randint(4097, CHUNK - 256))  # fills most of a chunk
        else:
            sizes.append(rng.randint(CHUNK + 1, 5 * CHUNK // 2))  # over a chunk: the ZMQ fallback
    return sizes


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def _expected_sequence_digest(n: int) -> str:
    h = hashlib.blake2b(digest_size=16)
    for seq in range(n):
        h.update(struct.pack("<Q", seq))
    return h.hexdigest()


_RAW_HEADER = struct.Struct("<Q16s")


def _child_stress_reader(handle: QueueHandle, rank: int, results) -> None:
    """Read N_MESSAGES, verifying order and checksums; report count, sequence digest, errors."""
    queue = ShmMessageQueue.attach(handle, rank)
    queue.wait_until_ready(timeout=120)
    seq_hash = hashlib.blake2b(digest_size=16)
    errors: list[str] = []
    count = 0
    oversized = 0
    try:
        for expected in range(N_MESSAGES):
            msg = queue.dequeue(timeout=120)
            # Three encodings, chosen by the writer from the sequence number: a pickled tuple with
            # bytes, raw bytes with a header, a pickled tuple with a numpy array (out-of-band).
            if isinstance(msg, bytes):
                seq, digest = _RAW_HEADER.unpack_from(msg)
                payload = msg[_RAW_HEADER.size:]
            else:
                seq, digest, payload = msg
                if isinstance(payload, np.ndarray):
                    payload = payload.tobytes()
            if seq != expected:
                errors.append(f"reader {rank}: got seq {seq}, expected {expected}")
            if _digest(payload) != digest:
                errors.append(f"reader {rank}: checksum mismatch at seq {seq}")
            if len(payload) > CHUNK:
                oversized += 1
            seq_hash.update(struct.pack("<Q", seq))
            count += 1
            if len(errors) > 20:
                break
    except Exception as exc:  # reported, not raised: the parent asserts on the report
        errors.append(f"reader {rank}: {type(exc).__name__}: {exc}")
    finally:
        queue.close()
    results.put({"rank": rank, "count": count, "seq_digest": seq_hash.hexdigest(), "errors": errors,
                 "oversized": oversized})


def test_one_writer_three_readers_10k_random_messages_in_order():
    n_readers = 3
    sizes = _message_sizes(SEED, N_MESSAGES)
    assert sum(s > CHUNK for s in sizes) >= 100 and sum(s <= 100 for s in sizes) >= 6000
    writer = ShmMessageQueue.create(n_readers, max_chunk_bytes=CHUNK, max_chunks=8)
    results = SPAWN.Queue()
    procs = [_spawn("stress_reader", writer.handle(), rank, results) for rank in range(n_readers)]
    try:
        def reader_died() -> bool:
            return any(p.exitcode is not None for p in procs)

        writer.wait_until_ready(timeout=120)
        rng = random.Random(SEED + 1)
        for seq, size in enumerate(sizes):
            payload = rng.randbytes(size)
            digest = _digest(payload)
            kind = seq % 3
            if kind == 0:
                writer.enqueue((seq, digest, payload), timeout=120, cancel=reader_died)
            elif kind == 1:
                writer.enqueue_bytes(_RAW_HEADER.pack(seq, digest) + payload, timeout=120, cancel=reader_died)
            else:
                writer.enqueue((seq, digest, np.frombuffer(payload, dtype=np.uint8)), timeout=120,
                               cancel=reader_died)
        reports = sorted((results.get(timeout=120) for _ in range(n_readers)), key=lambda r: r["rank"])
        for p in procs:
            p.join(timeout=60)
    finally:
        writer.close()
        for p in procs:
            if p.is_alive():
                p.kill()
    expected_digest = _expected_sequence_digest(N_MESSAGES)
    assert [r["rank"] for r in reports] == [0, 1, 2]
    for report in reports:
        assert report["errors"] == []
        assert report["count"] == N_MESSAGES
        assert report["seq_digest"] == expected_digest
        assert report["oversized"] == sum(s > CHUNK for s in sizes)
    assert [p.exitcode for p in procs] == [0, 0, 0]


# --------------------------------------------------------------------------- 2. back-pressure


def test_writer_blocks_when_a_reader_lags_and_nothing_is_overwritten(queue_factory):
    writer, (fast, slow) = queue_factory(2, max_chunk_bytes=1024, max_chunks=4)
    big = b"B" * 5000  # over a chunk: its marker takes a ring slot like any other message
    sent = [0, big, 2, 3]
    for m in sent:
        writer.enqueue(m, timeout=5)
    assert [fast.dequeue(timeout=5) for _ in range(4)] == sent
    # `slow` has read nothing: all four chunks are unread, the writer must wait, not overwrite.
    with pytest.raises(TimeoutError):
        writer.enqueue(4, timeout=0.2)
    with pytest.raises(TimeoutError):
        writer.enqueue_bytes(b"4", timeout=0)
    with pytest.raises(TimeoutError):
        fast.dequeue(timeout=0.05)  # the failed enqueues sent nothing
    assert slow.dequeue(timeout=5) == 0
    writer.enqueue(4, timeout=5)  # one chunk freed, one message fits
    with pytest.raises(TimeoutError):
        writer.enqueue(5, timeout=0.1)
    assert [slow.dequeue(timeout=5) for _ in range(4)] == [big, 2, 3, 4]
    assert fast.dequeue(timeout=5) == 4
    writer.enqueue(5, timeout=5)
    assert fast.dequeue(timeout=5) == slow.dequeue(timeout=5) == 5


def _child_paused_reader(handle: QueueHandle, results, go) -> None:
    queue = ShmMessageQueue.attach(handle, 0)
    queue.wait_until_ready(timeout=120)
    go.wait(120)  # paused until the parent has seen the writer block
    results.put([queue.dequeue(timeout=60) for _ in range(12)])
    queue.close()


def _paused_message(i: int):
    return bytes(1000) + bytes([i]) if i % 4 == 0 and i >= 4 else i  # some take the socket


@pytest.mark.parametrize("futex", [True, False], ids=["futex", "sleep"])
def test_back_pressure_across_processes(futex, monkeypatch):
    if not futex:  # both sides: this process's queues, and the child through its environment
        from pdserve.engine.executor import shm_queue

        monkeypatch.setattr(shm_queue, "_FUTEX", None)
        monkeypatch.setenv("PDSERVE_SHM_QUEUE_FUTEX", "0")
    writer = ShmMessageQueue.create(1, max_chunk_bytes=256, max_chunks=3)
    results, go = SPAWN.Queue(), SPAWN.Event()
    proc = _spawn("paused_reader", writer.handle(), results, go)
    try:
        writer.wait_until_ready(timeout=120)
        for i in range(3):
            writer.enqueue(i, timeout=10)
        with pytest.raises(TimeoutError):
            writer.enqueue(3, timeout=0.2)
        go.set()
        for i in range(3, 12):
            writer.enqueue(_paused_message(i), timeout=60)
        got = results.get(timeout=120)
        proc.join(timeout=60)
    finally:
        writer.close()
        if proc.is_alive():
            proc.kill()
    assert got == [_paused_message(i) for i in range(12)]
    assert proc.exitcode == 0


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 2), st.sampled_from([0, 10, 300, 2000])), max_size=60))
def test_ring_against_a_model(ops):
    """Random interleavings against a list-per-reader model: FIFO per reader, and the writer is
    blocked exactly when some reader has max_chunks unread messages."""
    max_chunks, n_readers = 3, 2
    writer = ShmMessageQueue.create(n_readers, max_chunk_bytes=512, max_chunks=max_chunks)
    readers = [ShmMessageQueue.attach(writer.handle(), r) for r in range(n_readers)]
    try:
        _ready_all(writer, readers)
        pending: list[list[bytes]] = [[] for _ in range(n_readers)]
        counter = 0
        for who, size in ops:
            if who == n_readers:  # the writer
                counter += 1
                msg = counter.to_bytes(4, "little") * (size // 4 + 1)
                if max(len(p) for p in pending) == max_chunks:
                    with pytest.raises(TimeoutError):
                        writer.enqueue_bytes(msg, timeout=0)
                else:
                    writer.enqueue_bytes(msg, timeout=5)
                    for p in pending:
                        p.append(msg)
            elif pending[who]:
                assert readers[who].dequeue_bytes(timeout=5) == pending[who].pop(0)
            else:
                with pytest.raises(TimeoutError):
                    readers[who].dequeue_bytes(timeout=0)
        for r, p in zip(readers, pending):
            assert [r.dequeue_bytes(timeout=5) for _ in p] == p
    finally:
        for q in [writer, *readers]:
            q.close()


# --------------------------------------------------------------------------- 3. cancel and timeout


def test_cancel_interrupts_a_blocked_dequeue(queue_factory):
    writer, (reader,) = queue_factory(1, max_chunk_bytes=1024, max_chunks=2)
    stop = threading.Event()
    timer = threading.Timer(0.2, stop.set)
    timer.start()
    with pytest.raises(QueueCancelled):
        reader.dequeue(timeout=60, cancel=stop.is_set)
    timer.join()
    # The queue is intact afterwards.
    writer.enqueue("after")
    assert reader.dequeue(timeout=5) == "after"


def test_cancel_interrupts_a_blocked_enqueue(queue_factory):
    writer, (reader,) = queue_factory(1, max_chunk_bytes=1024, max_chunks=2)
    writer.enqueue(1)
    writer.enqueue(2)
    calls = []

    def cancel() -> bool:
        calls.append(1)
        return len(calls) >= 3

    with pytest.raises(QueueCancelled):
        writer.enqueue(3, timeout=60, cancel=cancel)
    assert [reader.dequeue(timeout=5) for _ in range(2)] == [1, 2]
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=0)


def test_cancel_checked_by_a_process_liveness_probe():
    """The executor's use: a dequeue that waits on a worker that dies raises instead of hanging."""
    queue = ShmMessageQueue.create(1, max_chunk_bytes=1024, max_chunks=2)
    reader = ShmMessageQueue.attach(queue.handle(), 0)
    try:
        _ready_all(queue, [reader])
        worker = SPAWN.Process(target=time.sleep, args=(0.3,), daemon=True)
        worker.start()
        with pytest.raises(QueueCancelled):
            reader.dequeue(timeout=120, cancel=lambda: not worker.is_alive())
        worker.join()
    finally:
        reader.close()
        queue.close()


@pytest.mark.parametrize("mode", ["futex", "sleep", "writer-without-futex"])
def test_a_sleeping_reader_is_woken_by_the_writer(mode, monkeypatch):
    """Readers waiting long enough go to sleep; a message must wake them, not wait for the end of
    their nap (made a minute long here, so only a wake-up can deliver within the test). A reader
    whose writer does not wake sleepers must not take such naps at all."""
    from pdserve.engine.executor import shm_queue

    futex = shm_queue._FUTEX
    assert futex is not None or not sys.platform.startswith("linux"), "no futex on Linux"
    monkeypatch.setattr(shm_queue, "FUTEX_NAP_S", 60.0)
    if mode != "futex":
        monkeypatch.setattr(shm_queue, "_FUTEX", None)
    writer = ShmMessageQueue.create(2, max_chunk_bytes=1024, max_chunks=2)
    if mode == "writer-without-futex":
        monkeypatch.setattr(shm_queue, "_FUTEX", futex)
    readers = [ShmMessageQueue.attach(writer.handle(), r) for r in range(2)]
    got: list[list] = [[], []]
    try:
        _ready_all(writer, readers)
        threads = [threading.Thread(target=lambda r=r: got[r.reader_rank].extend(r.dequeue() for _ in range(3)),
                                    daemon=True) for r in readers]
        for t in threads:
            t.start()
        for i in range(3):
            time.sleep(0.1)  # long past the spin and yield phases: the readers are asleep
            writer.enqueue(i if i != 1 else "y" * 3000)  # the middle one by the socket
        for t in threads:
            t.join(timeout=20)
        assert not any(t.is_alive() for t in threads), "a sleeping reader was not woken"
        assert got == [[0, "y" * 3000, 2]] * 2
    finally:
        for q in [writer, *readers]:
            q.close()


def test_timeouts(queue_factory):
    writer, (reader,) = queue_factory(1, max_chunk_bytes=1024, max_chunks=2)
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=0)
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=0.05)
    with pytest.raises(TimeoutError):
        reader.dequeue_bytes(timeout=0.05, cancel=lambda: False)
    with pytest.raises(ValueError):
        reader.dequeue(timeout=-1)
    writer.enqueue("x", timeout=0)
    writer.enqueue("y", timeout=0)
    with pytest.raises(TimeoutError):
        writer.enqueue("z", timeout=0.05)
    assert reader.dequeue(timeout=0) == "x"
    assert reader.dequeue(timeout=0) == "y"


# --------------------------------------------------------------------------- 4. payloads


@pytest.mark.parametrize("size", [0, 1, 100, 1000, 4096 - 1, 4096, 4097, 50_000])
def test_raw_bytes_round_trip(queue_factory, size):
    writer, readers = queue_factory(2, max_chunk_bytes=4096, max_chunks=4)
    data = os.urandom(size)
    writer.enqueue_bytes(data)
    writer.enqueue_bytes(bytearray(data))
    writer.enqueue_bytes(memoryview(data))
    for r in readers:
        got = [r.dequeue_bytes(timeout=5) for _ in range(3)]
        assert got == [data] * 3 and all(type(g) is bytes for g in got)


def test_raw_bytes_of_other_buffer_formats(queue_factory):
    writer, (reader,) = queue_factory(1, max_chunk_bytes=4096, max_chunks=4)
    doubles = array("d", [1.5, -2.0, 3.25])
    writer.enqueue_bytes(memoryview(doubles))
    writer.enqueue_bytes(np.arange(12, dtype=np.int32).reshape(3, 4))
    writer.enqueue_bytes(memoryview(b"abcdef")[1:4])
    assert reader.dequeue_bytes(timeout=5) == doubles.tobytes()
    assert reader.dequeue_bytes(timeout=5) == np.arange(12, dtype=np.int32).tobytes()
    assert reader.dequeue_bytes(timeout=5) == b"bcd"
    # dequeue() also returns raw messages, as bytes.
    writer.enqueue_bytes(b"\x80\x05not a pickle")
    assert reader.dequeue(timeout=5) == b"\x80\x05not a pickle"


def test_raw_bytes_sender_may_reuse_its_buffer(queue_factory):
    writer, (reader,) = queue_factory(1, max_chunk_bytes=1024, max_chunks=4)
    scratch = bytearray(b"a" * 3000)  # over a chunk: goes by the socket
    writer.enqueue_bytes(scratch)
    scratch[:] = b"b" * 3000
    small = bytearray(b"c" * 10)
    writer.enqueue_bytes(small)
    small[:] = b"d" * 10
    assert reader.dequeue_bytes(timeout=5) == b"a" * 3000
    assert reader.dequeue_bytes(timeout=5) == b"c" * 10


def test_dequeue_bytes_refuses_a_pickled_message_without_consuming_it(queue_factory):
    writer, (reader,) = queue_factory(1, max_chunk_bytes=1024, max_chunks=4)
    writer.enqueue({"k": 1})
    writer.enqueue(list(range(1000)))  # over a chunk
    with pytest.raises(TypeError):
        reader.dequeue_bytes(timeout=5)
    assert reader.dequeue(timeout=5) == {"k": 1}
    with pytest.raises(TypeError):
        reader.dequeue_bytes(timeout=5)
    assert reader.dequeue(timeout=5) == list(range(1000))


ARRAYS = [
    np.arange(10, dtype=np.int64),
    np.random.default_rng(0).standard_normal((64, 33)).astype(np.float32),
    np.asfortranarray(np.arange(600, dtype=np.float64).reshape(20, 30)),
    np.arange(400, dtype=np.int16).reshape(20, 20)[::2, 1::3],  # not contiguous
    np.array(3.5),
    np.zeros((0, 7), dtype=np.uint8),
    np.array([True, False, True]),
    np.arange(30_000, dtype=np.float32),  # over a chunk
]


@pytest.mark.parametrize("index", range(len(ARRAYS)))
def test_pickle_round_trips_numpy_arrays(queue_factory, index):
    writer, readers = queue_factory(2, max_chunk_bytes=16 * 1024, max_chunks=4)
    arr = ARRAYS[index]
    writer.enqueue(arr)
    writer.enqueue({"arr": arr, "tag": "nested", "twice": [arr, arr]})
    for r in readers:
        got = r.dequeue(timeout=5)
        assert got.dtype == arr.dtype and got.shape == arr.shape
        np.testing.assert_array_equal(got, arr)
        if got.size:
            assert got.flags.writeable
        nested = r.dequeue(timeout=5)
        assert nested["tag"] == "nested"
        np.testing.assert_array_equal(nested["arr"], arr)
        np.testing.assert_array_equal(nested["twice"][1], arr)


TENSORS = [
    torch.arange(10, dtype=torch.int64),
    torch.randn(32, 16, generator=torch.Generator().manual_seed(0)),
    torch.randn(8, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
    torch.arange(100, dtype=torch.float32).reshape(10, 10).t(),  # not contiguous
    torch.tensor(7),
    torch.randn(40_000, generator=torch.Generator().manual_seed(2)),  # over a chunk
]


@pytest.mark.parametrize("index", range(len(TENSORS)))
def test_pickle_round_trips_torch_tensors(queue_factory, index):
    writer, (reader,) = queue_factory(1, max_chunk_bytes=16 * 1024, max_chunks=4)
    t = TENSORS[index]
    writer.enqueue(t)
    writer.enqueue(("step", 3, {"logits": t}))
    got = reader.dequeue(timeout=5)
    assert got.dtype == t.dtype and got.shape == t.shape
    assert torch.equal(got, t)
    step = reader.dequeue(timeout=5)
    assert step[:2] == ("step", 3) and torch.equal(step[2]["logits"], t)


def test_pickle_round_trips_ordinary_objects(queue_factory):
    writer, (reader,) = queue_factory(1, max_chunk_bytes=2048, max_chunks=16)
    objs = [None, 0, "héllo", b"", (1, [2, {3: 4.5}]), {"set": {1, 2}}, ValueError("boom"),
            "x" * 10_000, list(range(5000))]
    for o in objs:
        writer.enqueue(o, timeout=5)
    got = [reader.dequeue(timeout=5) for _ in objs]
    assert got[:5] == objs[:5] and got[5] == objs[5]
    assert isinstance(got[6], ValueError) and got[6].args == ("boom",)
    assert got[7:] == objs[7:]


class _Unpicklable:
    def __reduce__(self):
        return (_explode, ())


def _explode():
    raise RuntimeError("cannot rebuild")


def test_a_message_that_fails_to_unpickle_does_not_wedge_the_queue(queue_factory):
    writer, (reader,) = queue_factory(1, max_chunk_bytes=1024, max_chunks=2)
    writer.enqueue(_Unpicklable())
    writer.enqueue("next")
    with pytest.raises(RuntimeError, match="cannot rebuild"):
        reader.dequeue(timeout=5)
    assert reader.dequeue(timeout=5) == "next"


def test_a_message_that_fails_to_pickle_leaves_the_queue_usable(queue_factory):
    writer, (reader,) = queue_factory(1, max_chunk_bytes=1024, max_chunks=2)
    strided = memoryview(bytearray(range(100)))[::2]
    for _ in range(3):  # more failures than chunks: a failed enqueue must not use one up
        with pytest.raises(Exception):
            writer.enqueue(lambda: 0, timeout=1)
        with pytest.raises(Exception):
            writer.enqueue(["x" * 3000, pickle.PickleBuffer(strided)], timeout=1)  # fails after spilling
    writer.enqueue("ok", timeout=1)
    writer.enqueue(pickle.PickleBuffer(bytearray(b"out of band")), timeout=1)
    assert reader.dequeue(timeout=5) == "ok"
    assert reader.dequeue(timeout=5) == bytearray(b"out of band")
    with pytest.raises(TimeoutError):
        reader.dequeue(timeout=0)


def test_handle_is_picklable_and_msgpack_encodable(queue_factory):
    writer, _ = queue_factory(1, max_chunk_bytes=1024, max_chunks=2)
    h = writer.handle()
    assert pickle.loads(pickle.dumps(h)) == h
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(h), type=QueueHandle) == h


def test_misuse_is_refused(queue_factory):
    writer, (reader, _) = queue_factory(2, max_chunk_bytes=1024, max_chunks=2)
    with pytest.raises(ValueError):
        ShmMessageQueue.attach(writer.handle(), 2)
    with pytest.raises(ValueError):
        ShmMessageQueue.create(0)
    with pytest.raises(RuntimeError):
        writer.dequeue(timeout=0)
    with pytest.raises(RuntimeError):
        reader.enqueue("no", timeout=0)


def test_a_rank_attaches_once(queue_factory):
    writer, (reader,) = queue_factory(1, max_chunk_bytes=1024, max_chunks=2)
    with pytest.raises(ValueError, match="already attached"):
        ShmMessageQueue.attach(writer.handle(), 0)


def test_the_fenced_protocol_used_off_x86(queue_factory, monkeypatch):
    """x86 needs no fences; the ARM/POWER path (lock-based fences, re-check of the written flag)
    must still deliver everything, so run it here too."""
    from pdserve.engine.executor import shm_queue

    monkeypatch.setattr(shm_queue, "_NEEDS_FENCE", True)
    writer, readers = queue_factory(2, max_chunk_bytes=2048, max_chunks=3)
    msgs = [b"a", {"b": np.arange(5)}, b"c" * 5000, "d" * 3000, b"e" * 100]
    for i, m in enumerate(msgs):
        (writer.enqueue_bytes if isinstance(m, bytes) else writer.enqueue)(m, timeout=5)
        for r in readers:
            got = r.dequeue(timeout=5)
            if isinstance(m, dict):
                np.testing.assert_array_equal(got["b"], m["b"])
            else:
                assert got == m
    writer.close()
    for r in readers:
        with pytest.raises(QueueClosed):
            r.dequeue(timeout=5)


# --------------------------------------------------------------------------- 5. lifecycle


def _ipc_path(handle: QueueHandle) -> str | None:
    return handle.zmq_address[len("ipc://"):] if handle.zmq_address.startswith("ipc://") else None


def test_close_removes_the_segment_and_readers_drain_then_see_closed():
    writer = ShmMessageQueue.create(2, max_chunk_bytes=1024, max_chunks=4)
    handle = writer.handle()
    path = os.path.join(SHM_DIR, handle.shm_name)
    assert os.path.exists(path)
    readers = [ShmMessageQueue.attach(handle, r) for r in range(2)]
    _ready_all(writer, readers)
    writer.enqueue("last words")
    writer.close()
    assert not os.path.exists(path)
    ipc = _ipc_path(handle)
    assert ipc is None or not os.path.exists(ipc)
    writer.close()  # idempotent
    for r in readers:
        assert r.dequeue(timeout=5) == "last words"
        with pytest.raises(QueueClosed):
            r.dequeue(timeout=5)
        r.close()
        r.close()
    with pytest.raises(ValueError):
        readers[0].dequeue(timeout=0)
    with pytest.raises(FileNotFoundError):
        ShmMessageQueue.attach(handle, 0)


def test_reader_close_leaves_the_segment_to_the_writer(queue_factory):
    writer, (reader,) = queue_factory(1, max_chunk_bytes=1024, max_chunks=2)
    path = os.path.join(SHM_DIR, writer.handle().shm_name)
    reader.close()
    assert os.path.exists(path)
    writer.enqueue("still fine")
    writer.close()
    assert not os.path.exists(path)


def test_no_leak_and_no_resource_tracker_complaints_across_processes():
    """A writer with a spawned reader, in a fresh interpreter whose stderr we can read: the segment
    is gone after close and the resource tracker (shared by parent and spawned child) neither
    warns about leaks nor fails on a double unregister."""
    env = dict(os.environ, PYTHONSAFEPATH="1")
    proc = subprocess.run([sys.executable, __file__, "tracker-check"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split()
    assert lines[0] == "OK"
    name = lines[1]
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    for word in ("leaked", "resource_tracker", "Traceback", "KeyError", "Warning"):
        assert word not in proc.stderr, proc.stderr


def _tracker_check_reader(handle: QueueHandle) -> None:
    queue = ShmMessageQueue.attach(handle, 0)
    queue.wait_until_ready(timeout=120)
    assert queue.dequeue(timeout=60) == "hello"
    assert queue.dequeue(timeout=60) == b"x" * 5000
    queue.close()


def _tracker_check_main() -> None:
    writer = ShmMessageQueue.create(2, max_chunk_bytes=1024, max_chunks=2)
    # One reader closes explicitly; the other just exits (the finalizer detaches it).
    procs = [SPAWN.Process(target=_tracker_check_reader, args=(writer.handle(),)),
             SPAWN.Process(target=_tracker_check_exit_reader, args=(writer.handle(),))]
    for p in procs:
        p.start()
    writer.wait_until_ready(timeout=120)
    writer.enqueue("hello")
    writer.enqueue(b"x" * 5000)
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, p.exitcode
    name = writer.handle().shm_name
    writer.close()
    assert not os.path.exists(os.path.join(SHM_DIR, name))
    print("OK", name, flush=True)


def _tracker_check_exit_reader(handle: QueueHandle) -> None:
    queue = ShmMessageQueue.attach(handle, 1)
    queue.wait_until_ready(timeout=120)
    assert queue.dequeue(timeout=60) == "hello"


if __name__ == CHILD_RUN_NAME:
    _role, _args = CHILD_ROLE  # noqa: F821 (given by _spawn through runpy's init_globals)
    {"stress_reader": _child_stress_reader, "paused_reader": _child_paused_reader}[_role](*_args)

if __name__ == "__main__" and sys.argv[1:] == ["tracker-check"]:
    _tracker_check_main()
