"""`pdserve kvstore` as a real process on 127.0.0.1, driven by the real client and by raw ZMQ sockets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import msgspec
import numpy as np
import pytest
import torch
import yaml
import zmq

from pdserve.engine import internal_auth
from pdserve.kvstore import protocol
from pdserve.kvstore.cli import parse_quantity
from pdserve.kvstore.client import KVStoreClient, KVStoreError
from pdserve.kvstore.store import ENTRY_OVERHEAD_BYTES
from support.kvstore import StoreProcess, free_port_pair, kvstore_cmd, running_store, start_store, stop

REPO = Path(__file__).resolve().parents[2]
MiB = 2**20
# One block of a Llama-3-8B-like model: 16 tokens x 8 KV heads x 128 head dim x (K, V) x 32 layers, bf16.
BLOCK_SHAPE = (32, 2, 16, 8, 128)
BLOCK_BYTES = 32 * 2 * 16 * 8 * 128 * 2

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Iterator[StoreProcess]:
    # Room for a few dozen realistic blocks; small limits so the refusal tests send little.
    with running_store(tmp_path_factory.mktemp("kvstore"), "--capacity", "256Mi", "--max-frame-bytes",
                       str(4 * MiB), "--max-keys", "64") as proc:
        yield proc


@pytest.fixture
def raw(store) -> Iterator[zmq.Socket]:
    """A bare DEALER socket holding the key, to send what the client never would."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    internal_auth.secure_client(sock, internal_auth.load_internal_key())
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(store.url)
    yield sock
    sock.close()
    context.term()


