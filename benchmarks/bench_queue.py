"""Shared-memory message queue vs multiprocessing.Queue vs ZMQ over ipc, between two processes.

For each transport a child process is spawned (the executor spawns its workers) and driven by
small control messages over the transport itself:

* round trip: the parent sends a payload, the child sends it back (parent->child on one channel,
  child->parent on another, for the shared-memory queue two queues); p50 and mean over many trips;
* one-way throughput: the parent sends a burst, the child acknowledges the last message;
* wake-up latency: the parent sends a timestamp every 20 ms (an engine step) and the child records
  how late it noticed: what a waiting worker pays once its wait has dropped into sleeping; and
  the CPU the child burns meanwhile;
* idle CPU: the child's CPU time while it waits two seconds for a message that does not come.

Payloads are bytes objects of 1,000 and 1,000,000 bytes. "pickle" rows send them as objects
(`enqueue`/`put`/`send(pickle.dumps)`); "bytes" rows send raw bytes (`enqueue_bytes`/`send`).
The "no futex" row runs the shared-memory queue with PDSERVE_SHM_QUEUE_FUTEX=0 (plain backoff
sleeps, as on systems without futex), to show what the futex wake-up buys.

Timings on a shared 2-core machine swing with what else runs: a round trip between processes that
happen to share a core costs several times one between two cores. Compare rows of one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import pickle
import statistics
import tempfile
import time
import uuid
from typing import Any, Callable

import multiprocessing as mp

SPAWN = mp.get_context("spawn")
# No wait is unbounded: a peer that died must fail the run, not hang it.
RECV_TIMEOUT_S = 120.0
SIZES = {"1KB": 1_000, "1MB": 1_000_000}
WAKE_GAP_S = 0.020


# --------------------------------------------------------------------------- channels
# Each has send/recv for pickled objects and send_raw/recv_raw for bytes (the same thing where the
# transport has no raw path).


class ShmChannel:
    def __init__(self, tx, rx, peer_alive: Callable[[], bool]):
        self.tx, self.rx = tx, rx
        self.peer_gone = lambda: not peer_alive()

    def send(self, obj: Any) -> None:
        self.tx.enqueue(obj, timeout=RECV_TIMEOUT_S, cancel=self.peer_gone)

    def recv(self) -> Any:
        return self.rx.dequeue(timeout=RECV_TIMEOUT_S, cancel=self.peer_gone)

    def send_raw(self, data: bytes) -> None:
        self.tx.enqueue_bytes(data, timeout=RECV_TIMEOUT_S, cancel=self.peer_gone)

    def recv_raw(self) -> bytes:
        return self.rx.dequeue_bytes(timeout=RECV_TIMEOUT_S, cancel=self.peer_gone)

    def close(self) -> None:
        self.tx.close()
        self.rx.close()


class MpQueueChannel:
    def __init__(self, tx, rx):
        self.tx, self.rx = tx, rx

    def send(self, obj: Any) -> None:
        self.tx.put(obj)

    def recv(self) -> Any:
        return self.rx.get(timeout=RECV_TIMEOUT_S)

    send_raw, recv_raw = send, recv

    def close(self) -> None:
        self.tx.close()
        self.tx.join_thread()


class ZmqChannel:
    def __init__(self, address: str, bind: bool):
        import zmq

        self.sock = zmq.Context.instance().socket(zmq.PAIR)
        # A bounded queue, like the ring and the pipe behind multiprocessing.Queue.
        self.sock.setsockopt(zmq.SNDHWM, 64)
        self.sock.setsockopt(zmq.RCVHWM, 64)
        self.sock.setsockopt(zmq.RCVTIMEO, int(RECV_TIMEOUT_S * 1000))
        self.sock.setsockopt(zmq.SNDTIMEO, int(RECV_TIMEOUT_S * 1000))
        (self.sock.bind if bind else self.sock.connect)(address)

    def send(self, obj: Any) -> None:
        self.sock.send(pickle.dumps(obj, protocol=5))

    def recv(self) -> Any:
        return pickle.loads(self.sock.recv())

    def send_raw(self, data: bytes) -> None:
        self.sock.send(data)

    def recv_raw(self) -> bytes:
        return self.sock.recv()

    def close(self) -> None:
        self.sock.close(linger=0)


# --------------------------------------------------------------------------- child side


def _child_shm(p2c_handle, setup) -> None:
    from pdserve.engine.executor.shm_queue import ShmMessageQueue

    rx = ShmMessageQueue.attach(p2c_handle, 0)
    rx.wait_until_ready()
    tx = ShmMessageQueue.create(1)
    setup.put(tx.handle())
    tx.wait_until_ready()
    parent = os.getppid()
    _serve(ShmChannel(tx, rx, lambda: os.getppid() == parent))


def _child_mpq(p2c, c2p) -> None:
    _serve(MpQueueChannel(c2p, p2c))


def _child_zmq(address: str) -> None:
    _serve(ZmqChannel(address, bind=False))


def _serve(ch) -> None:
    """The child's loop: obey control messages until "stop"."""
    while True:
        op = ch.recv()
        kind = op[0]
        if kind == "echo":
            _, n, raw = op
            rx, tx = (ch.recv_raw, ch.send_raw) if raw else (ch.recv, ch.send)
            for _ in range(n):
                tx(rx())
        elif kind == "sink":
            _, n, raw = op
            rx = ch.recv_raw if raw else ch.recv
            for _ in range(n):
                rx()
            ch.send("ok")
        elif kind == "wake":
            late = []
            cpu0, wall0 = time.process_time(), time.monotonic()
            for _ in range(op[1]):
                sent = ch.recv()
                late.append(time.monotonic() - sent)
            ch.send((late, 100.0 * (time.process_time() - cpu0) / (time.monotonic() - wall0)))
        elif kind == "idle":
            cpu0, wall0 = time.process_time(), time.monotonic()
            ch.recv()
            ch.send((time.process_time() - cpu0, time.monotonic() - wall0))
        elif kind == "stop":
            ch.close()
            return


