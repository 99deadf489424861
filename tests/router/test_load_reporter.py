"""The engine side of the coordinator: block-index events and the load reports an engine core sends.

The reporter runs against a real Scheduler and KV cache and a real zmq PULL socket on 127.0.0.1;
only the clock is passed in, so the pacing rules are checked without sleeping.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from pdserve.cli import build_parser
from pdserve.engine import internal_auth
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig
from pdserve.engine.core.block_events import BlockEvents
from pdserve.engine.core.block_pool import BlockPool
from pdserve.engine.core.kv_cache_utils import hash_block_tokens, make_block_hasher
from pdserve.engine.core.load_reporter import LoadReport, LoadReporter, parse_host_port
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from support.server import free_port

BS = 4
DECODE = msgspec.msgpack.Decoder(LoadReport)


# --- the block pool's event recorder ------------------------------------------------------------

def test_block_pool_records_its_index_changes_only_when_asked():
    pool = BlockPool(4, enable_caching=True)
    assert pool.events is None  # an engine without a coordinator pays nothing
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"h1", b"h2"], 0, 2)
    assert set(pool.cached) == {b"h1", b"h2"}

    pool = BlockPool(4, enable_caching=True)
    events = pool.enable_events()
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, [b"h1", b"h2"], 0, 2)
    # A second block computing the same prefix is not indexed, so it is not news either.
    pool.cache_full_blocks(blocks[2:], [b"h1"], 0, 1)
    drained = events.drain()
    assert (drained.stored, drained.removed, drained.cleared) == ([b"h1", b"h2"], [], False)
    assert not events.drain()

    pool.free_blocks(reversed(blocks))  # freed blocks stay cached ...
    assert not events.pending
    pool.get_new_blocks(4)  # ... until the pool needs them
    drained = events.drain()
    assert sorted(drained.removed) == [b"h1", b"h2"] and drained.stored == []


def test_events_keep_each_hash_last_change_and_reset_clears():
    pool = BlockPool(2, enable_caching=True)
    events = pool.enable_events()
    block = pool.get_new_blocks(1)
    pool.cache_full_blocks(block, [b"a"], 0, 1)
    pool.free_blocks(block)
    pool.get_new_blocks(2)  # evicts "a" before anyone drained its storing
    drained = events.drain()
    assert (drained.stored, drained.removed) == ([], [b"a"])

    pool = BlockPool(2, enable_caching=True)
    events = pool.enable_events()
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"a", b"b"], 0, 2)
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    pool.cache_full_blocks(pool.get_new_blocks(1), [b"c"], 0, 1)
    drained = events.drain()
    assert (drained.stored, drained.removed, drained.cleared) == ([b"c"], [], True)


def test_merging_batches_gives_the_same_view_as_applying_them_one_by_one():
    batches = [([b"a", b"b"], [], False), ([b"c"], [b"a"], False), ([b"d"], [], True), ([b"a"], [b"d"], False)]
    view: set[bytes] = {b"x"}
    merged = BlockEvents()
    for stored, removed, cleared in batches:
        if cleared:
            view.clear()
        view.difference_update(removed)
        view.update(stored)
        merged.merge(stored, removed, cleared)
    out = merged.drain()
    assert out.cleared and not set(out.stored) & set(out.removed)
    assert set(out.stored) == view == {b"a"}


# --- the reporter -------------------------------------------------------------------------------

def test_coordinator_address_must_be_host_and_port(capsys):
    assert parse_host_port("coordinator.ns.svc:5557") == ("coordinator.ns.svc", 5557)
    assert parse_host_port("[::1]:5557") == ("::1", 5557)
    for bad in ("nonsense", "host:", ":5557", "host:http", "host:70000"):
        with pytest.raises(ValueError, match="host:port"):
            parse_host_port(bad)
    # `pdserve serve` refuses a bad one before it starts anything.
    argv = ["serve", "--model", "demo", "--coordinator-address"]
    parsed = build_parser(argv).parse_args([*argv, "demo-coordinator:5557"])
    assert parsed.coordinator_address == "demo-coordinator:5557"
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args([*argv, "nonsense"])
    assert "expected host:port, got 'nonsense'" in capsys.readouterr().err


@pytest.fixture
def engine_config(model_dir):
    def make(port: int) -> EngineConfig:
        model = ModelConfig.from_pretrained(model_dir("llama"), device="cpu", max_model_len=256)
        return EngineConfig(model=model, cache=CacheConfig(block_size=BS), engine_role="prefill", engine_id="e-1",
                            coordinator_address=f"127.0.0.1:{port}", advertise_address="127.0.0.1:9001")
    return make


def scheduler_for(config: EngineConfig, num_blocks: int = 32) -> Scheduler:
    scheduler = Scheduler(config, num_blocks)
    scheduler.kv_cache_manager.pool.enable_events()  # as the engine core does with a coordinator
    return scheduler


def add_request(scheduler: Scheduler, request_id: str, tokens: list[int]) -> Request:
    request = Request(request_id, tokens, SamplingParams(max_tokens=4), eos_token_id=0,
                      block_hasher=make_block_hasher(BS))
    scheduler.add_request(request)
    return request


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    internal_auth.stop_authenticator(context)
    context.destroy(linger=0)


def bind_pull(ctx: zmq.Context, port: int) -> zmq.Socket:
    """The coordinator's stats socket: a CURVE server of the session's key, as the real one."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    internal_auth.secure_server(sock, internal_auth.load_internal_key())
    for _ in range(100):  # a just-closed listener may hold the port for a moment
        try:
            sock.bind(f"tcp://127.0.0.1:{port}")
            return sock
        except zmq.ZMQError:
            time.sleep(0.05)
    raise RuntimeError(f"cannot bind {port}")


