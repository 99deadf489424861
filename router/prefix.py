"""Prefix-aware routing: which engine holds the leading KV blocks of a prompt, and how much that is worth.

Engines hash their KV blocks by chaining (parent hash + the block's token ids), so the router
hashes the prompt's token ids the same way (`hash_block_tokens`) and counts, per engine, how many
leading blocks that engine reported as stored through the coordinator's block events.

The bonus rule (in score units: `waiting*4 + running`, or in-flight requests without a feed):
- each cached leading block is worth PREFIX_BLOCK_BONUS, capped at the overload margin;
- the margin is max(OVERLOAD_SLACK, least score in the pool): an engine whose score is more than
  that above the least loaded one is overloaded and gets no bonus, so a popular prefix cannot pile
  every request onto one engine while others idle (the others then cache the prefix themselves).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Sequence

from pdserve.engine.core.kv_cache_utils import hash_block_tokens

log = logging.getLogger("pdserve.router")

PREFIX_BLOCK_BONUS = 2.0
OVERLOAD_SLACK = 8.0


def overload_margin(least: float) -> float:
    return max(OVERLOAD_SLACK, least)


def apply_prefix_bonus(scores: Sequence[float], cached_blocks: Sequence[int]) -> list[float]:
    if not scores:
        return []
    least = min(scores)
    margin = overload_margin(least)
    adjusted = []
    for score, blocks in zip(scores, cached_blocks):
        if blocks > 0 and score <= least + margin:
            score -= min(blocks * PREFIX_BLOCK_BONUS, margin)
        adjusted.append(score)
    return adjusted


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    return hash_block_tokens(list(token_ids), block_size)


def leading_matches(hashes: Sequence[bytes], held: set[bytes] | frozenset[bytes]) -> int:
    """How many of the prompt's first blocks the engine holds, stopping at the first miss."""
    count = 0
    for h in hashes:
        if h not in held:
            break
        count += 1
    return count


class BlockIndex:
    """Engine id -> the block hashes it holds, kept from the coordinator's block events."""

    def __init__(self) -> None:
        self._held: dict[str, set[bytes]] = {}

    def apply(self, event: dict[str, Any]) -> None:
        engine_id = str(event.get("id", ""))
        held = self._held.setdefault(engine_id, set())
        if event.get("cleared"):
            held.clear()
        for h in event.get("removed") or ():
            held.discard(bytes(h))
        held.update(bytes(h) for h in event.get("stored") or ())

    def seed(self, engine_id: str, hashes: Iterable[bytes]) -> None:
        self._held.setdefault(engine_id, set()).update(hashes)

    def forget(self, engine_id: str) -> None:
        self._held.pop(engine_id, None)

    def held(self, engine_id: str) -> set[bytes]:
        return self._held.get(engine_id, set())

    def matches(self, engine_id: str, hashes: Sequence[bytes]) -> int:
        return leading_matches(hashes, self._held.get(engine_id, set()))


# --- without a tokenizer --------------------------------------------------------------------------------

def estimate_tokens(text_chars: int) -> int:
    """Without a tokenizer: about 4 characters per token for English text."""
    return text_chars // 4
