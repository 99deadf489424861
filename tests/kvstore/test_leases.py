"""Leases on KV a prefill engine holds for a remote decode: renewal, expiry, release, in parts.

The registry runs on an injected clock; the side channel and the decode side's lease keeper run
over real sockets on 127.0.0.1 in this process; the scheduler side of the connector gets
hand-made requests. The engines as real processes are in tests/faults/test_held_kv.py.
"""

from __future__ import annotations

import socket
import struct
import time
from types import SimpleNamespace

import msgspec
import pytest
import torch

from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvstore.base import KVConnectorRole
from pdserve.kvstore.binding import prompt_digest
from pdserve.kvstore.config import KVTransferConfigError, parse_kv_transfer_config
from pdserve.kvstore.lease_keeper import LeaseKeeper, LeaseWatch
from pdserve.kvstore.p2p import P2PConnector
from pdserve.kvstore.send_registry import SendRegistry, UnknownRequest
from pdserve.kvstore.transport_tcp import AuthenticationError, BlockClient, BlockServer, HeldKV, TransferError
from support.server import free_port

BLOCK = 16
PROMPT = list(range(100, 150))  # 50 tokens: 4 blocks
DIGEST = prompt_digest(PROMPT)
OTHER = prompt_digest([1, 2, 3])
KEY = b"the-right-key-0123456789"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# -- the registry ---------------------------------------------------------------------------------

def test_a_renewed_lease_outlives_its_first_term_and_an_unrenewed_one_expires():
    clock = Clock()
    reg = SendRegistry(clock)
    reg.hold("kept", [1, 2], timeout_s=5, digest=DIGEST)
    reg.hold("left", [3], timeout_s=5, digest=DIGEST)
    expired = []
    for _ in range(4):  # 16 s in all, renewed every 4 s: three leases' worth
        clock.now += 4
        assert reg.renew("kept", DIGEST)
        expired.append(reg.expire())
    assert expired == [0, 1, 0, 0]  # "left" went at its first term's end
    assert reg.take_finished() == {"left"} and reg.num_held == 1
    clock.now += 5.5  # no renewal for longer than the lease
    assert reg.expire() == 1 and reg.take_finished() == {"kept"}
    assert reg.num_expired == 2 and reg.num_blocks_expired == 3
    assert not reg.renew("kept", DIGEST)  # gone: a renewal cannot bring it back


def test_only_a_reader_of_the_prompt_renews():
    clock = Clock()
    reg = SendRegistry(clock)
    reg.hold("r", [1], timeout_s=5, digest=DIGEST)
    clock.now += 4
    for digest in (OTHER, "", None, "zz" * 32):
        assert not reg.renew("r", digest)
    clock.now += 1.5
    assert reg.expire() == 1  # the refused renewals did not extend it


def test_a_renewal_may_come_before_the_hold_is_registered():
    """The decode side can ask before the prefill rank ran the step that registers the hold: that
    is no failure, and the hold starts with a full lease anyway."""
    clock = Clock()
    reg = SendRegistry(clock)
    assert reg.renew("soon", DIGEST)
    assert not reg.renew("soon", "not a digest")
    reg.hold("soon", [1], timeout_s=5, digest=DIGEST)
    reg.done("soon", expected=1, digest=DIGEST)
    assert not reg.renew("soon", DIGEST)  # released: known to be gone


def test_a_release_frees_now_or_once_the_reads_in_progress_end():
    clock = Clock()
    reg = SendRegistry(clock)
    reg.hold("idle", [1], timeout_s=30, digest=DIGEST)
    reg.hold("busy", [2, 3], timeout_s=30, digest=DIGEST)
    assert not reg.release("idle", OTHER)  # another prompt's reader cannot
    assert reg.release("idle", DIGEST)
    assert reg.take_finished() == {"idle"}
    assert not reg.release("idle", DIGEST)  # nothing held any more

    reg.begin_read("busy", DIGEST, [2])
    assert reg.release("busy", DIGEST)
    assert reg.take_finished() == set()  # never mid-read
    with pytest.raises(UnknownRequest) as refused:  # but no new read starts
        reg.begin_read("busy", DIGEST, [3])
    assert not refused.value.retry
    assert not reg.renew("busy", DIGEST)
    reg.end_read("busy")
    assert reg.take_finished() == {"busy"} and reg.num_held == 0
    assert reg.num_expired == 0


# -- the side channel -----------------------------------------------------------------------------

def caches(fill: bool = True) -> list[torch.Tensor]:
    return [torch.randn(2, 8, BLOCK, 4, 8) if fill else torch.zeros(2, 8, BLOCK, 4, 8) for _ in range(2)]


@pytest.fixture
def side_channel():
    clock = Clock()
    registry = SendRegistry(clock)
    registry.hold("req", [1, 2], timeout_s=5, digest=DIGEST)
    registry.hold("other", [5, 6], timeout_s=5, digest=OTHER)
    server = BlockServer(caches(), registry, "127.0.0.1", 0, key=KEY, handshake_timeout_s=1.0)
    yield server, registry, clock, ("127.0.0.1", server.port)
    server.close()


