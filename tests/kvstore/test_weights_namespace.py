"""Shared KV blocks are keyed by the weights, not the model name (item 7), and shared-storage stays
within its capacity.

A new checkpoint deployed under the same served name gets another namespace, so an engine of it
never loads KV computed by the old weights, through the KV store or through shared files.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pdserve.engine.model.fingerprint import SAMPLE_BYTES, checkpoint_fingerprint, sample_offsets
from pdserve.kvstore.client import KVStoreClient
from pdserve.kvstore.storage_connector import FileBackend, block_namespace
from support.kvstore import running_store

MiB = 2**20


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """A minimal safetensors file (JSON header, then the raw tensors), float32 only."""
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        data = np.ascontiguousarray(array, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def checkpoint(root: Path, weights: dict[str, np.ndarray], config: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config or {"hidden_size": 8, "num_hidden_layers": 2}))
    write_safetensors(root / "model.safetensors", weights)
    return root


def small_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"embed": rng.standard_normal((64, 8)), "lm_head": rng.standard_normal((64, 8))}


def test_the_fingerprint_follows_config_and_every_weight_value_and_nothing_else(tmp_path):
    weights = small_weights()
    base = checkpoint(tmp_path / "a", weights)
    first = checkpoint_fingerprint(base)
    assert first == checkpoint_fingerprint(base)  # stable
    # The same files elsewhere (another pod's copy, written later): the same fingerprint.
    copy = Path(shutil.copytree(base, tmp_path / "copy"))
    assert checkpoint_fingerprint(copy) == first
    # One weight value changed: another fingerprint.
    edited = dict(weights, lm_head=weights["lm_head"].copy())
    edited["lm_head"][3, 5] += 1e-3
    assert checkpoint_fingerprint(checkpoint(tmp_path / "b", edited)) != first
    # The config changed, weights the same: another fingerprint.
    assert checkpoint_fingerprint(checkpoint(tmp_path / "c", weights, {"hidden_size": 8, "num_hidden_layers": 3})) \
        != first
    # A dtype / shape change shows in the header.
    reshaped = dict(weights, embed=weights["embed"].reshape(32, 16))
    assert checkpoint_fingerprint(checkpoint(tmp_path / "d", reshaped)) != first
    # Files other than config and weights (a README, the tokenizer) do not matter.
    (copy / "README.md").write_text("notes")
    assert checkpoint_fingerprint(copy) == first


def test_large_files_are_sampled_and_a_changed_file_is_seen_again(tmp_path):
    root = tmp_path / "big"
    root.mkdir()
    (root / "config.json").write_text("{}")
    weights = root / "model.gguf"  # also how a GGUF checkpoint is named
    data = bytearray(np.random.default_rng(1).integers(0, 256, 40 * MiB, dtype=np.uint8).tobytes())
    weights.write_bytes(data)
    first = checkpoint_fingerprint(root)
    assert checkpoint_fingerprint(weights) != first  # a single-file path (a .gguf) works too
    # Re-training changes nearly every value, so every sampled slice: one byte in one slice is enough.
    offset = sample_offsets(len(data))[3] + SAMPLE_BYTES // 2
    data[offset] ^= 0xFF
    weights.write_bytes(data)  # the memo sees the new mtime
    assert checkpoint_fingerprint(root) != first
    with pytest.raises(FileNotFoundError):
        checkpoint_fingerprint(tmp_path / "missing")


def engine_config(path: Path, name: str = "served-name", **model: object) -> SimpleNamespace:
    return SimpleNamespace(model=SimpleNamespace(path=str(path), served_model_name=name, dtype="torch.bfloat16",
                                                 **model),
                           cache=SimpleNamespace(block_size=16), parallel=SimpleNamespace(tensor_parallel_size=1))


def test_each_quantization_of_the_same_weights_is_its_own_namespace(tmp_path):
    """int8, q8_0 and a GGUF's Q8_0 layers kept as stored compute different KV from one another and
    from the float weights: none may load another's blocks."""
    root = checkpoint(tmp_path / "w", small_weights(0))
    spaces = [block_namespace(engine_config(root)),
              block_namespace(engine_config(root, quantization="int8")),
              block_namespace(engine_config(root, quantization="q8_0")),
              block_namespace(engine_config(root, quantization="q8_0", keep_gguf_q8_0=True))]
    assert len(set(spaces)) == 4


def test_a_new_checkpoint_under_the_same_name_never_loads_the_old_kv(tmp_path):
    old = checkpoint(tmp_path / "old", small_weights(0))
    new = checkpoint(tmp_path / "new", small_weights(1))
    old_ns, new_ns = block_namespace(engine_config(old)), block_namespace(engine_config(new))
    assert old_ns != new_ns and old_ns.startswith("served-name|w")
    assert block_namespace(engine_config(Path(shutil.copytree(old, tmp_path / "old-copy")))) == old_ns
    # Through the KV store: what the old weights' engine put, the new one's engine does not find.
    with running_store(tmp_path) as store:
        with KVStoreClient(store.url, old_ns) as old_engine, KVStoreClient(store.url, new_ns) as new_engine:
            old_engine.put([b"r0:prefix-hash"], [b"old KV"])
            assert new_engine.contains([b"r0:prefix-hash"]) == 0 and new_engine.get([b"r0:prefix-hash"]) == [None]
            assert bytes(old_engine.get([b"r0:prefix-hash"])[0]) == b"old KV"
    # Through shared files: likewise.
    FileBackend(str(tmp_path / "kv"), old_ns).put([b"h"], [b"old KV"])
    assert FileBackend(str(tmp_path / "kv"), new_ns).contains([b"h"]) == 0


def test_shared_storage_evicts_the_oldest_files_at_capacity(tmp_path):
    import os

    backend = FileBackend(str(tmp_path / "kv"), "ns", capacity_bytes=4000)
    other = FileBackend(str(tmp_path / "kv"), "other-model", capacity_bytes=4000)
    for i in range(3):
        backend.put([b"k%d" % i], [bytes(1000)])
        os.utime(backend._path(b"k%d" % i), (1000 + i, 1000 + i))  # a clear age order
    other.put([b"o"], [bytes(1000)])
    os.utime(other._path(b"o"), (1010, 1010))
    backend.put([b"k3", b"k4"], [bytes(1000), bytes(1000)])  # 6000 > 4000: the two oldest go
    assert backend.contains([b"k0"]) == 0 and backend.contains([b"k1"]) == 0
    assert backend.contains([b"k2", b"k3", b"k4"]) == 3 and other.contains([b"o"]) == 1
    total = sum(p.stat().st_size for p in (tmp_path / "kv").glob("*/*.kv"))
    assert total <= 4000 and backend.evictions == 2
    backend.put([b"huge"], [bytes(5000)])  # larger than the whole capacity: not written, nothing evicted
    assert backend.contains([b"huge"]) == 0 and backend.contains([b"k2"]) == 1
    with pytest.raises(ValueError, match="capacity_bytes must be positive"):
        FileBackend(str(tmp_path / "kv"), "ns", capacity_bytes=0)
