"""The engine's load reports to the coordinator (DESIGN §5).

The EngineCore busy loop calls `LoadReporter.maybe_report` after every step and whenever it wakes
up idle. A report goes out at most every 50 ms while requests run, at once when `running` or
`waiting` changes from or to zero or a data-parallel wave starts or ends, and every second while
idle: that heartbeat is how the coordinator tells an idle engine from a dead one.

Sending never blocks the busy loop: a few reports queue (also before the first connection, so
the first report is not lost to start-up order), and a send that would block is dropped. A
dropped report's block events are not lost for good: the next report that gets through carries
the whole prefix-cache index instead of a delta (`cleared` plus every cached hash). The same
full resync follows every reconnection, so a coordinator that restarts with an empty view
learns each engine's cached blocks again.

One step can outlast the coordinator's staleness limit (a long prefill on few cores), and the busy
loop reports only between steps. `start_heartbeat` adds a thread that, when nothing has gone out
for `idle_interval`, repeats the last report with a new `seq` and `time` and no block events, so a
busy engine is never mistaken for a dead one. Both paths send under one lock (zmq sockets are not
thread-safe). It vouches only for a step younger than the step timeout: it reads the busy loop's
step clock (engine/core/liveness.py), and once the current step has run past `--step-timeout` it
stays quiet, so the coordinator marks the wedged engine stale and routers stop picking it.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from typing import TYPE_CHECKING

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from pdserve.engine import internal_auth
from pdserve.engine.core.liveness import StepClock

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.core.scheduler import Scheduler

log = logging.getLogger("pdserve.engine.load_reporter")

BUSY_INTERVAL = 0.05
IDLE_INTERVAL = 1.0
# A few reports may queue while the connection is up but slow; older ones are worth little.
SEND_HWM = 16
# Block hashes (stored + removed) in one report. A delta between two reports 50 ms apart is a few
# hundred at most; only a full resync of a very large cache comes near this, and then it carries
# this many and the rest stays unindexed until stored again (the router loses a prefix bonus for
# them, nothing else). It bounds a report to ~2.3 MB: 65,536 SHA-256 hashes of 34 bytes packed.
MAX_BLOCK_EVENTS_PER_REPORT = 65_536
MAX_HASH_BYTES = 64
# The coordinator's ZMQ_MAXMSGSIZE for reports: any report within the bounds above fits with
# room to spare; libzmq drops a peer that sends a larger frame before allocating it.
MAX_REPORT_BYTES = 8 * 2**20


class LoadReport(msgspec.Struct, gc=False):
    """One engine's load, as the coordinator receives it. Map-encoded: readers decode it by name."""

    id: str
    role: str
    address: str
    dp_rank: int
    seq: int  # grows by one per report from this engine process
    time: float  # unix time the report was made
    waiting: int
    running: int
    kv_usage: float
    step: int  # the scheduler's step counter
    wave: int = 0
    block_size: int = 16
    stored: list[bytes] = []  # block hashes indexed since the previous report
    removed: list[bytes] = []  # block hashes evicted since the previous report
    cleared: bool = False  # forget every block this engine had; `stored` then lists all it has