def test_renewals_over_the_side_channel_need_the_key_and_the_prompt(side_channel):
    server, registry, clock, peer = side_channel
    client = BlockClient(caches(fill=False), timeout_s=2, key=KEY)
    clock.now += 4
    missing = client.renew(peer, [HeldKV("req", DIGEST), HeldKV("other", DIGEST), HeldKV("never", DIGEST)])
    assert missing == ["other"]  # the digest of another prompt renews nothing
    clock.now += 3  # 7 s after the hold: only the renewed lease is still running
    assert registry.expire() == 1 and registry.take_finished() == {"other"}

    wrong = BlockClient(caches(fill=False), timeout_s=2, key=b"a-wrong-key-0123456789")
    with pytest.raises(AuthenticationError):
        wrong.renew(peer, [HeldKV("req", DIGEST)])
    clock.now += 2.5  # past the lease the good renewal gave; the refused one added nothing
    assert registry.expire() == 1 and registry.take_finished() == {"req"}
    assert server.auth_failures == 1
    client.close()


def test_an_unauthenticated_renewal_is_never_read(side_channel):
    server, registry, clock, peer = side_channel
    body = msgspec.msgpack.encode({"op": "renew", "leases": [["req", DIGEST]]})
    sock = socket.create_connection(peer)
    sock.sendall((struct.pack("!I", len(body)) + body).ljust(64, b"\0"))  # in place of the handshake's proof
    sock.settimeout(3)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    sock.close()
    clock.now += 5
    assert registry.expire() == 2  # neither lease was renewed
    assert server.auth_failures == 1


def test_a_malformed_renewal_is_answered_and_changes_nothing(side_channel):
    _, registry, clock, peer = side_channel
    client = BlockClient(caches(fill=False), timeout_s=2, key=KEY)
    for leases in ("req", [["req"]], [["req", DIGEST, 1]], [[1, DIGEST]], [["req", DIGEST]] * 5000):
        with pytest.raises(TransferError, match="bad message"):
            client._ask(peer, {"op": "renew", "leases": leases}, time.monotonic() + 2)
    clock.now += 5
    assert registry.expire() == 2
    client.close()


# -- the decode side's lease keeper ------------------------------------------------------------------

def watch(req_id: str, remote: str, port: int, lease_s: float, digest: str = DIGEST) -> LeaseWatch:
    return LeaseWatch(req_id, remote, digest, "127.0.0.1", (port,), lease_s)


def wait_until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_the_keeper_renews_until_stopped_and_releases_what_will_not_be_pulled():
    registry = SendRegistry()  # real time: leases of 0.6 s, renewed every 0.2 s
    for name in ("waits", "pulled", "dropped"):
        registry.hold(name, [1], timeout_s=0.6, digest=DIGEST)
    server = BlockServer(caches(), registry, "127.0.0.1", 0, key=KEY)
    keeper = LeaseKeeper(BlockClient(caches(fill=False), timeout_s=2, key=KEY))
    try:
        for name in ("waits", "pulled", "dropped"):
            keeper.watch(watch(f"d-{name}", name, server.port, 0.6))
        time.sleep(1.5)  # well past two leases
        assert registry.expire() == 0 and registry.num_held == 3
        keeper.stop("d-pulled")  # its pull ended: its reader's own "done" follows, or the lease ends it
        keeper.drop("d-dropped", release=True)
        assert wait_until(lambda: "dropped" in registry.take_finished(), 2)
        assert wait_until(lambda: registry.expire() == 1, 3)  # "pulled", once its last renewal ran out
        assert registry.take_finished() == {"pulled"}
        time.sleep(0.8)
        assert registry.expire() == 0 and registry.num_held == 1  # "waits" is still being renewed
        assert keeper.take_failures() == 0 and keeper.renewals >= 6
    finally:
        keeper.close()
        server.close()


def test_failed_renewals_are_counted():
    registry = SendRegistry()
    server = BlockServer(caches(), registry, "127.0.0.1", 0, key=KEY)
    registry.hold("other-prompt", [1], timeout_s=30, digest=OTHER)
    registry.hold("gone", [2], timeout_s=30, digest=DIGEST)
    registry.release("gone", DIGEST)
    keeper = LeaseKeeper(BlockClient(caches(fill=False), timeout_s=1, key=KEY))
    try:
        keeper.watch(watch("a", "other-prompt", server.port, 30))  # a digest that is not the held prompt's
        keeper.watch(watch("b", "gone", server.port, 30))  # released already
        keeper.watch(watch("c", "x", free_port(), 0.3))  # nobody listens there: fails every 0.1 s
        assert wait_until(lambda: keeper.num_watched == 1, 3)  # holds that are gone are not asked for again
        time.sleep(0.5)
        failures = keeper.take_failures()
        assert failures >= 2 + 3
        assert keeper.num_watched == 1  # an unreachable peer may come back: still renewed
    finally:
        keeper.close()
        server.close()


# -- the connector's scheduler side ---------------------------------------------------------------