# --------------------------------------------------------------------------- parent side


def _open_shm(futex: bool = True):
    from pdserve.engine.executor import shm_queue
    from pdserve.engine.executor.shm_queue import ShmMessageQueue

    # Without the futex on both sides: queues take the setting when made, the child at import.
    saved_futex, saved_env = shm_queue._FUTEX, os.environ.get("PDSERVE_SHM_QUEUE_FUTEX")
    if not futex:
        shm_queue._FUTEX = None
        os.environ["PDSERVE_SHM_QUEUE_FUTEX"] = "0"
    try:
        tx = ShmMessageQueue.create(1)
        setup = SPAWN.Queue()
        proc = SPAWN.Process(target=_child_shm, args=(tx.handle(), setup), daemon=True)
        proc.start()
        tx.wait_until_ready(timeout=120)
        rx = ShmMessageQueue.attach(setup.get(timeout=120), 0)
        rx.wait_until_ready(timeout=120)
    finally:
        shm_queue._FUTEX = saved_futex
        if saved_env is None:
            os.environ.pop("PDSERVE_SHM_QUEUE_FUTEX", None)
        else:
            os.environ["PDSERVE_SHM_QUEUE_FUTEX"] = saved_env
    return ShmChannel(tx, rx, proc.is_alive), proc


def _open_mpq():
    p2c, c2p = SPAWN.Queue(), SPAWN.Queue()
    proc = SPAWN.Process(target=_child_mpq, args=(p2c, c2p), daemon=True)
    proc.start()
    return MpQueueChannel(p2c, c2p), proc


def _open_zmq():
    address = f"ipc://{tempfile.gettempdir()}/bench-queue-{uuid.uuid4().hex[:12]}.sock"
    ch = ZmqChannel(address, bind=True)
    proc = SPAWN.Process(target=_child_zmq, args=(address,), daemon=True)
    proc.start()
    return ch, proc


