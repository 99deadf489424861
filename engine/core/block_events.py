"""Changes to a prefix-cache index, merged until someone drains them.

The block pool records here which block hashes it indexed and evicted, so a coordinator (and the
routers behind it) can tell which engine holds which prefix. The coordinator uses the same class
to merge the changes of several reports between two publishes.

Merging keeps only each hash's last change: a hash stored and then evicted before the next drain
is reported as removed, one evicted and then stored again as stored. So `stored` and `removed`
never share a hash and a reader may apply them in any order, after `cleared` (forget everything
this engine held, then apply the rest).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from pdserve.engine.core.kv_cache_utils import BlockHash


@dataclass
class DrainedEvents:
    stored: list[BlockHash] = field(default_factory=list)
    removed: list[BlockHash] = field(default_factory=list)
    cleared: bool = False

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.cleared)


class BlockEvents:
    __slots__ = ("_stored", "_removed", "_cleared")

    def __init__(self) -> None:
        # dicts, not sets: they keep the order in which blocks were cached, which readers may like.
        self._stored: dict[BlockHash, None] = {}
        self._removed: dict[BlockHash, None] = {}
        self._cleared = False

    @property
    def pending(self) -> bool:
        return bool(self._stored or self._removed or self._cleared)

    def stored(self, block_hash: BlockHash) -> None:
        self._removed.pop(block_hash, None)
        self._stored[block_hash] = None

    def removed(self, block_hash: BlockHash) -> None:
        self._stored.pop(block_hash, None)
        self._removed[block_hash] = None

    def cleared(self) -> None:
        self._stored.clear()
        self._removed.clear()
        self._cleared = True

    def merge(self, stored: Iterable[BlockHash], removed: Iterable[BlockHash], cleared: bool) -> None:
        """Fold in another drained batch that happened after everything recorded so far."""
        if cleared:
            self.cleared()
        for block_hash in removed:
            self.removed(block_hash)
        for block_hash in stored:
            self.stored(block_hash)

    def drain(self) -> DrainedEvents:
        drained = DrainedEvents(list(self._stored), list(self._removed), self._cleared)
        self._stored.clear()
        self._removed.clear()
        self._cleared = False
        return drained
