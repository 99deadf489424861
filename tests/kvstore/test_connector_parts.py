"""The KV connectors' parts on their own: configuration, head plans, held blocks, both transports."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pdserve.kvstore.binding import prompt_digest
from pdserve.kvstore.block_io import KVLayout
from pdserve.kvstore.config import KVTransferConfigError, parse_kv_transfer_config
from pdserve.kvstore.layout import done_messages_expected, plan_head_reads, rank_heads, ranks_to_release
from pdserve.kvstore.send_registry import ReadRefused, SendRegistry, UnknownRequest
from pdserve.kvstore.transport_tcp import BlockClient, BlockServer, HeldKV, TransferError

DIGEST = prompt_digest([1, 2, 3])
OTHER = prompt_digest([1, 2, 4])


def held(request_id: str) -> HeldKV:
    return HeldKV(request_id, DIGEST)


# -- --kv-transfer-config ------------------------------------------------------------------------

def test_config_defaults_and_roles():
    kv = parse_kv_transfer_config({"kv_connector": "p2p", "kv_role": "kv_producer"})
    assert (kv.connector, kv.is_producer, kv.is_consumer) == ("p2p", True, False)
    assert kv.extra["transport"] == "auto" and kv.extra["abort_timeout_s"] == 30.0
    assert parse_kv_transfer_config({"kv_connector": "kvstore", "kv_connector_extra_config": {
        "kvstore_url": "tcp://h:1"}}).is_consumer  # kv_both by default
    assert parse_kv_transfer_config(None) is None


@pytest.mark.parametrize("raw, message", [
    ({"kv_connector": "lmcache"}, "unknown kv_connector 'lmcache'"),
    ({"kv_connector": "p2p", "kv_role": "producer"}, "kv_role must be one of"),
    ({"kv_connector": "p2p", "kv_connector_extra_config": {"port": 1}}, "unknown kv_connector_extra_config keys ['port']"),
    ({"kv_connector": "p2p", "kv_connector_extra_config": {"transport": "rdma"}}, "transport must be one of"),
    ({"kv_connector": "p2p", "kv_connector_extra_config": {"abort_timeout_s": "30"}}, "abort_timeout_s must be a number"),
    ({"kv_connector": "p2p", "kv_connector_extra_config": {"abort_timeout_s": 0}}, "must be positive"),
    ({"kv_connector": "kvstore"}, "needs kv_connector_extra_config.kvstore_url"),
    ({"kv_connector": "kvstore", "kv_connector_extra_config": {"kvstore_url": "h:1"}}, "tcp://host:port"),
    ({"kv_connector": "shared-storage"}, "needs kv_connector_extra_config.path"),
    ({"kv_connector": "p2p", "extra": 1}, "unknown keys ['extra']"),
    ([1, 2], "must be a JSON object"),
])
def test_config_errors_name_the_problem(raw, message):
    with pytest.raises(KVTransferConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_kv_transfer_config(raw)


# -- which heads a rank reads from which remote rank ----------------------------------------------

@pytest.mark.parametrize("heads, local_tp, remote_tp", [(4, 1, 2), (4, 2, 1), (4, 2, 2), (8, 4, 2), (2, 4, 1),
                                                         (2, 1, 4), (1, 2, 2), (8, 2, 8)])
def test_head_plans_cover_each_local_head_exactly_once(heads, local_tp, remote_tp):
    readers = {q: 0 for q in range(remote_tp)}
    for rank in range(local_tp):
        start, end = rank_heads(heads, local_tp, rank)
        got: list[int] = []
        for r in plan_head_reads(heads, local_tp, rank, remote_tp):
            remote_start, _ = rank_heads(heads, remote_tp, r.remote_rank)
            # global heads read == global heads written
            assert [remote_start + h for h in range(r.remote_start, r.remote_end)] == \
                [start + h for h in range(r.local_start, r.local_end)]
            got += range(start + r.local_start, start + r.local_end)
            readers[r.remote_rank] += 1
        assert got == list(range(start, end))
    # every remote rank hears from someone: its readers, or rank 0's release
    released = ranks_to_release(heads, local_tp, 0, remote_tp)
    for q in range(remote_tp):
        assert done_messages_expected(heads, local_tp, remote_tp, q) == max(1, readers[q])
        assert (q in released) == (readers[q] == 0)


# -- blocks held for a remote decode ---------------------------------------------------------------

class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_registry_releases_after_all_readers_and_never_mid_read():
    clock = Clock()
    reg = SendRegistry(clock)
    with pytest.raises(UnknownRequest) as early:
        reg.begin_read("r", DIGEST, [3])
    assert early.value.retry  # may still be registered by the next step
    reg.hold("r", [3, 4], timeout_s=5, digest=DIGEST)
    reg.begin_read("r", DIGEST, [4])
    reg.done("r", expected=2, digest=DIGEST)
    reg.done("r", expected=2, digest=DIGEST)
    clock.now += 60
    assert reg.expire() == 0 and reg.take_finished() == set()  # a read is in progress
    reg.end_read("r")
    assert reg.take_finished() == {"r"}
    with pytest.raises(UnknownRequest) as late:
        reg.begin_read("r", DIGEST, [3])
    assert not late.value.retry


def test_registry_serves_a_prompts_blocks_only_to_readers_of_that_prompt():
    reg = SendRegistry(Clock())
    reg.hold("r", [3, 4], timeout_s=5, digest=DIGEST)
    for digest, blocks in ((OTHER, [3]), ("", [3]), (None, [3]), (DIGEST, [5]), (DIGEST, [3, 4, 5]),
                           (DIGEST, [4, 3]), (DIGEST, [3, 3])):  # out of order: KV in the wrong places
        with pytest.raises(ReadRefused):
            reg.begin_read("r", digest, blocks)
    assert not reg.done("r", expected=1, digest=OTHER)  # a stranger cannot release the blocks
    assert reg.num_held == 1 and reg.take_finished() == set()
    assert reg.done("r", expected=1, digest=DIGEST)
    assert reg.take_finished() == {"r"}


def test_registry_expires_unread_blocks():
    clock = Clock()
    reg = SendRegistry(clock)
    reg.hold("a", [1], timeout_s=5, digest=DIGEST)
    reg.hold("b", [2, 3], timeout_s=50, digest=DIGEST)
    clock.now += 10
    assert reg.expire() == 1 and reg.take_finished() == {"a"}
    assert reg.num_blocks_expired == 1 and reg.num_held == 1


# -- the TCP transport -----------------------------------------------------------------------------

def caches(num_layers=3, blocks=12, heads=4, dtype=torch.float32, fill=True):
    out = []
    for layer in range(num_layers):
        t = torch.zeros(2, blocks, 16, heads, 8, dtype=dtype)
        if fill:
            t.copy_(torch.randn(t.shape).to(dtype) + layer)
        out.append(t)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tcp_pull_of_whole_blocks_is_exact(dtype):
    src, dst = caches(dtype=dtype), caches(dtype=dtype, fill=False)
    reg = SendRegistry()
    server = BlockServer(src, reg, "127.0.0.1", 0)
    client = BlockClient(dst, timeout_s=5)
    try:
        remote, local = [7, 2, 3, 4, 9], [0, 1, 2, 5, 11]

        def register_later():  # the decode side may ask before the prefill step registers it
            time.sleep(0.2)
            reg.hold("req", remote, timeout_s=30, digest=DIGEST)

        threading.Thread(target=register_later).start()
        moved = client.pull(("127.0.0.1", server.port), held("req"), remote, local, (0, 4), (0, 4),
                            time.monotonic() + 5)
        assert moved == KVLayout.of(src).transfer_bytes(len(remote))
        for s, d in zip(src, dst):
            assert torch.equal(d[:, local], s[:, remote])
            untouched = [b for b in range(12) if b not in local]
            assert not d[:, untouched].any()
        client.release(("127.0.0.1", server.port), held("req"), expected=1)
        assert reg.take_finished() == {"req"}
    finally:
        client.close()
        server.close()


def test_tcp_pull_of_a_head_slice():
    """Prefill TP=1 (4 heads) -> decode rank 1 of TP=2 (heads 2-3), and the reverse direction."""
    src, dst = caches(heads=4), caches(heads=2, fill=False)
    reg = SendRegistry()
    reg.hold("req", [1, 2], timeout_s=30, digest=DIGEST)
    server = BlockServer(src, reg, "127.0.0.1", 0)
    client = BlockClient(dst, timeout_s=5)
    try:
        client.pull(("127.0.0.1", server.port), held("req"), [1, 2], [4, 6], (2, 4), (0, 2), time.monotonic() + 5)
        for s, d in zip(src, dst):
            assert torch.equal(d[:, [4, 6]], s[:, [1, 2], :, 2:4])
        # decode with more heads than one prefill rank holds: fill heads 2-3 of a 4-head cache
        wide = caches(heads=4, fill=False)
        narrow_src = caches(heads=2)
        reg.hold("half", [0], timeout_s=30, digest=DIGEST)
        server2 = BlockServer(narrow_src, reg, "127.0.0.1", 0)
        client2 = BlockClient(wide, timeout_s=5)
        client2.pull(("127.0.0.1", server2.port), held("half"), [0], [3], (0, 2), (2, 4), time.monotonic() + 5)
        for s, d in zip(narrow_src, wide):
            assert torch.equal(d[:, 3, :, 2:4], s[:, 0]) and not d[:, 3, :, :2].any()
        client2.close()
        server2.close()
    finally:
        client.close()
        server.close()


def test_tcp_pull_failures_are_clear_errors():
    src = caches()
    reg = SendRegistry()
    server = BlockServer(src, reg, "127.0.0.1", 0)
    try:
        other_layout = BlockClient(caches(num_layers=2, fill=False), timeout_s=2)
        with pytest.raises(TransferError, match="num_layers differs"):
            other_layout.pull(("127.0.0.1", server.port), held("x"), [0], [0], (0, 4), (0, 4), time.monotonic() + 2)
        client = BlockClient(caches(fill=False), timeout_s=2)
        reg.hold("r", [1, 2], timeout_s=30, digest=DIGEST)
        with pytest.raises(TransferError, match="does not hold those blocks"):
            client.pull(("127.0.0.1", server.port), held("r"), [5], [0], (0, 4), (0, 4), time.monotonic() + 2)
        with pytest.raises(TransferError, match="another prompt"):
            client.pull(("127.0.0.1", server.port), HeldKV("r", OTHER), [1], [0], (0, 4), (0, 4),
                        time.monotonic() + 2)
        start = time.monotonic()
        with pytest.raises(TransferError, match="no KV held"):  # never registered: gives up at the deadline
            client.pull(("127.0.0.1", server.port), held("never"), [1], [0], (0, 4), (0, 4), time.monotonic() + 0.5)
        assert time.monotonic() - start < 5
    finally:
        server.close()
    with pytest.raises(TransferError):  # the prefill engine is gone
        BlockClient(caches(fill=False), timeout_s=1).pull(("127.0.0.1", server.port), held("r"), [1], [0], (0, 4),
                                                          (0, 4), time.monotonic() + 1)


def test_nixl_read_between_two_agents():
    """Two NIXL agents in one process, the reader leasing over the TCP side channel."""
    from pdserve.kvstore.transport_nixl import NixlEndpoint, nixl_available

    if not nixl_available():
        pytest.fail("nixl does not import: `make install` installs nixl-cu12==1.5.1 on Linux x86_64")
    src, dst = caches(), caches(fill=False)
    reg = SendRegistry()
    reg.hold("req", [3, 4, 8], timeout_s=30, digest=DIGEST)
    server = BlockServer(src, reg, "127.0.0.1", 0)
    server.nixl = NixlEndpoint("prefill", src)
    client = BlockClient(dst, timeout_s=5, nixl=NixlEndpoint("decode", dst))
    try:
        moved = client.nixl_pull(("127.0.0.1", server.port), "engine", held("req"), [3, 4, 8], [0, 1, 2],
                                 time.monotonic() + 10)
        assert moved == KVLayout.of(src).transfer_bytes(3)
        for s, d in zip(src, dst):
            assert torch.equal(d[:, [0, 1, 2]], s[:, [3, 4, 8]])
        assert reg.expire() == 0  # leased until released
        client.release(("127.0.0.1", server.port), held("req"), expected=1)
        assert reg.take_finished() == {"req"}
    finally:
        client.close()
        server.close()
