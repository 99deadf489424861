"""The lock-step wave protocol of data-parallel ranks (for models whose ranks must step together).

A wave is a stretch of steps during which every rank of the pod steps, busy or not: a rank with
no requests runs a dummy step, so collectives inside the model (expert parallelism) always find
every rank. Every SYNC_INTERVAL steps the ranks all-reduce whether any still has work; when none
has, the wave is over: every rank pauses and moves to the next wave number, and rank 0 reports
the completed wave. A request that reaches a paused rank starts the next wave there at once; the
rank says so, and the coordinator broadcasts start-wave so the other ranks join. A start for a
wave that already ended is ignored: the ranks agree on every wave's end through the all-reduce.

`RankWave` is one rank's view, `WaveCoordinator` the pod-wide one; both are plain state machines.
`DPGroup` is the ranks' own torch.distributed group, apart from any tensor-parallel group.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

log = logging.getLogger("pdserve.engine.dp_wave")

SYNC_INTERVAL = 32  # steps between the ranks' "anyone still busy?" all-reduces
# A rank that dies mid-wave leaves the others blocked in the all-reduce; fail them after this.
GROUP_TIMEOUT = datetime.timedelta(seconds=60)


@dataclass
class RankWave:
    """One rank's wave state and step counters."""

    wave: int = 0
    running: bool = False
    steps_in_wave: int = 0
    steps: int = 0  # cumulative steps inside waves (real and dummy)
    dummy_steps: int = 0
    step_seconds: float = 0.0  # cumulative time of those steps
    dummy_seconds: float = 0.0

    def start(self, wave: int) -> bool:
        """Join `wave` (a broadcast, or a request that arrived while paused); True if this started it."""
        if self.running or wave < self.wave:
            return False  # already running, or a stale start for a wave that has ended
        self.wave, self.running, self.steps_in_wave = wave, True, 0
        return True

    def count_step(self, dummy: bool, seconds: float = 0.0) -> bool:
        """Count one step of the running wave; True when the ranks must sync now."""
        self.steps += 1
        self.steps_in_wave += 1
        self.step_seconds += seconds
        if dummy:
            self.dummy_steps += 1
            self.dummy_seconds += seconds
        return self.steps_in_wave % SYNC_INTERVAL == 0

    def finish(self) -> int:
        """Every rank is idle: pause, and move to the next wave. Returns the completed wave."""
        done = self.wave
        self.wave, self.running, self.steps_in_wave = done + 1, False, 0
        return done


@dataclass
class WaveCoordinator:
    """The pod's view: which wave is current, and whether it runs. Decides when to broadcast."""

    wave: int = 0
    running: bool = False
    waves_completed: int = 0

    def on_start(self, wave: int) -> bool:
        """A rank started `wave`; True when the other ranks must be told to start it."""
        if wave < self.wave or (wave == self.wave and self.running):
            return False
        self.wave, self.running = wave, True
        return True

    def on_complete(self, wave: int) -> None:
        """Rank 0 reports `wave` completed (a late report for an older wave changes nothing)."""
        if wave >= self.wave:
            self.wave, self.running = wave + 1, False
            self.waves_completed += 1


class DPGroup:
    """The data-parallel ranks' gloo group: created from a TCP store that rank 0 hosts.

    It is a process group object of its own, not torch.distributed's default group, so it never
    collides with a tensor-parallel group in the same process. The flag all-reduce is a few bytes
    on the CPU, so gloo serves it on GPU machines too.
    """

    def __init__(self, rank: int, size: int, init_method: str) -> None:
        import torch.distributed as dist

        host, _, port = init_method.removeprefix("tcp://").rpartition(":")
        self.rank, self.size = rank, size
        self.store = dist.TCPStore(host.strip("[]"), int(port), size, is_master=rank == 0, timeout=GROUP_TIMEOUT)
        self.group = dist.ProcessGroupGloo(self.store, rank, size, GROUP_TIMEOUT)
        log.info("data-parallel rank %d of %d joined its group at %s", rank, size, init_method)

    def any_busy(self, busy: bool) -> bool:
        """All-reduce: is any rank still busy?"""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if busy else 0], dtype=torch.int32)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.group.allreduce([flag], opts).wait()
        return bool(flag.item())
