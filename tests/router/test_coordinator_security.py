"""`pdserve coordinator` against peers without the internal key, and the bounds on what reports carry.

Real coordinator processes on 127.0.0.1; hand-made reports from raw zmq PUSH sockets (FakeEngine).
A forged report must change nothing in /stats (which the operator's autoscaler reads), a forged
subscriber must hear nothing, and /blocks (which tells which prompts were sent) answers key
holders only. Without any key the coordinator runs plain, as before, and says so at start-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time

import httpx
import msgspec
import pytest
import zmq

from pdserve.engine import internal_auth
from pdserve.engine.core.load_reporter import MAX_BLOCK_EVENTS_PER_REPORT, MAX_REPORT_BYTES, LoadReport
from pdserve.router import coordinator_state
from pdserve.router.coordinator_state import MAX_REQUESTS, Ignored, LoadBook
from pdserve.router.feed import FeedState, FeedSubscriber
from support.coordinator import FakeEngine, Subscriber, run_coordinator, wait_for

pytestmark = pytest.mark.timeout(180)
WRONG_KEY = b"not-the-deployment-key-" + os.urandom(8).hex().encode()


def env_without_key() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in (internal_auth.ENV_KEY, internal_auth.ENV_KEY_FILE)}


def report(engine_id: str = "e", seq: int = 1, at: float = 1000.0, **fields) -> LoadReport:
    values = dict(role="decode", address="10.0.0.1:8000", dp_rank=0, waiting=0, running=0, kv_usage=0.0, step=0)
    values.update(fields)
    return LoadReport(id=engine_id, seq=seq, time=at, **values)


# --- bounds on what one report may say (pure bookkeeping) ------------------------------------------

@pytest.mark.parametrize("fields", [
    dict(waiting=MAX_REQUESTS + 1), dict(running=MAX_REQUESTS + 1), dict(waiting=-1), dict(dp_rank=-1),
    dict(kv_usage=1.5), dict(kv_usage=-0.1), dict(kv_usage=math.nan), dict(kv_usage=math.inf),
    dict(at=math.inf), dict(block_size=1 << 20), dict(stored=[bytes(65)]), dict(address="x" * 1000),
])
def test_absurd_values_are_rejected_and_change_nothing(fields):
    book = LoadBook()
    assert book.accept(report(seq=1, waiting=3), now=0.0) is None
    assert book.accept(report(seq=2, **fields), now=0.1) is Ignored.INVALID
    assert book.engines["e"].report.waiting == 3 and book.engines["e"].report.seq == 1


def test_block_hashes_are_bounded_per_report_and_per_engine(monkeypatch):
    book = LoadBook()
    hashes = [i.to_bytes(32, "big") for i in range(MAX_BLOCK_EVENTS_PER_REPORT + 100)]
    assert book.accept(report(seq=1, stored=hashes), now=0.0) is None
    assert len(book.engines["e"].blocks) == MAX_BLOCK_EVENTS_PER_REPORT
    assert book.hashes_dropped == {"per_report": 100, "per_engine": 0}
    event = book.take_update().block_events[0]
    assert len(event.stored) == MAX_BLOCK_EVENTS_PER_REPORT  # routers hear only what was kept

    monkeypatch.setattr(coordinator_state, "MAX_BLOCKS_PER_ENGINE", 10)
    small = LoadBook()
    small.accept(report(seq=1, stored=hashes[:8]), now=0.0)
    small.accept(report(seq=2, at=1000.1, stored=hashes[8:15], removed=hashes[:2]), now=0.1)
    assert list(small.engines["e"].blocks) == hashes[2:12] and small.hashes_dropped["per_engine"] == 3
    # Re-storing a held hash is not growth, and removals make room again.
    small.accept(report(seq=3, at=1000.2, stored=[hashes[2], hashes[20]], removed=[hashes[3]]), now=0.2)
    assert len(small.engines["e"].blocks) == 10 and hashes[20] in small.engines["e"].blocks


# --- real processes --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    with run_coordinator(tmp_path=tmp_path_factory.mktemp("secure-coordinator")) as c:
        yield c


def test_forged_reports_change_nothing_the_autoscaler_sees(coordinator):
    before_reports = coordinator.metric("pdserve_coordinator_reports_total")
    forgers = [FakeEngine(coordinator.stats_address, "forged", key=key) for key in (None, WRONG_KEY)]
    honest = FakeEngine(coordinator.stats_address, "honest")
    try:
        for forger in forgers:
            # The attack: the autoscaler would scale to the max. Refused at the handshake, a forger may have
            # no connection left to queue its report on (the send then times out): that changes nothing either.
            with contextlib.suppress(zmq.Again):
                forger.report(waiting=100000, running=5000)
        time.sleep(1.0)  # time for the forged handshakes to fail
        honest.report(waiting=1)
        wait_for(lambda: coordinator.engine("honest"), "the honest report")
        time.sleep(0.5)
        stats = coordinator.stats()
        assert [e["id"] for e in stats["engines"]] == ["honest"]
        assert max(e["waiting"] for e in stats["engines"]) == 1
        assert coordinator.metric("pdserve_coordinator_reports_total") == before_reports + 1
    finally:
        for fake in (*forgers, honest):
            fake.close()


def test_a_subscriber_without_the_key_hears_nothing(coordinator):
    outsider, member = Subscriber(coordinator.publish_port, key=None), Subscriber(coordinator.publish_port)
    try:
        assert member.updates(1.0), "a key holder hears the feed"
        assert outsider.updates(1.0) == []
    finally:
        outsider.close()
        member.close()


def test_blocks_answers_key_holders_only_and_stats_stays_open(coordinator):
    fake = FakeEngine(coordinator.stats_address, "with-blocks")
    try:
        fake.report(stored=[b"\x01" * 32])
        wait_for(lambda: coordinator.engine("with-blocks"), "the report")
        assert httpx.get(f"{coordinator.url}/blocks", timeout=10).status_code == 401
        wrong = {internal_auth.HEADER: WRONG_KEY.decode()}
        assert httpx.get(f"{coordinator.url}/blocks", headers=wrong, timeout=10).status_code == 401
        ok = httpx.get(f"{coordinator.url}/blocks", headers={internal_auth.HEADER: internal_auth.load_internal_key()
                                                             .decode()}, timeout=10)
        assert ok.status_code == 200 and ok.json()["with-blocks"] == ["01" * 32]
        assert httpx.get(f"{coordinator.url}/stats", timeout=10).status_code == 200

        # The router's seed of its prefix index sends the key.
        async def seed() -> FeedState:
            state = FeedState()
            async with httpx.AsyncClient() as client:
                await FeedSubscriber("unused:1", state, f"{coordinator.url}/blocks", client).seed()
            return state

        assert asyncio.run(seed()).blocks.held("with-blocks") == {b"\x01" * 32}
    finally:
        fake.close()


def test_an_oversized_report_is_dropped_and_a_large_one_is_capped(coordinator):
    fake = FakeEngine(coordinator.stats_address, "big-reporter")
    try:
        fake.send_raw(bytes(MAX_REPORT_BYTES + 1))  # libzmq drops the peer before allocating it
        many = [i.to_bytes(32, "big") for i in range(MAX_BLOCK_EVENTS_PER_REPORT + 10)]
        dropped = coordinator.metric("pdserve_coordinator_block_hashes_dropped_total", bound="per_report")
        fake.report(stored=many)
        entry = wait_for(lambda: coordinator.engine("big-reporter"), "the capped report", timeout=30)
        assert entry["cached_blocks"] == MAX_BLOCK_EVENTS_PER_REPORT
        assert coordinator.metric("pdserve_coordinator_block_hashes_dropped_total",
                                  bound="per_report") == dropped + 10
        assert coordinator.proc.poll() is None
    finally:
        fake.close()


def test_without_a_key_the_coordinator_runs_plain_and_warns(tmp_path):
    with run_coordinator(tmp_path=tmp_path, env=env_without_key()) as plain:
        fake, sub = FakeEngine(plain.stats_address, "plain", key=None), Subscriber(plain.publish_port, key=None)
        try:
            fake.report(waiting=2, stored=[b"\x02" * 32])
            wait_for(lambda: plain.engine("plain"), "the plain report")
            sub.until(lambda u: any(e.id == "plain" for e in u.engines), "the plain engine")
            assert httpx.get(f"{plain.url}/blocks", timeout=10).json() == {"plain": ["02" * 32]}
        finally:
            fake.close()
            sub.close()
        assert plain.log().count("are unauthenticated") == 1


def test_internal_key_file_flag_secures_the_coordinator(tmp_path):
    key_file = tmp_path / "internal-key"
    key_file.write_text(internal_auth.load_internal_key().decode())
    with run_coordinator("--internal-key-file", str(key_file), tmp_path=tmp_path, env=env_without_key()) as c:
        outsider, member = FakeEngine(c.stats_address, "outsider", key=None), FakeEngine(c.stats_address, "member")
        try:
            # Refused at the handshake, the outsider may have no connection to queue its report on at all.
            with contextlib.suppress(zmq.Again):
                outsider.report()
            member.report()
            wait_for(lambda: c.engine("member"), "the member's report")
            time.sleep(0.3)
            assert c.engine("outsider") is None
            assert httpx.get(f"{c.url}/blocks", timeout=10).status_code == 401
        finally:
            outsider.close()
            member.close()
        assert "are unauthenticated" not in c.log()


def test_a_report_decodes_within_the_message_limit():
    # The largest report an honest engine sends fits ZMQ_MAXMSGSIZE with room to spare.
    biggest = report(stored=[bytes(32)] * MAX_BLOCK_EVENTS_PER_REPORT, address="h" * 512, engine_id="i" * 512)
    assert len(msgspec.msgpack.encode(biggest)) < MAX_REPORT_BYTES // 2
