"""The p2p connector against hostile input: bad kv_transfer_params, another prompt's params,
reads of foreign blocks, peers without the internal key, floods of idle connections.

Unit level first (the connector's two sides with hand-made requests; BlockServer and BlockClient
in this process over 127.0.0.1), then one real prefill + decode pair shared by the engine cases.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import struct
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import msgspec
import psutil
import pytest
import torch

from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kvstore.base import KVConnectorRole
from pdserve.kvstore.binding import prompt_digest
from pdserve.kvstore.config import parse_kv_transfer_config
from pdserve.kvstore.layout import ranks_to_release
from pdserve.kvstore.p2p import P2PConnector, RecvSpec, side_channel_host
from pdserve.kvstore.send_registry import SendRegistry
from pdserve.kvstore.transport_tcp import (HELLO_MAGIC, MAX_CONNECTIONS_PER_PEER, AuthenticationError, BlockClient,
                                           BlockServer, HeldKV, TransferError)
from support.auth import internal_headers
from support.server import ServerProcess, free_port, launch_server, p2p_config, wait_healthy

BLOCK = 16
PROMPT = list(range(100, 150))  # 50 tokens: 4 blocks
DIGEST = prompt_digest(PROMPT)


# -- the scheduler side never raises, whatever the params ----------------------------------------

def connector(role: str = "kv_both", heads: int = 4, tp: int = 1) -> P2PConnector:
    config = SimpleNamespace(parallel=SimpleNamespace(tensor_parallel_size=tp, data_parallel_rank=0),
                             model=SimpleNamespace(num_key_value_heads=heads), cache=SimpleNamespace(block_size=BLOCK),
                             advertise_address="127.0.0.1:8000", engine_id="decode")
    kv = parse_kv_transfer_config({"kv_connector": "p2p", "kv_role": role})
    return P2PConnector(config, KVConnectorRole.SCHEDULER, kv)


def good_params(**changes) -> dict:
    params = {"do_remote_prefill": True, "remote_engine_id": "prefill", "remote_request_id": "cmpl-1",
              "remote_block_ids": [7, 8, 9, 10], "remote_host": "127.0.0.1", "remote_port": 9000,
              "remote_ports": [9000], "remote_tp_size": 1, "transport": "tcp", "prompt_digest": DIGEST}
    params.update(changes)
    return {k: v for k, v in params.items() if v is not ...}  # `...` drops a key


def request(params: dict, prompt: list[int] = PROMPT) -> Request:
    return Request("req-1", list(prompt), SamplingParams(max_tokens=4), eos_token_id=None, kv_transfer_params=params)


BAD_PARAMS = {
    "port not a number": good_params(remote_port="abc", remote_ports=...),
    "port list of text": good_params(remote_ports=["abc"]),
    "port zero": good_params(remote_port=0, remote_ports=...),
    "port too big": good_params(remote_ports=[70000]),
    "tp zero": good_params(remote_tp_size=0, remote_ports=...),
    "tp huge": good_params(remote_tp_size=10**9, remote_ports=...),
    "tp not a power of two": good_params(remote_tp_size=3, remote_ports=[1, 2, 3]),
    "tp as text": good_params(remote_tp_size="1"),
    "tp as bool": good_params(remote_tp_size=True),
    "tp larger than the heads allow": good_params(remote_tp_size=128, remote_ports=list(range(1000, 1128))),
    "fewer ports than ranks": good_params(remote_tp_size=2, remote_ports=[9000]),
    "negative block id": good_params(remote_block_ids=[7, -8, 9, 10]),
    "huge block id": good_params(remote_block_ids=[7, 8, 9, 2**40]),
    "block id as text": good_params(remote_block_ids=[7, "8", 9, 10]),
    "too few blocks": good_params(remote_block_ids=[7]),
    "too many blocks": good_params(remote_block_ids=list(range(10_000))),
    "blocks not a list": good_params(remote_block_ids={"a": 1}),
    "host with spaces": good_params(remote_host="a b"),
    "host not text": good_params(remote_host=["127.0.0.1"]),
    "host too long": good_params(remote_host="a" * 1000),
    "request id too long": good_params(remote_request_id="x" * 10_000),
    "engine id not text": good_params(remote_engine_id=5),
    "unknown transport": good_params(transport="rdma"),
    "no digest": good_params(prompt_digest=...),
    "digest of another prompt": good_params(prompt_digest=prompt_digest(PROMPT[:-1] + [1])),
    "digest not hex": good_params(prompt_digest="z" * 64),
    "missing block ids": good_params(remote_block_ids=...),
}


@pytest.mark.parametrize("name", list(BAD_PARAMS))
def test_bad_params_mean_compute_here_and_never_raise(name):
    conn = connector()
    req = request(BAD_PARAMS[name])
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params["do_remote_prefill"] is False
    # The scheduler-side hooks after it must stay quiet too, even if called with the bad params.
    req.kv_transfer_params = BAD_PARAMS[name]
    conn.update_state_after_alloc(req, [1, 2, 3, 4], 49)
    (spec,) = conn.build_connector_meta(None).recv
    assert spec.problem  # the worker fails this load at once: the request is recomputed


def test_a_tp_size_that_cannot_split_the_heads_is_refused():
    conn = connector(heads=6)
    req = request(good_params(remote_tp_size=4, remote_ports=[1, 2, 3, 4]))
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    assert connector(heads=6).get_num_new_matched_tokens(request(good_params(remote_tp_size=2, remote_ports=[1, 2])),
                                                         0) == (49, True)


def test_good_params_pull_the_blocks_the_prefix_cache_lacks():
    conn = connector()
    req = request(good_params())
    assert conn.get_num_new_matched_tokens(req, 16) == (50 - 1 - 16, True)
    req.num_computed_tokens = 16
    conn.update_state_after_alloc(req, [1, 2, 3, 4], 50 - 1 - 16)
    (spec,) = conn.build_connector_meta(None).recv
    assert not spec.problem
    assert (spec.local_block_ids, spec.remote_block_ids, spec.remote_ports) == ([2, 3, 4], [8, 9, 10], [9000])
    assert spec.prompt_digest == DIGEST and spec.remote_req_id == "cmpl-1"
    assert req.kv_transfer_params["do_remote_prefill"] is False  # one attempt only


def test_prefill_side_binds_its_kv_to_the_prompt():
    conn = connector("kv_producer")
    conn.set_worker_info([{"port": 9100, "transport": "tcp"}])
    req = Request("p-1", list(PROMPT), SamplingParams(max_tokens=1), None,
                  kv_transfer_params={"do_remote_decode": True})
    delay, params = conn.request_finished(req, [3, 4, 5, 6])
    assert delay and params["prompt_digest"] == DIGEST
    (send,) = conn.build_connector_meta(None).send
    assert send.prompt_digest == DIGEST
    # ... and what it hands out passes the decode side's checks for that prompt only
    decode = connector("kv_consumer")
    assert decode.get_num_new_matched_tokens(request(dict(params)), 0) == (49, True)
    assert decode.get_num_new_matched_tokens(request(dict(params), PROMPT[::-1]), 0) == (0, False)


def worker(role: str = "kv_consumer") -> P2PConnector:
    conn = connector(role)
    conn.role = KVConnectorRole.WORKER
    return conn


@pytest.mark.parametrize("spec_changes", [{"problem": "bad params"}, {"remote_tp_size": 0}, {"remote_tp_size": 3},
                                          {"remote_ports": []}])
def test_every_failed_pull_ends_the_load(spec_changes):
    """A pull thread that raised used to leave the request waiting forever, its blocks allocated."""
    conn = worker()
    conn.client = BlockClient([torch.zeros(2, 4, BLOCK, 4, 8)], timeout_s=1, key=b"k" * 32)
    spec = RecvSpec(req_id="r", remote_req_id="p", local_block_ids=[0], remote_block_ids=[1],
                    remote_host="127.0.0.1", remote_ports=[free_port()], remote_tp_size=1, remote_engine_id="e",
                    prompt_digest=DIGEST)
    for name, value in spec_changes.items():
        setattr(spec, name, value)
    conn._load(spec)
    assert conn.loads.take_ended() == {"r"} and conn.get_failed_loads() == {"r"}


def test_release_plan_is_cheap_for_the_largest_tp():
    start = time.monotonic()
    assert ranks_to_release(8, 1, 0, 64) == [q for q in range(64) if q % 8]
    assert time.monotonic() - start < 0.5


def test_side_channel_listens_on_the_engines_own_address():
    assert side_channel_host("", "10.1.2.3:8000") == "10.1.2.3"  # the pod IP under the operator
    assert side_channel_host("", "[::1]:8000") == "::1"
    assert side_channel_host("", None) == "127.0.0.1"
    assert side_channel_host("10.9.9.9", "10.1.2.3:8000") == "10.9.9.9"
    server = BlockServer(caches(), SendRegistry(), key=b"k" * 32)
    try:
        assert server._listener.getsockname()[0] == "127.0.0.1"  # the default is loopback, not 0.0.0.0
    finally:
        server.close()


# -- the side channel: authentication, bounds, per-block leases -------------------------------------

KEY = b"the-right-key-0123456789"


def caches(blocks: int = 8, fill: bool = True) -> list[torch.Tensor]:
    return [torch.randn(2, blocks, BLOCK, 4, 8) if fill else torch.zeros(2, blocks, BLOCK, 4, 8) for _ in range(2)]


@pytest.fixture
def side_channel():
    registry = SendRegistry()
    registry.hold("req", [1, 2], timeout_s=60, digest=DIGEST)
    registry.hold("other", [5, 6], timeout_s=60, digest=prompt_digest([1]))
    server = BlockServer(caches(), registry, "127.0.0.1", 0, key=KEY, handshake_timeout_s=1.0)
    yield server, registry, ("127.0.0.1", server.port)
    server.close()


def frame(message: dict) -> bytes:
    body = msgspec.msgpack.encode(message)
    return struct.pack("!I", len(body)) + body


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes the connection within `seconds` (reading whatever it sent first)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except (socket.timeout, TimeoutError):
        return False
    except ConnectionResetError:
        return True


def test_a_client_with_the_key_pulls_and_one_without_is_refused(side_channel):
    server, registry, peer = side_channel
    good = BlockClient(caches(fill=False), timeout_s=2, key=KEY)
    assert good.pull(peer, HeldKV("req", DIGEST), [1, 2], [0, 1], (0, 4), (0, 4), time.monotonic() + 2) > 0
    wrong = BlockClient(caches(fill=False), timeout_s=2, key=b"a-wrong-key-0123456789")
    with pytest.raises(AuthenticationError):
        wrong.pull(peer, HeldKV("req", DIGEST), [1, 2], [0, 1], (0, 4), (0, 4), time.monotonic() + 2)
    assert not any(t.any() for t in wrong.kv_caches)
    wrong.release(peer, HeldKV("req", DIGEST), 1)  # best effort, and refused
    assert server.auth_failures == 2 and registry.num_held == 2
    good.release(peer, HeldKV("req", DIGEST), 1)
    assert registry.take_finished() == {"req"}
    good.close()


def test_a_decode_engine_never_trusts_a_side_channel_without_the_key():
    fake = socket.create_server(("127.0.0.1", 0))

    def answer_with_a_wrong_proof():
        conn, _ = fake.accept()
        conn.sendall(HELLO_MAGIC + os.urandom(32))
        conn.recv(64)
        conn.sendall(os.urandom(32))
        time.sleep(1)

    threading.Thread(target=answer_with_a_wrong_proof, daemon=True).start()
    client = BlockClient(caches(fill=False), timeout_s=2, key=KEY)
    with pytest.raises(AuthenticationError, match="does not hold"):
        client.pull(("127.0.0.1", fake.getsockname()[1]), HeldKV("req", DIGEST), [1], [0], (0, 4), (0, 4),
                    time.monotonic() + 2)
    fake.close()


def test_nothing_is_read_before_the_handshake(side_channel):
    server, registry, peer = side_channel
    rss = psutil.Process().memory_info().rss
    socks = []
    for _ in range(16):  # a frame header declaring 64 MiB, on a connection that never authenticates
        sock = socket.create_connection(peer)
        sock.sendall(struct.pack("!I", 64 << 20))
        socks.append(sock)
    # An unauthenticated "done" is never processed either: the blocks stay held.
    done = socket.create_connection(peer)
    done.sendall(frame({"op": "done", "req": "req", "digest": DIGEST, "expected": 1}).ljust(64, b"\0"))
    assert closed_within(done, 2)  # 64 bytes that are no proof: closed at once
    assert all(closed_within(s, 3) for s in socks)  # silent peers: closed at the handshake timeout
    assert psutil.Process().memory_info().rss - rss < 32 << 20
    assert registry.num_held == 2 and registry.take_finished() == set()
    assert server.auth_failures == 17


def test_connections_are_bounded_per_peer(side_channel):
    server, _, peer = side_channel
    held = [socket.create_connection(peer) for _ in range(MAX_CONNECTIONS_PER_PEER)]
    for sock in held:  # every admitted connection gets the server's challenge
        assert sock.recv(len(HELLO_MAGIC)) == HELLO_MAGIC
    extra = socket.create_connection(peer)
    assert closed_within(extra, 0.5)  # over the bound: closed at once, well before the handshake timeout
    assert server.refused_connections >= 1
    for sock in held:
        sock.close()


def test_a_lease_names_its_blocks_and_foreign_ones_are_refused(side_channel):
    """NIXL READs are one-sided: the lease is where the server says which blocks may be read."""
    server, registry, peer = side_channel
    client = BlockClient(caches(fill=False), timeout_s=2, key=KEY)
    deadline = time.monotonic() + 2
    for blocks, digest, error in (([1, 5], DIGEST, "does not hold those blocks"),  # 5 is another request's
                                  ([2, 1], DIGEST, "does not hold those blocks"),  # KV out of place
                                  ([1, 2], prompt_digest([9]), "another prompt")):
        with pytest.raises(TransferError, match=error):
            client._ask(peer, {"op": "lease", "req": "req", "digest": digest, "blocks": blocks}, deadline)
    with pytest.raises(TransferError, match="does not hold those blocks"):
        client.pull(peer, HeldKV("req", DIGEST), [5], [0], (0, 4), (0, 4), deadline)
    assert not any(t.any() for t in client.kv_caches)
    # A granted lease pins the blocks until this reader is done; two leases, one done.
    for _ in range(2):
        client._ask(peer, {"op": "lease", "req": "req", "digest": DIGEST, "blocks": [2]}, deadline)
    assert registry.expire() == 0
    client.release(peer, HeldKV("req", DIGEST), 1)
    assert registry.take_finished() == {"req"}
    client.close()


def test_nixl_reads_only_leased_blocks(side_channel):
    from pdserve.kvstore.transport_nixl import NixlEndpoint, nixl_available

    if not nixl_available():
        pytest.skip("nixl does not import here")
    server, _, peer = side_channel
    server.nixl = NixlEndpoint("prefill", server.kv_caches)
    dst = caches(fill=False)
    client = BlockClient(dst, timeout_s=2, nixl=NixlEndpoint("decode", dst), key=KEY)
    with pytest.raises(TransferError, match="does not hold those blocks"):
        client.nixl_pull(peer, "engine", HeldKV("req", DIGEST), [1, 6], [0, 1], time.monotonic() + 5)
    assert not any(t.any() for t in dst)
    client.nixl_pull(peer, "engine", HeldKV("req", DIGEST), [1, 2], [0, 1], time.monotonic() + 5)
    assert all(torch.equal(d[:, [0, 1]], s[:, [1, 2]]) for s, d in zip(server.kv_caches, dst))
    client.close()


def test_no_nixl_metadata_without_the_key(side_channel):
    server, _, peer = side_channel
    sock = socket.create_connection(peer)
    sock.sendall(frame({"op": "nixl_md"}).ljust(64, b"\0"))
    data = b""
    sock.settimeout(2)
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except (ConnectionResetError, TimeoutError, socket.timeout):
        pass
    assert data.startswith(HELLO_MAGIC) and len(data) == len(HELLO_MAGIC) + 32  # the challenge, and nothing else


# -- real engines ------------------------------------------------------------------------------------

def start(model: str, tmp: Path, *args: str) -> ServerProcess:
    return launch_server(model, "--max-model-len", "512", "--num-kv-blocks", "128", *args, tmp_path=tmp)


@pytest.fixture(scope="module")
def pair(model_dir, tmp_path_factory):
    """A prefill and a decode engine on the best transport here (NIXL when it imports; the decode
    side takes TCP for params that say so)."""
    model = model_dir("llama")
    tmp = tmp_path_factory.mktemp("p2p-security")
    engines = [start(model, tmp, "--kv-transfer-config", p2p_config("kv_producer", abort_timeout_s=8)),
               start(model, tmp, "--kv-transfer-config", p2p_config("kv_consumer", pull_timeout_s=3))]
    try:
        for e in engines:
            wait_healthy(e.url, e.proc, e.log_path)
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        yield SimpleNamespace(prefill=engines[0], decode=engines[1], model=model, vocab=vocab)
    finally:
        for e in engines:
            if e.proc.poll() is None:
                os.killpg(e.proc.pid, signal.SIGKILL)
            e.proc.wait()


def complete(engine: ServerProcess, model: str, prompt: list[int], **extra) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, **extra}
    return httpx.post(f"{engine.url}/v1/completions", json=body, timeout=60, headers=internal_headers())


def text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def metric(engine: ServerProcess, name: str) -> float:
    try:
        return engine.metric(name)
    except KeyError:  # a series never set is absent from the exposition
        return 0.0


def wait_for(predicate, timeout: float, message: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(message)


def prefill_params(pair, prompt: list[int]) -> dict:
    first = complete(pair.prefill, pair.model, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert first.status_code == 200, first.text
    return first.json()["kv_transfer_params"]


def test_bad_params_never_take_the_decode_engine_down(pair):
    prompt = [3 + i % 50 for i in range(40)]
    want = text(complete(pair.prefill, pair.model, prompt))
    params = prefill_params(pair, prompt)
    idle = metric(pair.decode, "vllm:kv_cache_usage_perc")
    for bad in ({"remote_port": "abc", "remote_ports": None}, {"remote_tp_size": 0}, {"remote_tp_size": 10**9},
                {"remote_block_ids": [-1] * len(params["remote_block_ids"])}, {"remote_ports": [1, 2]},
                {"remote_tp_size": 64, "remote_ports": list(range(2000, 2064))},  # passes the edge, not the heads
                {"remote_block_ids": params["remote_block_ids"][:1]}):
        sent = {k: v for k, v in dict(params, **bad).items() if v is not None}
        start = time.monotonic()
        got = complete(pair.decode, pair.model, prompt, kv_transfer_params=sent)
        assert time.monotonic() - start < 5, bad
        # The HTTP edge may refuse it (400); what gets past it is computed here, with the same answer.
        assert got.status_code == 400 or text(got) == want, (bad, got.text)
    assert pair.decode.proc.poll() is None
    assert httpx.get(f"{pair.decode.url}/health").status_code == 200
    wait_for(lambda: metric(pair.decode, "vllm:kv_cache_usage_perc") == idle, 5, "the decode engine leaked blocks")


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_another_prompts_kv_never_poisons_the_decode_engine(pair, transport):
    rng = random.Random(transport)
    x = [rng.randrange(1, pair.vocab) for _ in range(70)]
    y = [rng.randrange(1, pair.vocab) for _ in range(70)]
    want = text(complete(pair.prefill, pair.model, y))
    params = dict(prefill_params(pair, x), transport=transport)
    got = complete(pair.decode, pair.model, y, kv_transfer_params=params)
    assert text(got) == want
    assert got.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing loaded
    # later clean requests for y see y's own KV only
    for _ in range(2):
        assert text(complete(pair.decode, pair.model, y)) == want


def test_params_from_a_client_never_make_the_decode_engine_connect_anywhere(pair):
    """SSRF: params naming an arbitrary host:port. Without the key they are refused at the edge;
    with the key but for another prompt the connector refuses them before any connection."""
    prompt = [5 + i % 40 for i in range(40)]
    params = prefill_params(pair, prompt)
    with socket.create_server(("127.0.0.1", 0)) as target:
        target.settimeout(2.0)
        aimed = dict(params, remote_host="127.0.0.1", remote_port=target.getsockname()[1], remote_tp_size=1,
                     transport="tcp")
        aimed.pop("remote_ports", None)
        body = {"model": pair.model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "kv_transfer_params": aimed}
        refused = httpx.post(f"{pair.decode.url}/v1/completions", json=body, timeout=60)
        assert refused.status_code == 403, refused.text
        other = complete(pair.decode, pair.model, [7] * 40, kv_transfer_params=aimed)  # the key, another prompt
        assert other.status_code in (200, 400), other.text
        with pytest.raises(socket.timeout):
            target.accept()


def test_side_channel_refuses_peers_without_the_key_and_floods(pair):
    prompt = [7 + i % 40 for i in range(60)]
    params = prefill_params(pair, prompt)
    peer = (params["remote_host"], params["remote_ports"][0])
    core = psutil.Process(pair.prefill.engine_core_pid())
    # It listens on the engine's own address (127.0.0.1 here), not on every interface.
    listening = [c.laddr for c in core.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    assert (("127.0.0.1", peer[1]) in [(a.ip, a.port) for a in listening]), listening
    ours = HeldKV(params["remote_request_id"], params["prompt_digest"])
    blocks = params["remote_block_ids"]

    wrong = BlockClient(engine_caches(pair), timeout_s=2, key=b"not-the-deployment-key-0123")
    heads = (0, wrong.layout.num_kv_heads)
    with pytest.raises(AuthenticationError):
        wrong.pull(peer, ours, blocks, list(range(len(blocks))), heads, heads, time.monotonic() + 2)
    assert not any(t.any() for t in wrong.kv_caches)
    done = socket.create_connection(peer)
    done.sendall(frame({"op": "done", "req": ours.request_id, "digest": ours.prompt_digest,
                        "expected": 1}).ljust(64, b"\0"))
    assert closed_within(done, 2)
    rss = core.memory_info().rss
    socks = [socket.create_connection(peer) for _ in range(16)]
    for sock in socks:
        sock.sendall(struct.pack("!I", 64 << 20))
    time.sleep(0.5)
    assert core.memory_info().rss - rss < 64 << 20
    for sock in socks:
        sock.close()
    # Nobody released the blocks: a reader with the key still gets them, then lets them go.
    good = BlockClient(engine_caches(pair), timeout_s=2)
    assert good.pull(peer, ours, blocks, list(range(len(blocks))), heads, heads, time.monotonic() + 2) > 0
    assert any(t.any() for t in good.kv_caches)
    good.release(peer, ours, 1)
    good.close()
    assert pair.prefill.proc.poll() is None


def engine_caches(pair) -> list[torch.Tensor]:
    """An empty KV cache laid out like the test engines' (float32, blocks of 16, all KV heads)."""
    cfg = json.loads((Path(pair.model) / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return [torch.zeros(2, 8, BLOCK, heads, head_dim) for _ in range(cfg["num_hidden_layers"])]
