"""The router's selection rules, without I/O: scores, rotation, local bumps, fallbacks, prefix bonus."""

from __future__ import annotations

from collections import Counter

import msgspec
import pytest

from pdserve.engine.core.kv_cache_utils import hash_block_tokens
from pdserve.router.balancer import Balancer, Candidate, EngineLoad, NoCandidates, Policy
from pdserve.router.feed import FeedState
from pdserve.router.prefix import (OVERLOAD_SLACK, PREFIX_BLOCK_BONUS, BlockIndex, apply_prefix_bonus,
                                   leading_matches, prompt_block_hashes)


def fed(address: str, waiting: int, running: int, report: int = 1, stale: bool = False, **kw) -> Candidate:
    return Candidate(address, load=EngineLoad(waiting, running, report, stale), **kw)


def pick_address(balancer: Balancer, candidates: list[Candidate]) -> str:
    return candidates[balancer.pick(candidates)].address


def test_lowest_waiting_times_four_plus_running_wins():
    b = Balancer()
    # a: 1*4+0 = 4, b: 0*4+3 = 3, c: 2*4+1 = 9
    candidates = [fed("a", 1, 0), fed("b", 0, 3), fed("c", 2, 1)]
    assert pick_address(b, candidates) == "b"


def test_ties_rotate_the_starting_engine():
    b = Balancer()
    chosen = []
    for report in range(6):  # a fresh report each time, so no local bump carries over
        candidates = [fed(x, 0, 2, report=report) for x in "abc"]
        chosen.append(pick_address(b, candidates))
    assert chosen == ["a", "b", "c", "a", "b", "c"]


def test_a_burst_between_reports_spreads_by_local_bumps():
    b = Balancer()
    candidates = [fed("a", 0, 0), fed("b", 0, 0), fed("c", 0, 5)]
    burst = Counter(pick_address(b, candidates) for _ in range(10))
    # Each pick counts as one waiting request (+4): a and b alternate until they pass c's 5.
    assert burst["a"] + burst["b"] >= 6 and abs(burst["a"] - burst["b"]) <= 1
    assert 1 <= burst["c"] <= 4
    assert sum(burst.values()) == 10


def test_a_new_report_resets_the_local_bumps():
    b = Balancer()
    first = [fed("a", 0, 0, report=1), fed("b", 0, 1, report=1)]
    assert [pick_address(b, first) for _ in range(2)] == ["a", "b"]  # a bumped to 4 > b's 1
    assert b.picks_since_report(first[0]) == 1
    # The engines report again (a now runs the request it got): bumps are part of the counts.
    second = [fed("a", 0, 1, report=2), fed("b", 0, 2, report=2)]
    assert b.picks_since_report(second[0]) == 0
    assert b.scores(second) == [1.0, 2.0]
    # The same report seen again keeps the bumps made on top of it.
    assert pick_address(b, second) == "a"
    assert b.scores(second) == [1.0 + 4, 2.0]


def test_without_a_feed_the_pool_balances_on_in_flight_counts():
    b = Balancer()
    candidates = [Candidate("a", in_flight=3), Candidate("b", in_flight=1), Candidate("c", in_flight=2)]
    assert not b.uses_feed(candidates)
    assert pick_address(b, candidates) == "b"


def test_one_stale_engine_makes_the_whole_pool_use_in_flight_counts():
    b = Balancer()
    # By the feed, a would win (0 < 8); but b is stale, so in-flight counts decide, consistently.
    candidates = [fed("a", 0, 0, in_flight=5), fed("b", 2, 0, stale=True, in_flight=0)]
    assert not b.uses_feed(candidates)
    assert pick_address(b, candidates) == "b"
    fresh = [fed("a", 0, 0, in_flight=5), fed("b", 2, 0, in_flight=0)]
    assert b.uses_feed(fresh) and pick_address(b, fresh) == "a"


