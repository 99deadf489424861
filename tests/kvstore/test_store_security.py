"""`pdserve kvstore` against peers without the internal key: real processes and sockets on 127.0.0.1.

The store is a CURVE server: a peer without the key (or with another key, or with the server's
public key but its own client key) never completes the handshake, so nothing it sends is
delivered: a forged put stores nothing, a forged get gets no reply, and a huge frame it sends is
never allocated. Without any key the store runs plain, as before, and says so once at start-up.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import psutil
import pytest
import zmq

from pdserve.engine import internal_auth
from pdserve.kvstore.client import KVStoreClient, KVStoreError
from support.kvstore import free_port_pair, kvstore_cmd, running_store, start_store, stop

MiB = 2**20
pytestmark = pytest.mark.timeout(180)
WRONG_KEY = b"not-the-deployment-key-" + os.urandom(8).hex().encode()


def env_without_key() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in (internal_auth.ENV_KEY, internal_auth.ENV_KEY_FILE)}


def peak_rss(pid: int) -> int:
    """The process's high-water resident set (VmHWM), in bytes: a short-lived allocation shows too."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return psutil.Process(pid).memory_info().rss


def requests_served(store) -> float:
    metrics = store.metrics()
    return sum(v for k, v in metrics.items() if k.startswith("pdserve_kvstore_requests_total"))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    # The default frame limit (64 MiB): before this fix libzmq took frames up to 1 GiB.
    with running_store(tmp_path_factory.mktemp("secure-kvstore"), "--capacity", "256Mi") as proc:
        yield proc


def test_a_client_without_the_key_or_with_another_gets_nothing_and_changes_nothing(store):
    before = requests_served(store)
    for key in (None, WRONG_KEY):
        with KVStoreClient(store.url, "victim", timeout_s=1.0, internal_key=key) as forger:
            with pytest.raises(KVStoreError, match="not reachable|did not answer"):
                forger.put([b"poison"], [b"forged KV"])
            with pytest.raises(KVStoreError, match="not reachable|did not answer"):
                forger.get([b"secret"])
    with KVStoreClient(store.url, "victim") as client:
        client.put([b"secret"], [b"real KV"])
        assert client.get([b"poison"]) == [None] and client.contains([b"poison"]) == 0
        assert bytes(client.get([b"secret"])[0]) == b"real KV"
    # Only the key holder's four requests were ever delivered.
    assert requests_served(store) == before + 4


def test_the_server_public_key_alone_does_not_get_in(store):
    """An outsider who learned the server's public key still fails the ZAP check with its own key pair."""
    before = requests_served(store)
    server_public, _ = internal_auth.curve_keypair(internal_auth.load_internal_key(), "server")
    public, secret = zmq.curve_keypair()
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_public, public, secret
    sock.connect(store.url)
    try:
        from pdserve.kvstore import protocol

        sock.send_multipart([protocol.encode(protocol.RequestHeader("put", 1, "victim", [b"k"])), b"forged"],
                            zmq.NOBLOCK)
        assert not sock.poll(1500), "an unauthenticated peer got a reply"
    except zmq.Again:
        pass  # not even queued: the handshake never completed
    finally:
        sock.close()
        context.term()
    assert requests_served(store) == before
    assert "refused a ZMQ peer that does not hold the internal key" in store.log()


def curve_greeting() -> bytes:
    """A ZMTP 3.0 greeting announcing the CURVE mechanism, as a client's."""
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\0") + b"\x00" + bytes(31)


def stream_frame(port: int, frame_size: int, greeting: bytes) -> None:
    """Open a TCP connection, greet, announce one long frame of `frame_size` bytes and send it."""
    chunk = bytes(4 * MiB)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        try:
            conn.sendall(greeting)
            conn.sendall(b"\x06" + frame_size.to_bytes(8, "big"))  # a command frame, long size
            sent = 0
            while sent < frame_size:
                conn.sendall(chunk)
                sent += len(chunk)
        except OSError:
            pass  # the store dropped the connection: what we want


def test_a_huge_frame_from_anyone_is_never_allocated(store):
    big = 256 * MiB
    before = peak_rss(store.proc.pid)
    # A plain ZMQ peer without the key: the handshake fails, its frame never crosses.
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(store.url)
    try:
        sock.send_multipart([b"header", bytes(big)], zmq.NOBLOCK)
    except zmq.Again:
        pass
    time.sleep(2)
    sock.close()
    context.term()
    # A raw peer announcing CURVE and a 256 MiB frame in the handshake: refused on reading its length.
    stream_frame(store.port, big, curve_greeting())
    # Even a key holder's oversized frame is refused before allocation (the peer is dropped).
    with KVStoreClient(store.url, "big", timeout_s=2.0) as client:
        with pytest.raises(KVStoreError):
            client.put([b"huge"], [bytes(big)])
        client.put([b"small"], [b"ok"])  # the same client reconnects and goes on
        assert bytes(client.get([b"small"])[0]) == b"ok"
    grown = peak_rss(store.proc.pid) - before
    assert grown < 48 * MiB, f"the store's peak RSS grew by {grown / MiB:.0f} MiB"
    assert store.proc.poll() is None


def test_without_a_key_the_store_runs_plain_and_warns(tmp_path):
    port = free_port_pair()
    store = start_store(kvstore_cmd(port), port, tmp_path / "plain.log", env=env_without_key())
    try:
        with KVStoreClient(store.url, "m", internal_key=None) as client:
            client.put([b"k"], [b"v"])
            assert bytes(client.get([b"k"])[0]) == b"v"
        # A key holder does not talk to a plain store (it would not know whom it talks to).
        with KVStoreClient(store.url, "m", timeout_s=1.0) as secured, pytest.raises(KVStoreError):
            secured.get([b"k"])
    finally:
        assert stop(store) == 0, store.log()
    assert store.log().count("is unauthenticated") == 1


def test_internal_key_file_flag_secures_the_store(tmp_path):
    key_file = tmp_path / "internal-key"
    key_file.write_text(internal_auth.load_internal_key().decode() + "\n")
    port = free_port_pair()
    store = start_store(kvstore_cmd(port, "--internal-key-file", str(key_file)), port, tmp_path / "file.log",
                        env=env_without_key())
    try:
        with KVStoreClient(store.url, "m") as client:
            client.put([b"k"], [b"v"])
            assert bytes(client.get([b"k"])[0]) == b"v"
        with KVStoreClient(store.url, "m", timeout_s=1.0, internal_key=None) as outsider, pytest.raises(KVStoreError):
            outsider.get([b"k"])
    finally:
        assert stop(store) == 0, store.log()
    assert "is unauthenticated" not in store.log()
