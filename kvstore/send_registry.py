"""The prefill side's record of blocks kept for remote decodes.

A finished prefill's blocks stay allocated under a lease: until every reader has said it is done,
until the router releases them (the decode leg will not pull), or until the lease runs out with
no read in progress. The decode engine that will pull renews the lease while its request waits,
so a long queue there never costs the KV, and a decode engine that is gone costs it one lease at
most. Reads pin the blocks too, so an expiry or a release never frees blocks that are being
copied out: the engine may reuse them only once `take_finished` has reported the request, and
that never happens mid-read.

Blocks belong to a prompt: each hold records the prompt's digest (kvstore.binding), and a reader
must present the same digest, and name only blocks the request holds, to read, lease or release.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from pdserve.kvstore.binding import digests_match, is_digest

# A "done" names how many readers to wait for; more than one per TP rank pair cannot be legal.
MAX_EXPECTED_READERS = 64


@dataclass
class HeldBlocks:
    block_ids: list[int]
    deadline: float
    digest: str = ""  # the prompt's digest; "" matches no reader
    block_set: frozenset[int] = field(default=frozenset())
    lease_s: float = 0.0  # how far a renewal moves the deadline
    active_reads: int = 0
    done_messages: int = 0
    expected: int | None = None  # done messages to wait for, learned from the first one
    abandoned: bool = False  # released by the router: no new read, freed once the current ones end

    @property
    def complete(self) -> bool:
        wanted = self.abandoned or (self.expected is not None and self.done_messages >= self.expected)
        return wanted and self.active_reads == 0


class UnknownRequest(Exception):
    """The request is not (or no longer) held here. `retry` is True when it may still arrive:
    the decode side can ask before this rank has processed the step that registers it."""

    def __init__(self, request_id: str, retry: bool) -> None:
        super().__init__(f"no KV held for request {request_id!r}" + (" yet" if retry else " (released or expired)"))
        self.retry = retry


class ReadRefused(Exception):
    """The request is held, but not for this reader: another prompt's digest, or blocks it does
    not hold. Never worth a retry."""

    retry = False


def is_run_of(held: list[int], held_set: frozenset[int], wanted: Sequence[int]) -> bool:
    """Whether `wanted` is a consecutive run of `held`, in its order. A reader loads block i of
    its list into the place of its prompt's block first+i: the same blocks in another order
    would be another prompt's KV all the same."""
    if not wanted:
        return True
    if wanted[0] not in held_set:
        return False
    start = held.index(wanted[0])
    return held[start:start + len(wanted)] == list(wanted)


class SendRegistry:
    def __init__(self, clock=time.monotonic) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, HeldBlocks] = {}
        self._finished: set[str] = set()
        self._released: OrderedDict[str, None] = OrderedDict()  # recently released ids, bounded
        self._clock = clock
        self.num_expired = 0
        self.num_blocks_expired = 0

    def hold(self, request_id: str, block_ids: list[int], timeout_s: float, digest: str) -> None:
        """Keep the blocks for a lease of `timeout_s` seconds (renewable by readers of the prompt)."""
        with self._lock:
            self._held[request_id] = HeldBlocks(list(block_ids), self._clock() + timeout_s, digest,
                                                frozenset(block_ids), lease_s=timeout_s)

    def renew(self, request_id: str, digest: str) -> bool:
        """A decode engine still means to pull: the lease runs a full term from now. False when
        the request was held and is no longer (expired, released) or `digest` is not its
        prompt's. A request not registered yet (the step that holds it has not run here) is
        True: its lease starts in full when it is."""
        with self._lock:
            held = self._held.get(request_id)
            if held is None:
                return request_id not in self._released and is_digest(digest)
            if held.abandoned or not digests_match(held.digest, digest):
                return False
            held.deadline = max(held.deadline, self._clock() + held.lease_s)
            return True

    def release(self, request_id: str, digest: str) -> bool:
        """Nobody will pull: free the blocks now, or as soon as the reads in progress end. True
        when the request was held here for that prompt."""
        with self._lock:
            held = self._held.get(request_id)
            if held is None or held.abandoned or not digests_match(held.digest, digest):
                return False
            held.abandoned = True
            if held.complete:
                self._release(request_id)
            return True

    def begin_read(self, request_id: str, digest: str, block_ids: Sequence[int]) -> None:
        """Lease the request's blocks for one read of `block_ids`; raises UnknownRequest, or
        ReadRefused when the digest is not the held prompt's or a block is not the request's."""
        with self._lock:
            held = self._held.get(request_id)
            if held is None or held.abandoned:
                raise UnknownRequest(request_id, retry=held is None and request_id not in self._released)
            if not digests_match(held.digest, digest):
                raise ReadRefused(f"request {request_id!r} holds the KV of another prompt")
            if not is_run_of(held.block_ids, held.block_set, block_ids):
                raise ReadRefused(f"request {request_id!r} does not hold those blocks (as a run of its own, in order)")
            held.active_reads += 1

    def end_read(self, request_id: str) -> None:
        with self._lock:
            held = self._held.get(request_id)
            if held is not None:
                held.active_reads -= 1
                if held.complete:
                    self._release(request_id)

    def done(self, request_id: str, expected: int, digest: str) -> bool:
        """One reader is finished with the request; after `expected` of them the blocks go.
        False (and nothing changes) when the digest is not the held prompt's: only a reader of
        that prompt may let its blocks go early."""
        with self._lock:
            held = self._held.get(request_id)
            if held is None:
                return True  # released already: nothing to do, nothing to refuse
            if not digests_match(held.digest, digest):
                return False
            held.done_messages += 1
            held.expected = max(1, min(int(expected), MAX_EXPECTED_READERS))
            if held.complete:
                self._release(request_id)
            return True

    def expire(self) -> int:
        """Release requests whose lease ran out with no read in progress; returns how many."""
        now = self._clock()
        with self._lock:
            late = [r for r, h in self._held.items() if h.deadline <= now and h.active_reads == 0]
            for request_id in late:
                self.num_blocks_expired += len(self._held[request_id].block_ids)
                self._release(request_id)
            self.num_expired += len(late)
            return len(late)

    def take_finished(self) -> set[str]:
        with self._lock:
            finished, self._finished = self._finished, set()
            return finished

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._held)

    def _release(self, request_id: str) -> None:
        del self._held[request_id]
        self._finished.add(request_id)
        self._released[request_id] = None
        while len(self._released) > 4096:
            self._released.popitem(last=False)
