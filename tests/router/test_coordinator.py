"""The coordinator: real engines report to a real coordinator process; routers read its feed.

One coordinator and two engine servers (demo model, a decode and a prefill one) are shared by the
module; the last test kills the prefill engine. Hand-made reports come from a raw zmq PUSH socket.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import yaml

from pdserve.engine.core.kv_cache_utils import hash_block_tokens
from pdserve.engine.core.load_reporter import LoadReport
from pdserve.operator.autoscaler import PoolLoad, parse_stats
from pdserve.operator.render import render
from pdserve.router.coordinator_state import RESTART_MIN_GAP, Ignored, LoadBook
from support.auth import internal_headers
from support.coordinator import FakeEngine, Subscriber, run_coordinator, stop, wait_for
from support.server import free_port, run_server, wait_healthy

REPO = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 16
FORGET_AFTER = 3.0  # instead of 60 s, so the test sees a dead engine dropped


# --- the bookkeeping rules, with a hand-driven clock ---------------------------------------------

def report(engine_id: str = "e", seq: int = 1, at: float = 1000.0, **fields) -> LoadReport:
    values = dict(role="decode", address="10.0.0.1:8000", dp_rank=0, waiting=0, running=0, kv_usage=0.0, step=0)
    values.update(fields)
    return LoadReport(id=engine_id, seq=seq, time=at, **values)


def test_the_freshest_report_wins_and_a_restart_starts_a_new_sequence():
    book = LoadBook()
    assert book.accept(report(seq=10, at=1000.0, waiting=5, stored=[b"a"]), now=0.0) is None
    assert book.accept(report(seq=9, at=1000.5, waiting=6), now=0.1) is Ignored.OLD_SEQ
    assert book.accept(report(seq=10, at=1000.0, waiting=6), now=0.1) is Ignored.OLD_SEQ
    assert book.accept(report(seq=11, at=999.0, waiting=6), now=0.1) is Ignored.OLDER_TIME
    assert book.accept(report(seq=11, at=1000.1, waiting=7, role="nonsense"), now=0.1) is Ignored.INVALID
    assert book.accept(report(seq=12, at=1000.1, waiting=7), now=0.1) is None
    assert book.engines["e"].report.waiting == 7

    # The engine restarted: seq begins again, the clock has moved on; its old blocks are gone.
    restarted = report(seq=1, at=1000.1 + RESTART_MIN_GAP + 5, waiting=1, stored=[b"b"], cleared=True)
    assert book.accept(restarted, now=8.0) is None
    assert book.engines["e"].report.waiting == 1 and list(book.engines["e"].blocks) == [b"b"]
    # ...and a late message from the process before it changes nothing.
    assert book.accept(report(seq=13, at=1000.2, waiting=9), now=8.1) is Ignored.OLDER_TIME


def test_silent_engines_go_stale_then_are_forgotten_with_their_blocks():
    book = LoadBook(stale_after=3.0, forget_after=60.0)
    book.accept(report("quiet", stored=[b"q1", b"q2"]), now=0.0)
    book.accept(report("chatty"), now=0.0)
    first = book.take_update(wall_time=1.0)
    assert [e.id for e in first.engines] == ["quiet", "chatty"] and not any(e.stale for e in first.engines)
    assert [(b.id, b.stored) for b in first.block_events] == [("quiet", [b"q1", b"q2"])]

    for i in range(1, 5):
        book.accept(report("chatty", seq=1 + i, at=1000.0 + i), now=float(i))
    book.sweep(now=4.0)
    assert book.urgent  # routers hear of it at once
    update = book.take_update()
    assert {e.id: e.stale for e in update.engines} == {"quiet": True, "chatty": False}
    assert book.blocks_hex() == {"quiet": [b"q1".hex(), b"q2".hex()], "chatty": []}

    book.sweep(now=4.0 + 60.0)
    update = book.take_update()
    assert [e.id for e in update.engines] == ["chatty"]
    assert [(b.id, b.cleared) for b in update.block_events if b.id == "quiet"] == [("quiet", True)]
    assert "quiet" not in book.blocks_hex()
    # A stale engine that reports again is live again.
    book.sweep(now=70.0)
    assert book.engines["chatty"].stale
    book.accept(report("chatty", seq=10, at=1010.0), now=70.5)
    assert not book.engines["chatty"].stale


# --- real processes ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def coordinator(tmp_path_factory):
    with run_coordinator("--forget-after", str(FORGET_AFTER), tmp_path=tmp_path_factory.mktemp("coordinator")) as c:
        yield c


@pytest.fixture(scope="module")
def engines(coordinator, tmp_path_factory):
    """{"decode": server, "prefill": server}, both reporting to the coordinator."""
    tmp = tmp_path_factory.mktemp("engines")
    # 256 MiB of KV: the 4 GiB default took ~12 s of each engine's start-up to allocate.
    flags = ("--coordinator-address", coordinator.stats_address, "--block-size", str(BLOCK_SIZE),
             "--kv-cache-memory-bytes", str(256 << 20))
    with run_server("demo", *flags, "--engine-role", "decode", "--max-num-seqs", "2", tmp_path=tmp) as decode, \
            run_server("demo", *flags, "--engine-role", "prefill", tmp_path=tmp) as prefill:
        yield {"decode": decode, "prefill": prefill}


def address_of(server) -> str:
    return f"127.0.0.1:{server.port}"


def listed(coordinator, server) -> dict | None:
    return next((e for e in coordinator.stats()["engines"] if e["address"] == address_of(server)), None)


@pytest.fixture
def subscriber(coordinator):
    sub = Subscriber(coordinator.publish_port)
    sub.until(lambda u: True, "a first update")  # connected: nothing published from here on is missed
    yield sub
    sub.close()


def test_stats_lists_every_engine_with_its_role_and_address(coordinator, engines):
    for role, server in engines.items():
        entry = wait_for(lambda: listed(coordinator, server), f"the {role} engine in /stats")
        assert entry["role"] == role
        assert (entry["waiting"], entry["running"], entry["stale"]) == (0, 0, False)
        assert 0.0 <= entry["kv_usage"] <= 1.0 and entry["block_size"] == BLOCK_SIZE
    # What the operator's autoscaler makes of it: one live engine per pool, idle.
    loads = parse_stats(coordinator.stats())
    assert loads["decode"].engines == 1 and loads["prefill"].engines == 1
    assert (loads["decode"].waiting, loads["decode"].running) == (0, 0)
    assert coordinator.metric("pdserve_coordinator_engines", state="live") >= 2


# Tokens per request of the queue test: enough that requests wait through many coordinator updates (one
# per ~100 ms). At 96 a Zen 5 served all six in about 0.2 s and the test saw two snapshots, both after the queue.
QUEUED_TOKENS = 640


def test_waiting_and_running_follow_the_requests_and_return_to_zero(coordinator, engines, subscriber):
    decode = engines["decode"]
    wait_for(lambda: listed(coordinator, decode), "the decode engine in /stats")
    client = openai.OpenAI(base_url=decode.base_url, api_key="none", max_retries=0, timeout=120)

    def generate(i: int) -> int:
        out = client.completions.create(model="demo", prompt=f"request {i}", max_tokens=QUEUED_TOKENS,
                                        extra_body={"ignore_eos": True})
        return out.usage.completion_tokens

    seen: list[tuple[int, int]] = []
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(generate, i) for i in range(6)]  # 6 requests, --max-num-seqs 2
        while not all(f.done() for f in futures):
            entry = listed(coordinator, decode)
            assert entry is not None and not entry["stale"], coordinator.stats()
            seen.append((entry["waiting"], entry["running"]))
            time.sleep(0.05)
        assert [f.result() for f in futures] == [QUEUED_TOKENS] * 6
    assert any(running == 2 and waiting > 0 for waiting, running in seen), seen
    assert all(running <= 2 for _, running in seen)
    entry = wait_for(lambda: (e := listed(coordinator, decode)) and e["running"] == 0 and e["waiting"] == 0 and e,
                     "the counts back at zero")
    assert not entry["stale"]

    # The publish feed carried the same load to routers while it happened.
    loads = []
    for update in subscriber.updates(0.3):  # everything published since the requests began, and then some
        loads += [(e.waiting, e.running) for e in update.engines if e.address == address_of(decode)]
    assert any(running == 2 and waiting > 0 for waiting, running in loads)
    assert loads[-1] == (0, 0)


def test_publishes_come_about_every_100ms_with_every_engine(coordinator, engines, subscriber):
    for server in engines.values():
        wait_for(lambda: listed(coordinator, server), "the engines in /stats")
    updates = subscriber.updates(2.0)
    # ~20 at 100 ms; loose bounds, the machine is shared.
    assert 8 <= len(updates) <= 60, len(updates)
    assert all(b.updated >= a.updated for a, b in zip(updates, updates[1:]))
    stats = {e["address"]: e for e in coordinator.stats()["engines"]}
    for update in updates:
        published = {e.address: e for e in update.engines}
        for server in engines.values():
            entry = published[address_of(server)]
            assert (entry.id, entry.role, entry.stale) == (stats[entry.address]["id"], stats[entry.address]["role"],
                                                           False)


def test_block_events_carry_the_engines_own_prefix_hashes(coordinator, engines, subscriber):
    decode = engines["decode"]
    engine_id = wait_for(lambda: listed(coordinator, decode), "the decode engine")["id"]
    rng = random.Random(11)
    prompt = [rng.randrange(10, 4000) for _ in range(4 * BLOCK_SIZE + 3)]  # 4 full blocks, never seen before
    expected = hash_block_tokens(prompt, BLOCK_SIZE)
    client = openai.OpenAI(base_url=decode.base_url, api_key="none", max_retries=0, timeout=60)
    first = client.completions.create(model="demo", prompt=prompt, max_tokens=3)
    assert first.usage.prompt_tokens == len(prompt)

    stored: list[bytes] = []

    def has_all(update) -> bool:
        for event in update.block_events:
            if event.id == engine_id:
                assert not set(event.removed) & set(expected)
                stored.extend(event.stored)
        return set(expected) <= set(stored)

    subscriber.until(has_all, "the prompt's block hashes")
    assert sorted(stored) == sorted(expected)  # exactly the prompt's blocks (3 generated tokens fill none)
    blocks = httpx.get(f"{coordinator.url}/blocks", headers=internal_headers(), timeout=10).json()
    assert {h.hex() for h in expected} <= set(blocks[engine_id])

    # The same prompt again hits those blocks, and publishes nothing new.
    again = client.completions.create(model="demo", prompt=prompt, max_tokens=3)
    assert again.usage.prompt_tokens_details.cached_tokens == 4 * BLOCK_SIZE
    later = subscriber.updates(0.5)
    assert not [e for u in later for e in u.block_events if e.id == engine_id and e.stored]


def test_out_of_order_duplicate_and_garbage_reports_are_ignored(coordinator):
    fake = FakeEngine(coordinator.stats_address, "fake-order", role="decode", address="10.9.9.9:8000")
    before = {reason: coordinator.metric("pdserve_coordinator_reports_ignored_total", reason=reason.value)
              for reason in Ignored}
    try:
        base = time.time()
        fake.report(seq=5, time_=base, waiting=3)
        fake.report(seq=4, time_=base + 0.1, waiting=90)  # late
        fake.report(seq=5, time_=base, waiting=91)  # duplicate
        fake.report(seq=6, time_=base - 1, waiting=92)  # newer seq from an older process
        fake.send_raw(b"\xc1 not msgpack")
        fake.send_raw(msgspec.msgpack.encode({"id": "fake-order", "seq": 9}))  # fields missing
        fake.send_raw(b"two", b"frames")
        fake.send_raw(msgspec.msgpack.encode(report("fake-order", seq=7, at=base, role="router")))
        fake.report(seq=8, time_=base + 0.2, waiting=1)
        entry = wait_for(lambda: (e := coordinator.engine("fake-order")) and e["waiting"] == 1 and e,
                         "the last good report")
        assert entry["address"] == "10.9.9.9:8000"
        after = {reason: coordinator.metric("pdserve_coordinator_reports_ignored_total", reason=reason.value)
                 for reason in Ignored}
        assert {r.value: after[r] - before[r] for r in Ignored} == {
            "old_seq": 2, "older_time": 1, "malformed": 3, "invalid": 1}

        # Restarted engine: seq 1 again, later clock -> accepted.
        fake.report(seq=1, time_=base + RESTART_MIN_GAP + 5, waiting=2)
        wait_for(lambda: (coordinator.engine("fake-order") or {}).get("waiting") == 2, "the restarted engine")
        assert coordinator.proc.poll() is None
        assert httpx.get(f"{coordinator.url}/health", timeout=10).status_code == 200
    finally:
        fake.close()


def test_rendered_coordinator_command_starts_and_serves(tmp_path):
    sample = yaml.safe_load((REPO / "crds" / "examples" / "demo.yaml").read_text())
    deployment = next(m for m in render(sample) if m["kind"] == "Deployment" and m["metadata"]["name"].endswith(
        "-coordinator"))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    argv = [*container["command"], *container["args"]]
    assert argv[:2] == ["pdserve", "coordinator"]
    ports = {"--stats-port": free_port(), "--publish-port": free_port(), "--http-port": free_port()}
    for flag, rendered in (("--stats-port", "5557"), ("--publish-port", "5558"), ("--http-port", "8080")):
        i = argv.index(flag) + 1
        assert argv[i] == rendered
        argv[i] = str(ports[flag])
    log_path = tmp_path / "coordinator.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", *argv], stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONSAFEPATH="1"), start_new_session=True)
    url = f"http://127.0.0.1:{ports['--http-port']}"
    sub = fake = None
    try:
        wait_healthy(url, proc, log_path, timeout=60)
        probe = container["readinessProbe"]["httpGet"]["path"]
        assert httpx.get(url + probe, timeout=10).status_code == 200
        sub = Subscriber(ports["--publish-port"])
        fake = FakeEngine(f"127.0.0.1:{ports['--stats-port']}", "rendered-1", role="prefill", address="10.1.1.1:8000")
        fake.report(waiting=4)
        update = sub.until(lambda u: any(e.id == "rendered-1" for e in u.engines), "the reporting engine")
        assert [(e.role, e.waiting) for e in update.engines] == [("prefill", 4)]
        assert parse_stats(httpx.get(url + "/stats", timeout=10).json()) == {"prefill": PoolLoad(1, 4, 0, 0.0)}
        assert "pdserve_coordinator_publishes_total" in httpx.get(url + "/metrics", timeout=10).text
    finally:
        for sock in (sub, fake):
            if sock is not None:
                sock.close()
        stop(proc)
    assert proc.returncode == 0, log_path.read_text()


def test_a_killed_engine_goes_stale_then_is_dropped(coordinator, engines, subscriber):
    """Runs last: it kills the module's prefill engine."""
    prefill, decode = engines["prefill"], engines["decode"]
    engine_id = wait_for(lambda: listed(coordinator, prefill), "the prefill engine")["id"]
    os.killpg(prefill.proc.pid, signal.SIGKILL)
    prefill.proc.wait()

    entry = wait_for(lambda: (e := coordinator.engine(engine_id)) and e["stale"] and e, "the dead engine marked stale",
                     timeout=15)
    assert entry["age"] >= 3.0  # the default --stale-after
    assert parse_stats(coordinator.stats()).get("prefill") is None  # the autoscaler no longer counts it
    subscriber.until(lambda u: any(e.id == engine_id and e.stale for e in u.engines), "the engine published stale")

    seen: list = []
    subscriber.until(lambda u: all(e.id != engine_id for e in u.engines), "the engine dropped from the feed",
                     timeout=FORGET_AFTER + 15, seen=seen)
    assert any(b.id == engine_id and b.cleared for u in seen for b in u.block_events)
    assert coordinator.engine(engine_id) is None
    assert engine_id not in httpx.get(f"{coordinator.url}/blocks", headers=internal_headers(), timeout=10).json()
    alive = listed(coordinator, decode)
    assert alive is not None and not alive["stale"]  # the idle decode engine keeps its heartbeat
