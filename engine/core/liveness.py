"""Is the engine core making progress? What the core says about it, and how the frontend judges it.

A core process can be alive yet useless: stopped (SIGSTOP, a frozen VM), or stuck inside one step
(a tensor-parallel worker that hangs, a collective that never returns). The process sentinel and
ENGINE_CORE_DEAD only catch deaths, so the core also sends a small heartbeat to its frontend on
the outputs socket, from its output thread (never the busy loop), every HEARTBEAT_INTERVAL_S:
the scheduler's step counter and how long the current step has been running (0 when idle).

The frontend calls the core *unresponsive* (not dead: it may recover, and its requests are kept)
when no heartbeat arrived for HEARTBEAT_SILENCE_S, or when the current step has run longer than
the step timeout (`--step-timeout`). The load reporter's heartbeat thread reads the same step
clock and stops vouching for the core to the coordinator past the step timeout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec

# The first frame of a heartbeat on the outputs socket. Outputs never start with it: their first
# frame is a msgpack array, whose first byte is never an ASCII letter.
HEARTBEAT_MARKER = b"ENGINE_CORE_HEARTBEAT"
HEARTBEAT_INTERVAL_S = 0.5
# Six missed heartbeats. Long enough that a thread starved for a moment on a busy host is not
# reported; short next to the router's timeouts, so a stopped core is skipped within seconds.
HEARTBEAT_SILENCE_S = 3.0
# The longest legitimate step measured here: a full 2048-token prefill chunk (the default
# max_num_batched_tokens) of smollm2 at TP=1 on 2 idle CPU cores took 15-18 s. A busy host can
# double that; 120 s leaves a margin of more than 6x and still catches a hung step in two minutes.
DEFAULT_STEP_TIMEOUT_S = 120.0


class CoreHeartbeat(msgspec.Struct, array_like=True, gc=False):
    step: int  # the scheduler's step counter
    step_running_s: float  # how long the current step has been running; 0.0 when none runs


class StepClock:
    """When the busy loop's current step started. Written by the busy loop, read by other threads
    (a float attribute: one atomic store and load, no lock)."""

    __slots__ = ("started",)

    def __init__(self) -> None:
        self.started = 0.0  # time.monotonic() at the step's start; 0.0 between steps

    def begin(self) -> None:
        self.started = time.monotonic()

    def end(self) -> None:
        self.started = 0.0

    def age(self, now: float | None = None) -> float:
        started = self.started  # read once: the busy loop may end the step meanwhile
        if not started:
            return 0.0
        return max(0.0, (time.monotonic() if now is None else now) - started)


def unresponsive_reason(silence_s: float, step_running_s: float, step_timeout_s: float,
                        silence_limit_s: float = HEARTBEAT_SILENCE_S) -> str | None:
    """Why a core is unresponsive, or None when it is not. `silence_s`: how long no heartbeat has
    arrived; `step_timeout_s` 0 turns the step rule off."""
    if silence_s >= silence_limit_s:
        return f"no heartbeat from the engine core for {silence_s:.1f} s (the process is stopped or frozen)"
    if step_timeout_s > 0 and step_running_s > step_timeout_s:
        return (f"the engine core's current step has been running for {step_running_s:.1f} s "
                f"(step timeout {step_timeout_s:g} s)")
    return None


@dataclass
class CoreLiveness:
    """The frontend's view of one core, fed by the task that reads its outputs socket.

    Silence is measured up to the last time the reader found the socket empty (`caught_up`), not
    up to now: when the frontend's own event loop stalls, heartbeats wait unread in the socket,
    and that must not be blamed on the core.
    """

    last_heartbeat_at: float  # monotonic time a heartbeat was last read (or watching began)
    caught_up_at: float  # monotonic time the reader last found nothing more to read
    step: int = 0
    step_running_s: float = 0.0
    heartbeats: int = 0

    @classmethod
    def starting(cls, now: float | None = None) -> "CoreLiveness":
        now = time.monotonic() if now is None else now
        return cls(last_heartbeat_at=now, caught_up_at=now)

    def on_heartbeat(self, heartbeat: CoreHeartbeat, now: float | None = None) -> None:
        self.last_heartbeat_at = time.monotonic() if now is None else now
        self.step, self.step_running_s = heartbeat.step, heartbeat.step_running_s
        self.heartbeats += 1

    def on_caught_up(self, now: float | None = None) -> None:
        self.caught_up_at = time.monotonic() if now is None else now

    @property
    def silence_s(self) -> float:
        return max(0.0, self.caught_up_at - self.last_heartbeat_at)

    def reason(self, step_timeout_s: float, silence_limit_s: float = HEARTBEAT_SILENCE_S) -> str | None:
        return unresponsive_reason(self.silence_s, self.step_running_s, step_timeout_s, silence_limit_s)


@dataclass(frozen=True)
class RankLiveness:
    """One engine core's state as /health and /metrics show it."""

    rank: int
    reason: str | None  # None: responsive
    step_running_s: float
    silence_s: float

    @property
    def unresponsive(self) -> bool:
        return self.reason is not None


def pod_unresponsive_reason(ranks: list[RankLiveness]) -> str | None:
    """One engine server's verdict over its cores: unresponsive when any is, naming which when
    there are several (data-parallel ranks)."""
    stuck = [r for r in ranks if r.reason is not None]
    if not stuck:
        return None
    if len(ranks) == 1:
        return stuck[0].reason
    return "; ".join(f"data-parallel rank {r.rank}: {r.reason}" for r in stuck)