def _round_trips(ch, payload: bytes, n: int, raw: bool) -> list[float]:
    tx, rx = (ch.send_raw, ch.recv_raw) if raw else (ch.send, ch.recv)
    warm = max(5, n // 10)
    ch.send(("echo", n + warm, raw))
    times = []
    clock = time.perf_counter
    for i in range(n + warm):
        t0 = clock()
        tx(payload)
        back = rx()
        t1 = clock()
        if i >= warm:
            times.append(t1 - t0)
    assert len(back) == len(payload)
    return times


def _throughput(ch, payload: bytes, n: int, raw: bool) -> float:
    tx = ch.send_raw if raw else ch.send
    ch.send(("sink", n, raw))
    start = time.perf_counter()
    for _ in range(n):
        tx(payload)
    assert ch.recv() == "ok"
    return n / (time.perf_counter() - start)


def _wake_latency(ch, n: int) -> tuple[list[float], float]:
    ch.send(("wake", n))
    for _ in range(n):
        time.sleep(WAKE_GAP_S)
        ch.send(time.monotonic())
    return ch.recv()


def _idle_cpu(ch, seconds: float) -> float:
    ch.send(("idle",))
    time.sleep(seconds)
    ch.send("wake up")
    cpu, wall = ch.recv()
    return 100.0 * cpu / wall


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="bench_queue", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small run (smoke test)")
    args = parser.parse_args(argv)
    q = args.quick
    counts = {
        "rtt": {"1KB": 200 if q else 3000, "1MB": 20 if q else 200},
        "tput": {"1KB": 1000 if q else 20000, "1MB": 20 if q else 300},
    }
    n_wake = 10 if q else 50
    idle_s = 0.5 if q else 2.0

    # (name, opener, [(row label, raw)], sizes) — rows sharing an opener share one child process.
    transports: list[tuple[str, Callable, list[tuple[str, bool]], list[str]]] = [
        ("shm", _open_shm, [("ShmMessageQueue (pickle)", False), ("ShmMessageQueue (bytes)", True)], list(SIZES)),
        ("shm-nofutex", lambda: _open_shm(futex=False), [("ShmMessageQueue (pickle, no futex)", False)], ["1KB"]),
        ("mpq", _open_mpq, [("multiprocessing.Queue", False)], list(SIZES)),
        ("zmq", _open_zmq, [("zmq ipc PAIR (pickle)", False), ("zmq ipc PAIR (bytes)", True)], list(SIZES)),
    ]
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for name, opener, variants, sizes in transports:
        print(f"  {name} ...", file=sys.stderr, flush=True)
        ch, proc = opener()
        try:
            ch.send(("echo", 1, False))  # the child is up and serving
            ch.send("ping")
            assert ch.recv() == "ping"
            wake, step_cpu = _wake_latency(ch, n_wake)
            idle = _idle_cpu(ch, idle_s)
            for label, raw in variants:
                for size_name in sizes:
                    size = SIZES[size_name]
                    payload = os.urandom(size)
                    rtt = _round_trips(ch, payload, counts["rtt"][size_name], raw)
                    rate = _throughput(ch, payload, counts["tput"][size_name], raw)
                    row = {
                        "transport": label,
                        "size": size_name,
                        "rtt_p50_us": statistics.median(rtt) * 1e6,
                        "rtt_mean_us": statistics.fmean(rtt) * 1e6,
                        "msgs_per_s": rate,
                        "MB_per_s": rate * size / 1e6,
                    }
                    if size_name == "1KB" and not raw:
                        row["wake_p50_us"] = statistics.median(wake) * 1e6
                        row["wake_max_us"] = max(wake) * 1e6
                        row["step_wait_cpu_pct"] = step_cpu
                        row["idle_cpu_pct"] = idle
                    rows.append(row)
            ch.send(("stop",))
            proc.join(30)
            if proc.exitcode != 0:
                raise RuntimeError(f"{name} child exited with {proc.exitcode}")
        finally:
            if proc.is_alive():
                proc.kill()
            try:
                ch.close()
            except Exception:
                pass

    baseline = {r["size"]: r for r in rows if r["transport"] == "multiprocessing.Queue"}
    for r in rows:
        base = baseline[r["size"]]
        r["rtt_speedup_vs_mpq"] = f"{base['rtt_p50_us'] / r['rtt_p50_us']:.2f}x"
        r["tput_vs_mpq"] = f"{r['msgs_per_s'] / base['msgs_per_s']:.2f}x"

    from pdserve.engine.executor import shm_queue

    columns = ["transport", "size", "rtt_p50_us", "rtt_mean_us", "rtt_speedup_vs_mpq", "msgs_per_s", "MB_per_s",
               "tput_vs_mpq", "wake_p50_us", "wake_max_us", "step_wait_cpu_pct", "idle_cpu_pct"]
    write_report = _write_report()
    write_report(
        "queue",
        rows,
        title="Message queues between two processes: round trip, one-way throughput, wake-up, idle CPU",
        columns=columns,
        meta={
            "quick": q,
            "counts": counts,
            "wake": f"{n_wake} messages, {WAKE_GAP_S * 1e3:.0f} ms apart; latency from send to the reader noticing; "
                    "step_wait_cpu_pct: the reader's CPU use meanwhile, as % of one core",
            "idle": f"child CPU time while blocked {idle_s} s on an empty channel, as % of one core",
            "shm_defaults": {"max_chunk_bytes": shm_queue.DEFAULT_MAX_CHUNK_BYTES,
                             "max_chunks": shm_queue.DEFAULT_MAX_CHUNKS},
            "shm_wait": {"spin_s": shm_queue.SPIN_S, "yield_until_s": shm_queue.YIELD_S,
                         "sleep_start_s": shm_queue.SLEEP_START_S, "hot_sleep_cap_s": shm_queue.HOT_SLEEP_CAP_S,
                         "idle_after_s": shm_queue.IDLE_AFTER_S, "idle_sleep_cap_s": shm_queue.IDLE_SLEEP_CAP_S,
                         "futex": shm_queue._FUTEX is not None, "futex_nap_s": shm_queue.FUTEX_NAP_S,
                         "futex_idle_nap_s": shm_queue.FUTEX_IDLE_NAP_S},
            "wall_s": round(time.perf_counter() - started, 1),
        },
    )


def _write_report():
    from pdserve.bench.report import write_report

    return write_report


if __name__ == "__main__":
    main(sys.argv[1:])