def connector(role: str, **extra) -> P2PConnector:
    config = SimpleNamespace(parallel=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0),
                             model=SimpleNamespace(num_key_value_heads=4), cache=SimpleNamespace(block_size=BLOCK),
                             advertise_address="127.0.0.1:8000", engine_id="engine")
    kv = parse_kv_transfer_config({"kv_connector": "p2p", "kv_role": role, "kv_connector_extra_config": extra})
    conn = P2PConnector(config, KVConnectorRole.SCHEDULER, kv)
    conn.set_worker_info([{"port": 9100, "transport": "tcp"}])
    return conn


def prefill_params(lease: float = 7.0) -> dict:
    prefill = connector("kv_producer", kv_lease_duration=lease)
    delay, params = prefill.request_finished(Request("p-1", list(PROMPT), SamplingParams(max_tokens=1), None,
                                                     kv_transfer_params={"do_remote_decode": True}), [3, 4, 5, 6])
    assert delay
    return params


def decode_request(params: dict, req_id: str = "d-1") -> Request:
    return Request(req_id, list(PROMPT), SamplingParams(max_tokens=4), eos_token_id=None, kv_transfer_params=params)


def test_the_prefill_answers_with_its_lease_and_holds_for_that_long():
    prefill = connector("kv_producer", kv_lease_duration=7)
    _, params = prefill.request_finished(Request("p-1", list(PROMPT), SamplingParams(max_tokens=1), None,
                                                 kv_transfer_params={"do_remote_decode": True}), [3, 4, 5, 6])
    assert params["kv_lease_duration"] == 7.0
    (send,) = prefill.build_connector_meta(None).send
    assert send.timeout_s == 7.0


def test_a_decode_request_is_watched_from_arrival_until_its_pull_is_handed_over():
    decode = connector("kv_consumer")
    req = decode_request(prefill_params(lease=7))
    decode.request_added(req)
    assert decode.has_pending_work()  # an idle engine must still step to hand this over
    meta = decode.build_connector_meta(None)
    (w,) = meta.watch
    assert (w.req_id, w.remote_req_id, w.prompt_digest, w.ports, w.lease_s) == ("d-1", "p-1", DIGEST, (9100,), 7.0)
    assert not decode.has_pending_work()
    assert decode.get_num_new_matched_tokens(req, 0) == (49, True)
    decode.update_state_after_alloc(req, [1, 2, 3, 4], 49)
    decode.request_finished(req, [1, 2, 3, 4])  # the pull was handed over: it says "done" itself
    meta = decode.build_connector_meta(None)
    assert len(meta.recv) == 1 and meta.drop == []


def test_a_decode_request_that_will_not_pull_releases_the_hold():
    decode = connector("kv_consumer")
    aborted, cached = decode_request(prefill_params(), "aborted"), decode_request(prefill_params(), "cached")
    for req in (aborted, cached):
        decode.request_added(req)
    decode.build_connector_meta(None)
    decode.request_finished(aborted, [])  # aborted while it waited in the queue
    # The whole prompt was in the local prefix cache: admitted with nothing to load.
    assert decode.get_num_new_matched_tokens(cached, 49) == (0, True)
    decode.update_state_after_alloc(cached, [1, 2, 3, 4], 0)
    assert cached.kv_transfer_params["do_remote_prefill"] is False  # never pulled later (after a preemption)
    assert decode.build_connector_meta(None).drop == ["aborted", "cached"]
    decode.request_finished(cached, [1, 2, 3, 4])
    assert decode.build_connector_meta(None) is None  # dropped once


def test_params_that_cannot_be_pulled_are_not_watched():
    decode = connector("kv_consumer")
    for params in (dict(prefill_params(), prompt_digest=OTHER), dict(prefill_params(), kv_lease_duration=-1),
                   dict(prefill_params(), kv_lease_duration=True), {"do_remote_prefill": True}, None):
        decode.request_added(decode_request(params))
    assert decode.build_connector_meta(None) is None


def test_the_router_releases_only_the_prompts_own_hold():
    prefill = connector("kv_producer")
    req = Request("p-1", list(PROMPT), SamplingParams(max_tokens=1), None,
                  kv_transfer_params={"do_remote_decode": True})
    assert not prefill.release_held(req, OTHER)
    assert prefill.release_held(req, DIGEST)
    assert prefill.build_connector_meta(None).release == [("p-1", DIGEST)]


def test_kv_lease_duration_and_its_older_name():
    def extra(**given):
        return parse_kv_transfer_config({"kv_connector": "p2p", "kv_connector_extra_config": given}).extra

    assert extra()["kv_lease_duration"] == 30.0
    assert extra(kv_lease_duration=5)["kv_lease_duration"] == 5
    assert extra(abort_timeout_s=4)["kv_lease_duration"] == 4  # configs written before leases keep working
    with pytest.raises(KVTransferConfigError, match="disagree"):
        extra(kv_lease_duration=5, abort_timeout_s=4)
    with pytest.raises(KVTransferConfigError, match="must be positive"):
        extra(kv_lease_duration=0)