def receive(sock: zmq.Socket, timeout_ms: int = 5000) -> LoadReport:
    assert sock.poll(timeout_ms), "no report arrived"
    return DECODE.decode(sock.recv())


def nothing_more(sock: zmq.Socket) -> bool:
    return not sock.poll(100)


def test_reports_at_once_on_changes_every_50ms_when_busy_and_every_second_when_idle(ctx, engine_config):
    port = free_port()
    pull = bind_pull(ctx, port)
    config = engine_config(port)
    scheduler = scheduler_for(config)
    reporter = LoadReporter(config, ctx)
    try:
        t = 1000.0
        assert reporter.maybe_report(scheduler, t)  # the first one at once
        first = receive(pull)
        assert (first.id, first.role, first.address, first.dp_rank, first.block_size) == (
            "e-1", "prefill", "127.0.0.1:9001", 0, BS)
        assert (first.seq, first.waiting, first.running, first.wave) == (1, 0, 0, 0)
        assert first.cleared and first.stored == []  # a full (empty) index to start from
        assert abs(first.time - time.time()) < 60

        # Idle: only the heartbeat, once a second.
        assert not reporter.maybe_report(scheduler, t + 0.5)
        assert nothing_more(pull)
        assert reporter.maybe_report(scheduler, t + 1.0)
        heartbeat = receive(pull)
        assert heartbeat.seq == 2 and not heartbeat.cleared

        # waiting goes from 0 to 1: reported at once, not at the next tick.
        prompt = list(range(1, 4 * BS + 3))
        add_request(scheduler, "r1", prompt)
        assert reporter.maybe_report(scheduler, t + 1.01)
        queued = receive(pull)
        assert (queued.seq, queued.waiting, queued.running) == (3, 1, 0)

        # Scheduled: running 0 -> 1 and waiting 1 -> 0, again at once; the prompt's blocks are indexed.
        scheduler.schedule()
        assert reporter.maybe_report(scheduler, t + 1.02)
        running = receive(pull)
        assert (running.waiting, running.running, running.step) == (0, 1, scheduler.step_counter)
        assert running.stored == hash_block_tokens(prompt, BS)
        assert running.kv_usage == pytest.approx(scheduler.kv_cache_manager.usage) and running.kv_usage > 0

        # Busy with no change: at most every 50 ms.
        assert not reporter.maybe_report(scheduler, t + 1.05)
        assert reporter.maybe_report(scheduler, t + 1.071)
        tick = receive(pull)
        assert tick.seq == running.seq + 1 and tick.stored == [] and tick.running == 1

        # Finished: back to zero at once.
        scheduler.finish_requests(["r1"], RequestStatus.FINISHED_ABORTED)
        assert reporter.maybe_report(scheduler, t + 1.08)
        done = receive(pull)
        assert (done.waiting, done.running, done.kv_usage) == (0, 0, 0.0)
        assert [r.seq for r in (first, heartbeat, queued, running, tick, done)] == [1, 2, 3, 4, 5, 6]

        # A data-parallel wave starting or ending is news too (the lock-step busy loop sets it).
        reporter.wave = 3
        assert reporter.maybe_report(scheduler, t + 1.09)
        assert receive(pull).wave == 3
        assert not reporter.maybe_report(scheduler, t + 1.1)
    finally:
        reporter.close()