def realistic_block(seed: int) -> torch.Tensor:
    return torch.randn(BLOCK_SHAPE, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def as_tensor(view: memoryview) -> torch.Tensor:
    return torch.frombuffer(view, dtype=torch.bfloat16).view(BLOCK_SHAPE)


def test_put_get_contains_round_trip_with_torch_and_numpy_blocks(store):
    with KVStoreClient(store.url, namespace="llama-3-8b") as client:
        blocks = [realistic_block(seed) for seed in range(6)]
        keys = [f"prefix-hash-{i}".encode() for i in range(6)]
        client.put(keys, blocks)
        assert client.contains(keys) == 6
        values = client.get(keys)
        assert all(v is not None and v.nbytes == BLOCK_BYTES for v in values)
        for block, value in zip(blocks, values):
            assert torch.equal(as_tensor(value), block)
        # numpy fp16 per-layer blocks and plain bytes travel too, in one batch.
        layer = np.random.default_rng(1).standard_normal((2, 16, 8, 128)).astype(np.float16)
        client.put([b"layer", b"raw", b"view"], [layer, b"\x00\x01\x02", memoryview(bytearray(b"abc"))])
        got_layer, got_raw, got_view = client.get([b"layer", b"raw", b"view"])
        assert np.array_equal(np.frombuffer(got_layer, np.float16).reshape(layer.shape), layer)
        assert bytes(got_raw) == b"\x00\x01\x02" and bytes(got_view) == b"abc"
        # An overwrite is seen by the next get.
        client.put([keys[0]], [blocks[1]])
        assert torch.equal(as_tensor(client.get([keys[0]])[0]), blocks[1])


def test_contains_counts_only_the_leading_run_and_get_marks_the_gaps(store):
    with KVStoreClient(store.url, namespace="prefix-test") as client:
        client.put([b"h0", b"h1", b"h3"], [b"0", b"1", b"3"])
        assert client.contains([b"h0", b"h1", b"h2", b"h3"]) == 2
        assert client.contains([b"h2", b"h0"]) == 0
        assert client.contains([b"h0", b"h1"]) == 2
        assert [None if v is None else bytes(v) for v in client.get([b"h0", b"h2", b"h3"])] == [b"0", None, b"3"]
        assert client.contains([]) == 0 and client.get([]) == []


def test_namespaces_keep_models_apart(store):
    with KVStoreClient(store.url, "model-a") as a, KVStoreClient(store.url, "model-b") as b:
        a.put([b"same-hash"], [b"from a"])
        assert b.get([b"same-hash"]) == [None] and b.contains([b"same-hash"]) == 0
        assert bytes(a.get([b"same-hash"])[0]) == b"from a"


def test_hits_misses_and_health_move_on_metrics(store):
    assert httpx.get(f"{store.http}/health", timeout=5).status_code == 200
    before = store.metrics()
    with KVStoreClient(store.url, "metrics-test") as client:
        client.put([b"m0", b"m1"], [bytes(1000), bytes(24)])
        client.get([b"m0", b"m1", b"absent"])
        stats = client.stats()
    after = store.metrics()
    assert after["pdserve_kvstore_hits_total"] - before["pdserve_kvstore_hits_total"] == 2
    assert after["pdserve_kvstore_misses_total"] - before["pdserve_kvstore_misses_total"] == 1
    assert after["pdserve_kvstore_bytes_in_total"] - before["pdserve_kvstore_bytes_in_total"] == 1024
    assert after["pdserve_kvstore_bytes_out_total"] - before["pdserve_kvstore_bytes_out_total"] == 1024
    assert after["pdserve_kvstore_entries"] - before["pdserve_kvstore_entries"] == 2
    assert after["pdserve_kvstore_capacity_bytes"] == 256 * MiB
    assert after['pdserve_kvstore_requests_total{op="get"}'] - before['pdserve_kvstore_requests_total{op="get"}'] == 1
    assert stats["entries"] == after["pdserve_kvstore_entries"] and stats["capacity_bytes"] == 256 * MiB
    assert httpx.get(f"{store.http}/nothing-here", timeout=5).status_code == 404


def test_concurrent_clients_never_see_a_torn_value(store):
    keys = [f"shared-{i}".encode() for i in range(4)]
    size, writers, rounds = 512 * 1024, 4, 60
    seen: list[int] = []
    problems: list[str] = []

    def work(writer: int) -> None:
        rng = np.random.default_rng(writer)
        pattern = np.full(size, writer + 1, dtype=np.uint8)
        with KVStoreClient(store.url, "torn-test", timeout_s=20) as client:
            for _ in range(rounds):
                chosen = [keys[i] for i in rng.choice(len(keys), size=2, replace=False)]
                client.put(chosen, [pattern, pattern])
                for value in client.get(keys):
                    if value is None:
                        continue
                    array = np.frombuffer(value, np.uint8)
                    # Every value read must be exactly one writer's whole value.
                    if array.size != size or not (array == array[0]).all() or not 1 <= array[0] <= writers:
                        problems.append(f"torn value: size {array.size}, bytes {sorted(set(array[:: 4096]))}")
                    seen.append(int(array[0]))

    threads = [threading.Thread(target=work, args=(w,)) for w in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not problems, problems[:3]
    # The writers really interleaved: reads saw more than one writer's pattern.
    assert len(seen) > writers * rounds and len(set(seen)) > 1


def send_raw(sock: zmq.Socket, *frames: bytes) -> protocol.ReplyHeader:
    sock.send_multipart(list(frames))
    reply = sock.recv_multipart()
    return protocol.decode_reply(reply[0])


def header(*fields) -> bytes:
    return msgspec.msgpack.encode(list(fields))


@pytest.mark.parametrize("frames, request_id, message", [
    ([header("delete", 11, "m", [b"k"])], 11, "unknown op 'delete'"),
    ([header("put", 12, "m", [b"a", b"b"]), b"only one value"], 12, "2 keys, 1 value frames"),
    ([header("put", 13, "m", [b"a"])], 13, "1 keys, 0 value frames"),
    ([header("get", 14, "m", [b"a"]), b"stray value"], 14, "get takes no value frames"),
    ([header("put", 15, "m", [b"a"]), bytes(4 * MiB + 1)], 15, "over the frame limit of 4194304 bytes"),
    ([b"\xc1\x00 certainly not msgpack"], 0, "not msgpack"),
    ([header("get", 16, "m", "not a list")], 16, "malformed request header"),
    ([msgspec.msgpack.encode({"op": "stats"})], 0, "malformed request header"),
    ([header("get", 17, "m", [b"k"] * 65)], 17, "65 keys in one request exceed the limit of 64"),
])
def test_bad_requests_get_an_error_reply_and_the_service_keeps_serving(store, raw, frames, request_id, message):
    errors_before = store.metrics()["pdserve_kvstore_errors_total"]
    reply = send_raw(raw, *frames)
    assert reply.ok is False and message in reply.error and reply.request_id == request_id
    # Nothing of a refused put was stored, and a good request right after is served.
    good = send_raw(raw, header("put", 99, "m", [b"after"]), b"fine")
    assert good.ok and good.request_id == 99
    with KVStoreClient(store.url, "m") as client:
        assert client.contains([b"a"]) == 0 and bytes(client.get([b"after"])[0]) == b"fine"
    assert store.metrics()["pdserve_kvstore_errors_total"] == errors_before + 1
    assert store.proc.poll() is None


def test_client_surfaces_refusals_as_kvstore_errors(store):
    with KVStoreClient(store.url, "m") as client:
        with pytest.raises(KVStoreError, match="refused get: 65 keys in one request exceed the limit of 64"):
            client.get([b"k"] * 65)
        with pytest.raises(KVStoreError, match="refused put: value 0 is 4194305 bytes, over the frame limit"):
            client.put([b"k"], [bytes(4 * MiB + 1)])
        client.put([b"still-fine"], [b"yes"])  # the same client goes on
        assert bytes(client.get([b"still-fine"])[0]) == b"yes"
        with pytest.raises(ValueError, match="one value per key"):
            client.put([b"a", b"b"], [b"x"])
        with pytest.raises(TypeError, match="keys must be bytes"):
            client.get(["text"])
        with pytest.raises(ValueError, match="C-contiguous"):
            client.put([b"a"], [np.zeros((4, 4), np.float32)[:, ::2]])


def test_capacity_holds_under_a_stream_of_puts_through_the_service(tmp_path):
    value_size, capacity_values = 256 * 1024, 8
    # An entry is charged its value, its key (namespace-prefixed: 16 bytes for "block-NN" here)
    # and a fixed overhead.
    entry = value_size + len(protocol.store_key("stream", b"block-10")) + ENTRY_OVERHEAD_BYTES
    with running_store(tmp_path, "--capacity", str(capacity_values * entry)) as store, \
            KVStoreClient(store.url, "stream") as client:
        keys = [f"block-{i}".encode() for i in range(40)]
        for start in range(0, len(keys), 4):
            batch = keys[start:start + 4]
            client.put(batch, [np.full(value_size, start + j, np.uint8) for j in range(len(batch))])
            stats = client.stats()
            assert stats["bytes_stored"] <= stats["capacity_bytes"] and stats["entries"] <= capacity_values
        # The newest capacity's worth stayed; everything older went, oldest first.
        assert client.contains(keys[-capacity_values:]) == capacity_values
        assert client.contains(keys[-capacity_values - 1:]) == 0
        # A get refreshes: the oldest survivor read now outlives the next one in line.
        oldest, second = keys[-capacity_values], keys[-capacity_values + 1]
        assert np.frombuffer(client.get([oldest])[0], np.uint8)[0] == len(keys) - capacity_values
        client.put([b"newcomer"], [bytes(value_size)])
        assert client.contains([oldest]) == 1 and client.contains([second]) == 0
        metrics = store.metrics()
        assert metrics["pdserve_kvstore_evictions_total"] == len(keys) + 1 - capacity_values
        assert metrics["pdserve_kvstore_entries"] == capacity_values
        assert metrics["pdserve_kvstore_bytes_stored"] == capacity_values * entry
        with pytest.raises(KVStoreError, match="larger than the store's capacity"):
            client.put([b"too-big"], [bytes(capacity_values * entry + 1)])
        assert client.contains([oldest]) == 1  # the refused put evicted nothing


def test_store_killed_then_restarted_the_same_client_recovers(tmp_path):
    timeout_s = 1.0
    port = free_port_pair()
    log_path = tmp_path / "kvstore.log"
    store = start_store(kvstore_cmd(port), port, log_path)
    client = KVStoreClient(store.url, "restart", timeout_s=timeout_s)
    try:
        client.put([b"k"], [b"before"])
        assert bytes(client.get([b"k"])[0]) == b"before"

        # A stalled store: the call times out; the reply it sends once resumed must not answer
        # the next call (which asks for a different key).
        client.put([b"other"], [b"other value"])
        store.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(KVStoreError, match="did not answer get within 1s"):
                client.get([b"k"])
        finally:
            store.proc.send_signal(signal.SIGCONT)
        assert bytes(client.get([b"other"])[0]) == b"other value"

        store.proc.send_signal(signal.SIGKILL)
        store.proc.wait()
        for call in (lambda: client.get([b"k"]), lambda: client.put([b"k"], [b"x"]), lambda: client.contains([b"k"]),
                     client.stats):
            started = time.monotonic()
            with pytest.raises(KVStoreError, match=f"KV store at {store.url}"):
                call()
            # Bounded by the client's timeout (generous slack for a loaded machine): never a hang.
            assert time.monotonic() - started < timeout_s + 5

        store = start_store(kvstore_cmd(port), port, log_path)
        # Same client object, no retry: it reconnects on its own. The new store starts empty.
        assert client.get([b"k"]) == [None]
        client.put([b"k"], [b"after"])
        assert bytes(client.get([b"k"])[0]) == b"after"
    finally:
        client.close()
        assert stop(store) == 0, store.log()
    assert "kvstore stopped" in store.log()


def test_sigint_also_stops_cleanly(tmp_path):
    port = free_port_pair()
    store = start_store(kvstore_cmd(port, "--capacity-gib", "0.5"), port, tmp_path / "kvstore.log")
    with KVStoreClient(store.url, "m") as client:
        assert client.stats()["capacity_bytes"] == 2**29
    store.proc.send_signal(signal.SIGINT)
    assert store.proc.wait(timeout=20) == 0, store.log()


def test_the_operator_rendered_command_starts_and_serves(tmp_path):
    example = REPO / "crds" / "examples" / "llama-gpu-autoscaling.yaml"
    rendered = subprocess.run([sys.executable, "-m", "pdserve", "operator", "render", "-f", str(example)],
                              capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONSAFEPATH="1"))
    deployments = {d["metadata"]["name"]: d for d in yaml.safe_load_all(rendered.stdout)
                   if d and d["kind"] == "Deployment"}
    container = deployments["llama-kvstore"]["spec"]["template"]["spec"]["containers"][0]
    command = container["command"] + container["args"]
    assert command[:2] == ["pdserve", "kvstore"] and "--capacity" in command
    port = free_port_pair()
    command[command.index("--host") + 1] = "127.0.0.1"
    command[command.index("--port") + 1] = str(port)
    # `pdserve` is the console script installed next to this interpreter.
    command[0] = str(Path(sys.executable).parent / "pdserve")
    store = start_store(command, port, tmp_path / "kvstore.log")
    try:
        with KVStoreClient(store.url, "llama-3-8b-instruct") as client:
            block = realistic_block(7)
            client.put([b"h"], [block])
            assert torch.equal(as_tensor(client.get([b"h"])[0]), block)
            capacity = int(command[command.index("--capacity") + 1])
            assert client.stats()["capacity_bytes"] == capacity == 32 * 2**30
    finally:
        assert stop(store) == 0, store.log()


def test_capacity_quantities():
    assert parse_quantity("4Gi") == 4 * 2**30 and parse_quantity("512Mi") == 512 * MiB
    assert parse_quantity("1000000") == 1_000_000 and parse_quantity("1.5G") == 1_500_000_000
    assert parse_quantity("1e9") == 10**9 and parse_quantity("64Ki") == 65536


@pytest.mark.parametrize("args, message", [
    (["--capacity", "8 GB"], "is not a byte count or Kubernetes quantity"),
    (["--capacity", "0"], "capacity must be more than zero bytes"),
    (["--capacity", "1Gi", "--capacity-gib", "1"], "not allowed with argument"),
    (["--max-frame-bytes", "-3"], "must be positive"),
    (["--max-frame-bytes", str(2**30)], "must be at most 268435456 bytes"),
])
def test_bad_flags_are_a_clear_start_up_error(args, message):
    result = subprocess.run(kvstore_cmd(free_port_pair(), *args), capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, PYTHONSAFEPATH="1"))
    assert result.returncode == 2 and message in result.stderr


def test_a_taken_port_is_a_clear_start_up_error(store):
    result = subprocess.run(kvstore_cmd(store.port), capture_output=True, text=True, timeout=60,
                            env=dict(os.environ, PYTHONSAFEPATH="1"))
    assert result.returncode == 1 and f"cannot bind the KV store to tcp://127.0.0.1:{store.port}" in result.stderr
