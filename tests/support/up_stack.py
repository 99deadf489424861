"""`pdserve up` run as a real process by tests: its output line by line, its children, its teardown."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from support.server import free_port


class UpProcess:
    """`python -m pdserve up ...` with its output (stdout and stderr) collected line by line."""

    def __init__(self, args: list[str], run_dir: Path) -> None:
        self.port = free_port()
        self.run_dir = run_dir
        cmd = [sys.executable, "-m", "pdserve", "up", "--port", str(self.port), "--run-dir", str(run_dir), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=dict(os.environ, PYTHONSAFEPATH="1"), start_new_session=True)
        self.lines: list[str] = []
        self._eof = False
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float, after: int = 0) -> re.Match:
        """The first output line from line `after` on matching `pattern`; fails with the output otherwise."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines[after:]:
                    if match := regex.search(line):
                        return match
                if self._eof or time.monotonic() > deadline:
                    break
                self._changed.wait(0.5)
        raise AssertionError(f"no line matching {pattern!r} within {timeout:.0f}s (exit code {self.proc.poll()}):\n"
                             f"{self.output}\n{self.child_logs()}")

    def mark(self) -> int:
        with self._changed:
            return len(self.lines)

    def child_logs(self) -> str:
        logs = sorted(self.run_dir.glob("*.log")) if self.run_dir.exists() else []
        return "\n".join(f"--- {p.name} (end) ---\n{p.read_text(errors='replace')[-3000:]}" for p in logs)

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def health_url(self, name: str) -> str:
        return self.wait_for(rf"ready\s+{re.escape(name)}\s+\S+s\s+(http://[\d.]+:\d+)", timeout=1).group(1) + "/health"

    def child_pid(self, name: str) -> int | None:
        """The pid of the `pdserve` child up runs now as `name` (found by the port its ready line names)."""
        port = self.health_url(name).rsplit(":", 1)[1].split("/")[0]
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return None
        for child in children:
            try:
                argv = child.cmdline()
            except psutil.NoSuchProcess:
                continue
            for flag in ("--port", "--http-port"):
                if flag in argv[:-1] and argv[argv.index(flag) + 1] == port and "pdserve" in argv:
                    return child.pid
        return None

    def stop(self) -> None:
        """Teardown: whatever a failed test left, nothing may outlive the module."""
        leftovers = self.descendants()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for p in leftovers:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes still running after `timeout` s (zombies count as gone: they have exited)."""
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    still = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                still.append(p)
        except psutil.NoSuchProcess:
            pass
    return still
