"""Wedged-engine detection, piece by piece (engine/core/liveness.py): the verdict the frontend
draws from a core's heartbeats, the step clock the busy loop keeps, the load reporter that stops
vouching for a step past --step-timeout, the flag, and the metrics. Real processes are in
tests/faults/test_frozen_core.py.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from pdserve.cli import build_parser
from pdserve.engine import internal_auth
from pdserve.engine.config import CacheConfig, EngineArgs, EngineConfig, ModelConfig
from pdserve.engine.core.liveness import (
    DEFAULT_STEP_TIMEOUT_S,
    HEARTBEAT_SILENCE_S,
    CoreHeartbeat,
    CoreLiveness,
    RankLiveness,
    StepClock,
    pod_unresponsive_reason,
    unresponsive_reason,
)
from pdserve.engine.core.load_reporter import LoadReport, LoadReporter
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.frontend.output_processor import IterationStats
from pdserve.engine.server.cli import engine_args_from
from pdserve.engine.server.metrics import EngineMetrics
from support.server import free_port

DECODE = msgspec.msgpack.Decoder(LoadReport)


# --- the verdict ----------------------------------------------------------------------------------

def test_a_core_is_unresponsive_when_silent_too_long_or_its_step_overruns_the_timeout():
    assert unresponsive_reason(0.4, 0.0, 10.0) is None
    assert unresponsive_reason(HEARTBEAT_SILENCE_S - 0.1, 9.9, 10.0) is None  # a long step within the limit

    silent = unresponsive_reason(4.25, 0.0, 10.0)
    assert silent is not None and "no heartbeat" in silent and "4.2 s" in silent

    stuck = unresponsive_reason(0.5, 12.0, 10.0)
    assert stuck is not None and "running for 12.0 s" in stuck and "step timeout 10 s" in stuck

    # Silence wins: a stopped core's last heartbeat may show any step age.
    assert "no heartbeat" in unresponsive_reason(5.0, 30.0, 10.0)
    # --step-timeout 0: steps may take any time, a silent core is still caught.
    assert unresponsive_reason(0.5, 1e6, 0.0) is None
    assert unresponsive_reason(5.0, 0.0, 0.0) is not None


def test_silence_counts_only_up_to_when_the_frontend_last_read_everything():
    view = CoreLiveness.starting(now=100.0)
    view.on_caught_up(101.0)
    view.on_heartbeat(CoreHeartbeat(step=7, step_running_s=0.0), now=101.2)
    assert (view.step, view.heartbeats, view.silence_s) == (7, 1, 0.0)

    # The frontend's own event loop stalls for 10 s: heartbeats wait unread in the socket, and
    # nothing has shown the socket empty since. That is not the core's fault.
    assert view.reason(step_timeout_s=5.0) is None

    # The reader finds the socket empty, again and again, with no heartbeat: now it is.
    view.on_caught_up(103.0)
    assert view.reason(5.0) is None
    view.on_caught_up(101.2 + HEARTBEAT_SILENCE_S)
    assert "no heartbeat" in view.reason(5.0)

    # A heartbeat arrives again (SIGCONT): responsive, and its step age is what counts.
    view.on_heartbeat(CoreHeartbeat(step=8, step_running_s=6.5), now=105.0)
    view.on_caught_up(105.1)
    assert "running for 6.5 s" in view.reason(5.0)
    view.on_heartbeat(CoreHeartbeat(step=9, step_running_s=0.0), now=105.5)
    assert view.reason(5.0) is None and view.step == 9


def test_a_pod_is_unresponsive_when_any_rank_is_and_says_which():
    ok = RankLiveness(0, None, 0.0, 0.1)
    stuck = RankLiveness(1, "the engine core's current step has been running for 200.0 s", 200.0, 0.2)
    assert pod_unresponsive_reason([ok]) is None
    assert pod_unresponsive_reason([RankLiveness(0, "no heartbeat", 0.0, 4.0)]) == "no heartbeat"
    assert pod_unresponsive_reason([ok, RankLiveness(1, None, 3.0, 0.0)]) is None
    assert pod_unresponsive_reason([ok, stuck]) == f"data-parallel rank 1: {stuck.reason}"
    both = pod_unresponsive_reason([RankLiveness(0, "no heartbeat", 0.0, 4.0), stuck])
    assert both.startswith("data-parallel rank 0: no heartbeat; data-parallel rank 1: ")


def test_the_step_clock_reads_zero_between_steps():
    clock = StepClock()
    assert clock.age() == 0.0
    clock.begin()
    started = clock.started
    assert clock.age(now=started + 2.5) == pytest.approx(2.5)
    clock.end()
    assert clock.age(now=started + 100) == 0.0


def test_heartbeats_are_small_and_never_taken_for_outputs():
    from pdserve.engine.core.liveness import HEARTBEAT_MARKER
    from pdserve.engine.protocol import EngineCoreOutputs
    from pdserve.engine.serial import MsgpackEncoder

    encoded = msgspec.msgpack.encode(CoreHeartbeat(step=123456, step_running_s=1.5))
    assert len(encoded) < 16
    assert msgspec.msgpack.decode(encoded, type=CoreHeartbeat) == CoreHeartbeat(123456, 1.5)
    # Outputs are a msgpack array: their first frame never equals the marker.
    first = MsgpackEncoder().encode(EngineCoreOutputs())[0]
    assert bytes(first) != HEARTBEAT_MARKER and bytes(first)[:1] != HEARTBEAT_MARKER[:1]


# --- the load reporter stops vouching past the step timeout -------------------------------------

@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    internal_auth.stop_authenticator(context)
    context.destroy(linger=0)


def coordinator_socket(ctx: zmq.Context, port: int) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    internal_auth.secure_server(sock, internal_auth.load_internal_key())
    sock.bind(f"tcp://127.0.0.1:{port}")
    return sock


def drain(sock: zmq.Socket, seconds: float) -> list[LoadReport]:
    reports = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(max(1, int(left * 1000))):
            reports.append(DECODE.decode(sock.recv()))
    return reports


def test_the_load_heartbeat_stops_vouching_once_a_step_overruns_the_timeout(ctx, model_dir):
    port = free_port()
    pull = coordinator_socket(ctx, port)
    model = ModelConfig.from_pretrained(model_dir("llama"), device="cpu", max_model_len=256)
    config = EngineConfig(model=model, cache=CacheConfig(block_size=4), engine_id="wedged",
                          coordinator_address=f"127.0.0.1:{port}", advertise_address="127.0.0.1:9001")
    scheduler = Scheduler(config, 16)
    scheduler.kv_cache_manager.pool.enable_events()
    clock = StepClock()
    reporter = LoadReporter(config, ctx, idle_interval=0.1)
    reporter.start_heartbeat(check_interval=0.02, step_clock=clock, step_timeout=0.6)
    try:
        assert reporter.maybe_report(scheduler)
        assert drain(pull, 0.3), "the first report did not arrive"

        clock.begin()  # the busy loop enters a step and calls nothing until it ends
        within = drain(pull, 0.5)
        assert len(within) >= 2, "a step within the timeout must still be vouched for"
        assert reporter.vouching()
        time.sleep(0.3)  # past the timeout
        assert not reporter.vouching()
        drain(pull, 0.2)  # a repeat sent just before the limit may still be in flight
        assert drain(pull, 1.0) == [], "the heartbeat kept vouching for a wedged step"

        clock.end()  # the step finally ends: the busy loop reports, and the heartbeat vouches again
        assert reporter.vouching()
        assert reporter.maybe_report(scheduler)
        assert len(drain(pull, 0.5)) >= 2
    finally:
        reporter.close()
        pull.close()


# --- the flag -------------------------------------------------------------------------------------

def serve_args(*extra: str):
    argv = ["serve", "--model", "demo", *extra]
    return build_parser(argv).parse_args(argv)


def test_step_timeout_flag_reaches_the_engine_config(model_dir, capsys):
    assert serve_args().step_timeout == DEFAULT_STEP_TIMEOUT_S == 120.0
    assert engine_args_from(serve_args("--step-timeout", "2.5")).step_timeout == 2.5
    assert engine_args_from(serve_args("--step-timeout", "0")).step_timeout == 0.0
    for bad in ("-1", "nan", "soon", "inf"):
        with pytest.raises(SystemExit):
            serve_args("--step-timeout", bad)
        assert "expected 0 (off) or a number of seconds" in capsys.readouterr().err
    config = EngineArgs(model=model_dir("llama"), step_timeout=7.0).create_engine_config()
    assert config.step_timeout == 7.0
    with pytest.raises(ValueError, match="step_timeout"):
        EngineArgs(model=model_dir("llama"), step_timeout=-3.0).create_engine_config()


# --- the metrics ----------------------------------------------------------------------------------

def test_metrics_show_each_core_unresponsive_flag_and_step_age():
    metrics = EngineMetrics("m")
    ranks = [RankLiveness(0, None, 0.25, 0.1), RankLiveness(1, "no heartbeat", 0.0, 5.0)]
    metrics.watch_liveness(lambda: ranks)
    metrics.observe(None, IterationStats(), 0)
    text = metrics.render().decode()
    assert 'pdserve:engine_unresponsive{engine="0",model_name="m"} 0.0' in text
    assert 'pdserve:engine_unresponsive{engine="1",model_name="m"} 1.0' in text
    assert 'pdserve:engine_step_running_seconds{engine="0",model_name="m"} 0.25' in text
    ranks[1] = RankLiveness(1, None, 0.0, 0.0)  # it came back
    assert 'pdserve:engine_unresponsive{engine="1",model_name="m"} 0.0' in metrics.render().decode()