def parse_host_port(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); ValueError with a readable message otherwise."""
    host, sep, port_text = address.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"expected host:port, got {address!r}")
    return host, int(port_text)


def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class LoadReporter:
    def __init__(self, config: "EngineConfig", ctx: zmq.Context | None = None, *,
                 busy_interval: float = BUSY_INTERVAL, idle_interval: float = IDLE_INTERVAL) -> None:
        if not config.coordinator_address:
            raise ValueError("a LoadReporter needs config.coordinator_address")
        host, port = parse_host_port(config.coordinator_address)
        self.endpoint = tcp_endpoint(host, port)
        self.engine_id = config.engine_id
        self.role = config.engine_role
        self.address = config.advertise_address or ""
        self.block_size = config.cache.block_size
        self.dp_rank = config.parallel.data_parallel_rank
        self.wave = 0  # a lock-step data-parallel rank keeps this at its current wave
        self.busy_interval = busy_interval
        self.idle_interval = idle_interval
        self._ctx = ctx or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUSH)
        # The coordinator takes reports only from holders of the internal key (CURVE).
        internal_auth.secure_client(self._sock, internal_auth.load_internal_key())
        self._sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED)
        self._sock.connect(self.endpoint)
        self._encoder = msgspec.msgpack.Encoder()
        self.seq = 0
        self.sent = 0
        self.dropped = 0
        self.truncated = 0  # reports whose block events were cut to MAX_BLOCK_EVENTS_PER_REPORT
        self._last_attempt = -math.inf
        self._last_shape: tuple[bool, bool, int] | None = None
        self._resync = True  # the first report carries the whole index
        self._connections = 0
        self._failing = False
        self._lock = threading.Lock()
        self._last_report: LoadReport | None = None
        self._last_sent_at = -math.inf  # monotonic, real clock: the heartbeat thread's reference
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._step_clock: StepClock | None = None  # set by start_heartbeat
        self._step_timeout = 0.0
        self._withholding = False  # the heartbeat is quiet because a step overran the step timeout
        log.info("reporting load to %s as engine %s (%s)", self.endpoint, self.engine_id, self.role)

    def maybe_report(self, scheduler: "Scheduler", now: float | None = None) -> bool:
        """Send a report if one is due; True when one was sent."""
        now = time.monotonic() if now is None else now
        # Requests loading their KV from a prefill engine wait too (absent without a connector).
        running = len(scheduler.running)
        waiting = len(scheduler.waiting) + len(getattr(scheduler, "waiting_for_kv", ()))
        shape = (running > 0, waiting > 0, self.wave)
        if shape == self._last_shape:
            events = scheduler.kv_cache_manager.pool.events
            busy = running or waiting or (events is not None and events.pending)
            # While the coordinator is unreachable, retry at the idle pace: each retry is a full index.
            interval = self.busy_interval if busy and not self._failing else self.idle_interval
            if now - self._last_attempt < interval:
                return False
        self._last_attempt = now
        self._last_shape = shape
        return self._send(scheduler, running, waiting)

    def _send(self, scheduler: "Scheduler", running: int, waiting: int) -> bool:
        with self._lock:
            return self._send_locked(scheduler, running, waiting)

    def _send_locked(self, scheduler: "Scheduler", running: int, waiting: int) -> bool:
        self._poll_connections()
        pool = scheduler.kv_cache_manager.pool
        drained = pool.events.drain() if pool.events is not None else None
        if self._resync:
            # The snapshot already contains whatever the drained delta said.
            stored, removed, cleared = list(pool.cached), [], True
        elif drained is not None:
            stored, removed, cleared = drained.stored, drained.removed, drained.cleared
        else:
            stored, removed, cleared = [], [], False
        if len(stored) + len(removed) > MAX_BLOCK_EVENTS_PER_REPORT:
            # Too many changes for one report (or an index larger than one report carries): send
            # the index, truncated; the coordinator caps reports the same way.
            stored, removed, cleared = list(itertools.islice(pool.cached, MAX_BLOCK_EVENTS_PER_REPORT)), [], True
            self.truncated += 1
        self.seq += 1
        report = LoadReport(
            id=self.engine_id, role=self.role, address=self.address, dp_rank=self.dp_rank, seq=self.seq,
            time=time.time(), waiting=waiting, running=running, kv_usage=pool.usage, step=scheduler.step_counter,
            wave=self.wave,
            block_size=self.block_size, stored=stored, removed=removed, cleared=cleared)
        return self._push(report)

    def _push(self, report: LoadReport) -> bool:
        try:
            self._sock.send(self._encoder.encode(report), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            self._resync = True
            if not self._failing:
                log.warning("coordinator %s is not reachable; load reports are dropped until it is", self.endpoint)
            self._failing = True
            return False
        if self._failing:
            log.info("coordinator %s reachable again", self.endpoint)
        self._failing = False
        self._resync = False
        self.sent += 1
        self._last_report = report
        self._last_sent_at = time.monotonic()
        return True

    # -- the heartbeat thread --------------------------------------------------------------------

    def start_heartbeat(self, check_interval: float | None = None, *, step_clock: StepClock | None = None,
                        step_timeout: float = 0.0) -> None:
        """Keep reporting while the busy loop is inside a long step (see the module docstring), but
        not once `step_clock`'s step has run longer than `step_timeout` seconds (0: no limit)."""
        self._step_clock = step_clock
        self._step_timeout = step_timeout
        if self._heartbeat is None:
            interval = check_interval if check_interval is not None else self.idle_interval / 4
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, args=(interval,),
                                               name="load-heartbeat", daemon=True)
            self._heartbeat.start()

    def vouching(self) -> bool:
        """Whether the heartbeat thread may repeat the last report: no step, or one within the timeout."""
        clock, limit = self._step_clock, self._step_timeout
        if clock is None or not limit:
            return True
        age = clock.age()
        if age <= limit:
            self._withholding = False
            return True
        if not self._withholding:
            log.warning("a step has been running for %.1fs, past the step timeout of %gs: load reports stop until "
                        "it ends, so the coordinator marks this engine stale", age, limit)
        self._withholding = True
        return False

    def _heartbeat_loop(self, check_interval: float) -> None:
        while not self._stop.wait(check_interval):
            with self._lock:
                last = self._last_report
                if last is None or self._stop.is_set() or time.monotonic() - self._last_sent_at < self.idle_interval:
                    continue
                if not self.vouching():
                    continue  # a wedged core: the coordinator must see it go silent
                self._poll_connections()
                if self._resync:
                    continue  # the busy loop owes a full index; a repeat without it would not do
                self.seq += 1
                self._push(msgspec.structs.replace(last, seq=self.seq, time=time.time(), stored=[], removed=[],
                                                   cleared=False))

    def _poll_connections(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_CONNECTED:
                self._connections += 1
                # Reports queued before the first connection arrive in order; after a reconnection
                # the coordinator may be a new process, or may have missed what was in flight.
                if self._connections > 1:
                    self._resync = True

    def close(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
