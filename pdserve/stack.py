"""A small supervisor for the child processes of `pdserve up`.

Each child runs `python -m pdserve ...` in its own session (so its own process group): a Ctrl-C in
the terminal reaches only `up`, which then stops the children in order, and stopping a child's
group also reaches the processes it started (an engine's core and workers). Every exit path goes
through `Stack.stop`; a Linux parent-death signal covers the one path that cannot (`up` killed
with SIGKILL).

`Supervisor` keeps a started stack running: a child that exits, or an engine server whose core
died (its /health answers 503 `engine_dead`), or a child that stops answering for a long time, is
killed with its group and started again with the same command, ports and environment after a
backoff. A child that keeps failing is reported as `GaveUp` rather than restarted forever.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

log = logging.getLogger("pdserve.up")

MIN_STEP_GRACE_S = 3.0  # what each later stop step still gets once the drain's time is spent
GROUP_EXIT_WAIT_S = 5.0  # how long a restart waits for the old process group to be gone


@dataclass(frozen=True)
class Component:
    """One child: its name in messages, the `pdserve` arguments, where it answers /health, and when it starts and stops."""

    name: str
    argv: tuple[str, ...]
    health_url: str
    stage: int = 0  # started once every component of the earlier stages is healthy
    env: tuple[tuple[str, str], ...] = ()  # set for this child only, over the stack's environment
    stop_rank: int = 0  # stopped after every component of a lower rank has exited (the router first)


@dataclass
class Child:
    """One run of a component's process; a restart makes a new Child for the same component."""

    component: Component
    proc: subprocess.Popen
    log_path: Path
    started: float
    ready_after: float | None = None
    restart: int = 0  # 0 for the first run, n for the n-th restart

    @property
    def name(self) -> str:
        return self.component.name

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def exit_description(self) -> str:
        code = self.proc.returncode
        if code is not None and code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def log_tail(self, lines: int = 20) -> list[str]:
        try:
            with open(self.log_path, errors="replace") as f:
                return [line.rstrip("\n") for line in deque(f, maxlen=lines)]
        except OSError:
            return []


class ChildExited(RuntimeError):
    def __init__(self, child: Child) -> None:
        super().__init__(f"{child.name} {child.exit_description()}")
        self.child = child


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports the OS says are free now (held together, so no duplicates)."""
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket())
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
        return ports


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def _die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A preexec hook: the child gets SIGTERM when `up` dies, even by SIGKILL (Linux only)."""

    def hook() -> None:
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return hook


@dataclass
class Stack:
    """Starts components, waits for their health, restarts one, and stops them all in order."""

    run_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    children: list[Child] = field(default_factory=list)  # the current run of each component, in start order

    def start(self, component: Component, restart: int = 0) -> Child:
        log_path = self.run_dir / f"{component.name}.log"
        env = dict(os.environ, PYTHONSAFEPATH="1", PYTHONUNBUFFERED="1", **self.env, **dict(component.env))
        with open(log_path, "ab") as out:
            if restart:
                # One log per component across restarts: mark where each run begins.
                out.write(f"\n--- pdserve up: restart {restart} of {component.name} at "
                          f"{time.strftime('%Y-%m-%d %H:%M:%S')} ---\n".encode())
                out.flush()
            proc = subprocess.Popen(
                [sys.executable, "-m", "pdserve", *component.argv], stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, env=env, start_new_session=True,
                preexec_fn=_die_with_parent(os.getpid()) if sys.platform.startswith("linux") else None)
        child = Child(component, proc, log_path, time.monotonic(), restart=restart)
        for i, old in enumerate(self.children):
            if old.component.name == component.name:
                self.children[i] = child
                break
        else:
            self.children.append(child)
        log.debug("started %s (pid %d): %s", component.name, proc.pid, " ".join(component.argv))
        return child

    def restart(self, child: Child) -> Child:
        """The same component again: its old process group killed first, so its ports are free."""
        kill_group(child)
        return self.start(child.component, restart=child.restart + 1)

    def first_exited(self) -> Child | None:
        return next((c for c in self.children if c.exited()), None)

    def wait_ready(self, timeout: float, on_ready: Callable[[Child], None],
                   should_stop: Callable[[], bool] = lambda: False, poll_interval: float = 0.25) -> bool:
        """Poll every child's /health until all answer 200 (True) or `should_stop()` (False).

        Raises ChildExited as soon as any child dies and TimeoutError naming the laggards.
        """
        deadline = time.monotonic() + timeout
        pending = [c for c in self.children if c.ready_after is None]
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while pending:
                if should_stop():
                    return False
                dead = self.first_exited()
                if dead is not None:
                    raise ChildExited(dead)
                for child in list(pending):
                    if probe(client, child.component.health_url).healthy:
                        child.ready_after = time.monotonic() - child.started
                        pending.remove(child)
                        on_ready(child)
                if not pending:
                    break
                if time.monotonic() > deadline:
                    names = ", ".join(c.name for c in pending)
                    raise TimeoutError(f"not healthy after {timeout:.0f}s: {names}")
                time.sleep(poll_interval)
        return True

    def stop(self, grace: float = 30.0, kill_after: float = 5.0, force: Callable[[], bool] = lambda: False,
             on_step: Callable[[list[Child]], None] | None = None) -> None:
        """Stop the children rank by rank (`Component.stop_rank`), each rank only once the lower ones have exited.

        SIGTERM lets a child finish what it holds: the router its in-flight requests (through both
        legs, so the engines must outlive it), an engine what it has in flight. The whole drain is
        bounded by `grace` s (a later rank still gets MIN_STEP_GRACE_S to exit cleanly); a rank
        still running at its deadline is killed with its process group before the next rank
        stops. `force()` returning True (a second Ctrl-C) kills everything at once.
        """
        deadline = time.monotonic() + grace
        for rank in sorted({c.component.stop_rank for c in self.children}):
            if force():
                break
            group = [c for c in self.children if c.component.stop_rank == rank and not c.exited()]
            if not group:
                continue
            if on_step is not None:
                on_step(group)
            for child in group:
                _signal_pid(child.pid, signal.SIGTERM)
            step_deadline = max(deadline, time.monotonic() + MIN_STEP_GRACE_S)
            while any(not c.exited() for c in group) and time.monotonic() < step_deadline and not force():
                time.sleep(0.1)
            for child in group:
                if not child.exited():
                    log.warning("%s (pid %d) did not stop within the drain timeout: killing it", child.name, child.pid)
                    _signal_group(child.pid, signal.SIGKILL)
        # A leader that exited may leave its group behind (an engine core whose server was killed):
        # the group id stays the leader's pid while any member lives.
        for child in self.children:
            _signal_group(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + kill_after
        for child in self.children:
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) did not exit after SIGKILL", child.name, child.pid)


