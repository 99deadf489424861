"""The order in which servers compared side by side take their repetitions.

On a shared 2-core guest the machine's speed moves from minute to minute: on the Zen 3 EPYC the
same `pdserve serve` ran sixteen streams at 75.7 and at 97.6 tok/s ten minutes apart. A ratio of
two servers each timed back to back over its own quarter of an hour then compares two machines.
So the servers of one comparison are up together and take turns, repetition by repetition.
"""

from __future__ import annotations

from typing import Any


def interleaved(members: list[str], reps: int) -> list[tuple[str, int]]:
    """(member, repetition) in the order they run: every member's repetition r before any member's
    r + 1, the members reversed on odd repetitions (A B, B A, A B, ...) so that a drift of the
    machine's speed through a round does not always favour whoever goes first."""
    order = []
    for rep in range(reps):
        for name in (members if rep % 2 == 0 else members[::-1]):
            order.append((name, rep))
    return order


FLOAT_PRECISIONS = ("float32", "bfloat16", "float16")


def comparison_family(precision: str) -> str:
    """The servers compared with each other: every float precision together (pdserve's float32 and
    bfloat16 rows are set against each other as well as against llama-server's F32 and BF16, which
    is how `dtype auto` is checked), each quantized format alone."""
    return "float" if precision in FLOAT_PRECISIONS else precision


def precision_groups(systems: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The systems that can run (no "missing" key), grouped by the `comparison_family` of their
    "precision" in the order they were listed: a group's servers are up together."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for s in systems:
        if "missing" not in s:
            groups.setdefault(comparison_family(s["precision"]), []).append(s)
    return list(groups.values())