def test_an_unreachable_coordinator_never_blocks_and_then_gets_the_whole_index(ctx, engine_config):
    port = free_port()  # nothing listens here yet
    config = engine_config(port)
    scheduler = scheduler_for(config)
    reporter = LoadReporter(config, ctx)
    try:
        t = 1000.0
        for i in range(3):
            add_request(scheduler, f"r{i}", [i + 1] * (2 * BS + 1))
        scheduler.schedule()
        for step in range(60):  # far more than the send queue holds
            reporter.maybe_report(scheduler, t + step)
        assert reporter.dropped > 0
        scheduler.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
        add_request(scheduler, "late", [99] * (3 * BS))
        scheduler.schedule()  # indexed while the reports are dropped
        reporter.maybe_report(scheduler, t + 61)

        pull = bind_pull(ctx, port)
        seqs, resync = [], None
        deadline = time.monotonic() + 20
        step = 62
        while resync is None and time.monotonic() < deadline:
            reporter.maybe_report(scheduler, t + step)
            step += 1
            while pull.poll(50):
                report = DECODE.decode(pull.recv())
                seqs.append(report.seq)
                if report.cleared and report.seq > 1:
                    resync = report
        assert resync is not None, "no full index after the coordinator came up"
        assert seqs == sorted(seqs)  # the few queued before arrive in order, then the resync
        assert set(resync.stored) == set(scheduler.kv_cache_manager.pool.cached)
        assert set(hash_block_tokens([99] * (3 * BS), BS)) <= set(resync.stored)
    finally:
        reporter.close()


def test_a_restarted_coordinator_learns_the_whole_index_again(ctx, engine_config):
    port = free_port()
    pull = bind_pull(ctx, port)
    config = engine_config(port)
    scheduler = scheduler_for(config)
    reporter = LoadReporter(config, ctx)
    try:
        t = 1000.0
        prompt = [7] * (2 * BS)
        add_request(scheduler, "r", prompt)
        scheduler.schedule()
        reporter.maybe_report(scheduler, t)
        assert receive(pull).stored == hash_block_tokens(prompt, BS)
        reporter.maybe_report(scheduler, t + 0.1)
        assert receive(pull).stored == []  # deltas from here on

        pull.close()
        pull = bind_pull(ctx, port)  # a new coordinator process on the same address
        # Slowly enough that the send queue never fills: the reconnection alone must trigger it.
        resync = None
        for step in range(1, 15):
            reporter.maybe_report(scheduler, t + 0.1 + step * 0.1)
            if pull.poll(500):
                report = DECODE.decode(pull.recv())
                if report.cleared:
                    resync = report
                    break
        assert reporter.dropped == 0
        assert resync is not None and resync.stored == hash_block_tokens(prompt, BS)
    finally:
        pull.close()
        reporter.close()


def test_an_engine_inside_a_long_step_keeps_reporting_from_its_heartbeat_thread(ctx, engine_config):
    """The busy loop reports only between steps; a step longer than the coordinator's staleness limit
    must not make a busy engine look dead. The heartbeat repeats the last counts, without block events."""
    port = free_port()
    pull = bind_pull(ctx, port)
    config = engine_config(port)
    scheduler = scheduler_for(config)
    reporter = LoadReporter(config, ctx, idle_interval=0.3)
    reporter.start_heartbeat(check_interval=0.02)
    try:
        add_request(scheduler, "r", [5] * (2 * BS))
        scheduler.schedule()
        assert reporter.maybe_report(scheduler)
        last = receive(pull)
        assert last.running == 1 and last.stored

        time.sleep(1.0)  # "inside a step": the busy loop calls nothing
        repeats = []
        while pull.poll(100):
            repeats.append(DECODE.decode(pull.recv()))
        assert 2 <= len(repeats) <= 4, [r.seq for r in repeats]
        assert [r.seq for r in repeats] == list(range(last.seq + 1, last.seq + 1 + len(repeats)))
        assert all(r.time > last.time for r in repeats)
        for r in repeats:
            assert (r.waiting, r.running, r.step, r.kv_usage) == (last.waiting, last.running, last.step, last.kv_usage)
            assert r.stored == [] and r.removed == [] and not r.cleared

        # The busy loop's next report continues the same sequence.
        scheduler.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
        assert reporter.maybe_report(scheduler)
        assert receive(pull).seq == repeats[-1].seq + 1
    finally:
        reporter.close()
    while pull.poll(200):  # what was in flight at close
        pull.recv()
    time.sleep(0.7)  # two heartbeat intervals
    assert nothing_more(pull), "a closed reporter's heartbeat kept sending"
    pull.close()
