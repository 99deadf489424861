"""A small supervisor for the child processes of `pdserve up`.

Each child runs `python -m pdserve ...` in its own session (so its own process group): a Ctrl-C in
the terminal reaches only `up`, which then stops the children in order, and stopping a child's
group also reaches the processes it started (an engine's core and workers). Every exit path goes
through `Stack.stop`; a Linux parent-death signal covers the one path that cannot (`up` killed
with SIGKILL).
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
from typing import Callable

import httpx

log = logging.getLogger("pdserve.up")


@dataclass(frozen=True)
class Component:
    """One child: its name in messages, the `pdserve` arguments, where it answers /health, and when it starts."""

    name: str
    argv: tuple[str, ...]
    health_url: str
    stage: int = 0  # started once every component of the earlier stages is healthy
    env: tuple[tuple[str, str], ...] = ()  # set for this child only, over the stack's environment


@dataclass
class Child:
    component: Component
    proc: subprocess.Popen
    log_path: Path
    started: float
    ready_after: float | None = None

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
    """Starts components, waits for their health, notices deaths, and stops them all."""

    run_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    children: list[Child] = field(default_factory=list)

    def start(self, component: Component) -> Child:
        log_path = self.run_dir / f"{component.name}.log"
        env = dict(os.environ, PYTHONSAFEPATH="1", PYTHONUNBUFFERED="1", **self.env, **dict(component.env))
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "pdserve", *component.argv], stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, env=env, start_new_session=True,
                preexec_fn=_die_with_parent(os.getpid()) if sys.platform.startswith("linux") else None)
        child = Child(component, proc, log_path, time.monotonic())
        self.children.append(child)
        log.debug("started %s (pid %d): %s", component.name, proc.pid, " ".join(component.argv))
        return child

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
                    if _healthy(client, child.component.health_url):
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

    def stop(self, grace: float = 30.0, kill_after: float = 5.0, force: Callable[[], bool] = lambda: False) -> None:
        """SIGTERM every live child, wait up to `grace` s, then SIGKILL whatever is left in their groups.

        `force()` returning True (a second Ctrl-C) cuts the wait short.
        """
        for child in self.children:
            if not child.exited():
                _signal_pid(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(not c.exited() for c in self.children) and time.monotonic() < deadline and not force():
            time.sleep(0.1)
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


def _healthy(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url).status_code == 200
    except httpx.HTTPError:
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


def describe_death(child: Child, lines: int = 20) -> str:
    tail = child.log_tail(lines)
    text = [f"{child.name} (pid {child.pid}) {child.exit_description()}."]
    if tail:
        text.append(f"Last lines of {child.log_path}:")
        text += [f"  | {line}" for line in tail]
    else:
        text.append(f"Its log {child.log_path} is empty.")
    return "\n".join(text)