# --- health -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Health:
    """One /health answer: 200, a 503 with an engine's error code, another status, or no answer (status None)."""

    status: int | None
    code: str | None = None

    @property
    def healthy(self) -> bool:
        return self.status == 200

    @property
    def engine_dead(self) -> bool:
        return self.status == 503 and self.code == "engine_dead"

    @property
    def unresponsive(self) -> bool:
        """Nothing answers, or the engine server says its core stopped answering (a frozen core)."""
        return self.status is None or (self.status == 503 and self.code == "engine_unresponsive")


def probe(client: httpx.Client, url: str) -> Health:
    try:
        response = client.get(url)
    except httpx.HTTPError:
        return Health(None)
    code = None
    if response.status_code != 200:
        try:
            error = response.json().get("error")
            code = error.get("code") if isinstance(error, dict) else None
        except (ValueError, AttributeError):
            pass
    return Health(response.status_code, code if isinstance(code, str) else None)


# --- supervision ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RestartPolicy:
    backoff_s: float = 1.0  # before the first restart in the window; doubled for each further one
    backoff_max_s: float = 30.0
    max_restarts: int = 5  # this many restarts within window_s, and the next failure gives up
    window_s: float = 300.0
    ready_timeout_s: float = 600.0  # a restarted child must answer /health 200 within this
    unresponsive_s: float = 60.0  # no answer (or engine_unresponsive) this long: restart
    probe_interval_s: float = 2.0
    probe_timeout_s: float = 2.0

    def backoff(self, attempt: int) -> float:
        """The wait before restart number `attempt` (1-based) within the window."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** max(0, attempt - 1))


@dataclass(frozen=True)
class Event:
    """Something the supervisor did, for `up` to log as one line."""

    kind: str  # "failed" (restart scheduled), "restarted", "healthy"
    child: Child
    fields: dict[str, Any]


class GaveUp(RuntimeError):
    def __init__(self, child: Child, reason: str, restarts: int, window_s: float) -> None:
        super().__init__(f"{child.name} {reason}, after {restarts} restarts within {window_s:.0f}s: giving up")
        self.child = child
        self.reason = reason
        self.restarts = restarts


@dataclass
class _Watch:
    restart_times: deque[float] = field(default_factory=deque)  # within the window
    total: int = 0
    restart_at: float | None = None  # dead, waiting out its backoff
    unhealthy_since: float | None = None
    next_probe: float = 0.0


class Supervisor:
    """Keeps the children of a started stack running; call `check()` often from one thread.

    `check` probes at most one child's /health per call (the most overdue), so a frozen child
    delays the caller by at most one probe timeout.
    """

    def __init__(self, stack: Stack, policy: RestartPolicy = RestartPolicy()) -> None:
        self.stack = stack
        self.policy = policy
        self.watches: dict[str, _Watch] = {c.name: _Watch() for c in stack.children}
        self.client = httpx.Client(timeout=policy.probe_timeout_s, trust_env=False)

    def close(self) -> None:
        self.client.close()

    def restarts(self) -> dict[str, int]:
        """Restarts so far per component, for those restarted at least once, in start order."""
        return {c.name: self.watches[c.name].total for c in self.stack.children if self.watches[c.name].total}

    def restarting(self) -> list[str]:
        """Components that are not serving now: waiting out a backoff, or restarted and not yet healthy."""
        return [c.name for c in self.stack.children
                if self.watches[c.name].restart_at is not None or c.ready_after is None]

    def check(self, now: float | None = None) -> list[Event]:
        """Notice deaths, start children whose backoff is over, and probe one child. Raises GaveUp."""
        now = time.monotonic() if now is None else now
        events: list[Event] = []
        for child in list(self.stack.children):
            watch = self.watches[child.name]
            if watch.restart_at is not None:
                if now >= watch.restart_at:
                    watch.restart_at = None
                    watch.unhealthy_since = None
                    watch.next_probe = 0.0
                    new = self.stack.restart(child)
                    events.append(Event("restarted", new, {"pid": new.pid, "restart": new.restart}))
            elif child.exited():
                events.append(self._failed(child, child.exit_description(), now))
        due = [c for c in self.stack.children
               if self.watches[c.name].restart_at is None and not c.exited() and self.watches[c.name].next_probe <= now]
        if due:
            child = min(due, key=lambda c: self.watches[c.name].next_probe)
            event = self._probe(child, now)
            if event is not None:
                events.append(event)
        return events

    def _probe(self, child: Child, now: float) -> Event | None:
        watch = self.watches[child.name]
        health = probe(self.client, child.component.health_url)
        now = max(now, time.monotonic())  # the probe itself may have taken a while
        starting = child.ready_after is None
        watch.next_probe = now + (0.5 if starting else self.policy.probe_interval_s)
        if starting:
            if health.healthy:
                child.ready_after = now - child.started
                return Event("healthy", child, {"pid": child.pid, "restart": child.restart,
                                                "after_s": round(child.ready_after, 1)})
            if now - child.started > self.policy.ready_timeout_s:
                return self._failed(child, f"did not answer /health within {self.policy.ready_timeout_s:.0f}s", now)
            return None
        if health.healthy:
            watch.unhealthy_since = None
            return None
        if health.engine_dead:
            return self._failed(child, "lost its engine core (/health: 503 engine_dead)", now)
        if health.unresponsive:
            watch.unhealthy_since = watch.unhealthy_since if watch.unhealthy_since is not None else now
            stuck = now - watch.unhealthy_since
            if stuck >= self.policy.unresponsive_s:
                what = f"503 {health.code}" if health.status else "no answer"
                return self._failed(child, f"was unresponsive for {stuck:.0f}s (/health: {what})", now)
            return None
        # Any other answer (a router with no healthy engine, say): the process is alive and talking.
        watch.unhealthy_since = None
        return None

    def _failed(self, child: Child, reason: str, now: float) -> Event:
        watch = self.watches[child.name]
        kill_group(child)  # frees its ports during the backoff, and ends what it left behind
        while watch.restart_times and now - watch.restart_times[0] > self.policy.window_s:
            watch.restart_times.popleft()
        if len(watch.restart_times) >= self.policy.max_restarts:
            raise GaveUp(child, reason, len(watch.restart_times), self.policy.window_s)
        watch.restart_times.append(now)
        watch.total += 1
        delay = self.policy.backoff(len(watch.restart_times))
        watch.restart_at = now + delay
        return Event("failed", child, {"pid": child.pid, "reason": reason, "restart_in_s": delay,
                                       "restarts_in_window": f"{len(watch.restart_times)}/{self.policy.max_restarts}"})


def kill_group(child: Child, timeout: float = GROUP_EXIT_WAIT_S) -> None:
    """SIGKILL the child's whole process group and wait (bounded) until it is gone."""
    _signal_group(child.pid, signal.SIGKILL)
    try:
        child.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        log.warning("%s (pid %d) did not exit after SIGKILL", child.name, child.pid)
        return
    deadline = time.monotonic() + timeout
    while _group_running(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _group_running(pgid: int) -> bool:
    """Whether a process of the group still runs. Zombies do not count: an orphaned engine core
    is reaped by whoever adopts it, and some container init processes never do."""
    try:
        entries = os.listdir("/proc")
    except OSError:  # no procfs: any member, zombie or not
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # After "(comm)": state, ppid, pgrp, ...
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


def _signal_pid(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def describe_death(child: Child, lines: int = 20, reason: str | None = None) -> str:
    """Which child, how it ended (or `reason`), and the end of its log."""
    tail = child.log_tail(lines)
    text = [f"{child.name} (pid {child.pid}) {reason or child.exit_description()}."]
    if tail:
        text.append(f"Last lines of {child.log_path}:")
        text += [f"  | {line}" for line in tail]
    else:
        text.append(f"Its log {child.log_path} is empty.")
    return "\n".join(text)