def test_round_robin_ignores_load():
    b = Balancer(Policy.ROUND_ROBIN)
    candidates = [fed("a", 9, 9), fed("b", 0, 0), Candidate("c", in_flight=50)]
    assert [pick_address(b, candidates) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_no_candidates_is_an_error_not_a_guess():
    with pytest.raises(NoCandidates):
        Balancer().pick([])


# --- prefix-aware -------------------------------------------------------------------------------------

def test_prefix_bonus_sends_the_request_where_its_blocks_are():
    b = Balancer(Policy.PREFIX_AWARE)
    candidates = [fed("a", 0, 1), fed("b", 0, 3, cached_blocks=4), fed("c", 0, 2)]
    assert pick_address(b, candidates) == "b"  # 3 - 4*2 beats 1
    assert pick_address(Balancer(Policy.LEAST_LOADED), candidates) == "a"  # the bonus is prefix-aware only


def test_more_leading_blocks_win_over_fewer():
    scores = apply_prefix_bonus([2.0, 2.0, 2.0], [1, 3, 0])
    assert scores == [2.0 - PREFIX_BLOCK_BONUS, 2.0 - 3 * PREFIX_BLOCK_BONUS, 2.0]


def test_an_overloaded_engine_gets_no_prefix_bonus():
    b = Balancer(Policy.PREFIX_AWARE)
    # margin = max(8, least=1) = 8: b's 1*4+6 = 10 is within 1 + 8? no (10 > 9): overloaded.
    candidates = [fed("a", 0, 1), fed("b", 1, 6, cached_blocks=10)]
    assert apply_prefix_bonus(b.scores(candidates), [0, 10]) == [1.0, 10.0]
    assert pick_address(b, candidates) == "a"
    # Just inside the margin the bonus applies, capped at the margin itself.
    fresh = Balancer(Policy.PREFIX_AWARE)
    inside = [fed("a", 0, 1), fed("b", 0, 8, cached_blocks=10)]
    assert apply_prefix_bonus(fresh.scores(inside), [0, 10]) == [1.0, 8.0 - OVERLOAD_SLACK]
    assert pick_address(fresh, inside) == "b"


def test_the_overload_margin_grows_with_the_least_load():
    # Busy pool: least 20, margin 20: 39 is inside (gets the bonus), 41 is overloaded.
    assert apply_prefix_bonus([20.0, 39.0, 41.0], [0, 4, 4]) == [20.0, 39.0 - 4 * PREFIX_BLOCK_BONUS, 41.0]


def test_prefix_hashes_match_the_engines_chained_hashes_and_count_leading_blocks():
    tokens = list(range(100, 150))
    hashes = prompt_block_hashes(tokens, 16)
    assert hashes == hash_block_tokens(tokens, 16) and len(hashes) == 3  # full blocks only
    assert leading_matches(hashes, set(hashes)) == 3
    assert leading_matches(hashes, {hashes[0], hashes[2]}) == 1  # a gap ends the prefix
    other = prompt_block_hashes([7] + tokens[1:], 16)
    assert leading_matches(other, set(hashes)) == 0  # chained: a different first block changes all


def test_block_index_follows_stored_removed_and_cleared_events():
    index = BlockIndex()
    h = [bytes([i]) * 32 for i in range(4)]
    index.apply({"id": "e1", "stored": h[:3], "removed": [], "cleared": False})
    assert index.matches("e1", h) == 3
    index.apply({"id": "e1", "stored": [h[3]], "removed": [h[1]]})
    assert index.matches("e1", h) == 1
    index.apply({"id": "e1", "cleared": True, "stored": [h[0]]})  # cleared applies first
    assert index.held("e1") == {h[0]}
    assert index.matches("e2", h) == 0


# --- the feed state ---------------------------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def engine(address: str, waiting: int = 0, running: int = 0, step: int = 1, stale: bool = False, **kw) -> dict:
    return dict(id=kw.pop("id", address), role="decode", address=address, dp_rank=0, waiting=waiting, running=running,
                kv_usage=0.1, step=step, wave=0, block_size=16, stale=stale, **kw)


def test_feed_entries_are_matched_by_address_and_expire_after_silence():
    clock = Clock()
    state = FeedState(clock=clock, timeout=3.0)
    assert state.load("127.0.0.1:1") is None and not state.alive()
    message = msgspec.msgpack.encode({"updated": 1.0, "engines": [engine("127.0.0.1:1", waiting=2, running=1)],
                                      "block_events": []})
    state.apply(msgspec.msgpack.decode(message))
    load = state.load("127.0.0.1:1")
    assert load is not None and (load.waiting, load.running, load.stale) == (2, 1, False)
    assert state.load("127.0.0.1:2") is None
    clock.now += 2.9
    assert state.alive()
    clock.now += 0.2  # no publish for 3 s: the coordinator is gone, balance on own counts
    assert not state.alive() and state.load("127.0.0.1:1") is None


def test_feed_report_counter_moves_only_when_an_engines_counts_change():
    state = FeedState(clock=Clock())
    state.apply({"engines": [engine("h:1", running=1, step=5)]})
    first = state.load("h:1").report
    state.apply({"engines": [engine("h:1", running=1, step=5)]})  # republished, nothing new
    assert state.load("h:1").report == first
    state.apply({"engines": [engine("h:1", running=2, step=6)]})
    assert state.load("h:1").report == first + 1


def test_feed_stale_flag_and_block_events_reach_the_balancer_inputs():
    state = FeedState(clock=Clock())
    hashes = hash_block_tokens(list(range(64)), 16)
    state.apply({"engines": [engine("h:1", id="e1"), engine("h:2", id="e2", stale=True)],
                 "block_events": [{"id": "e1", "stored": hashes, "removed": [], "cleared": False}]})
    assert state.load("h:2").stale
    report = state.report("h:1")
    assert report.engine_id == "e1" and report.block_size == 16
    assert state.blocks.matches("e1", hashes) == 4
    # An engine that leaves the feed takes its blocks with it.
    state.apply({"engines": [engine("h:2", id="e2")]})
    assert state.blocks.matches("e1", hashes) == 0 and state.report("h:1") is None
