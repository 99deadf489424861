"""A short digest that identifies a checkpoint's weights, for namespacing shared KV blocks.

KV blocks computed by one set of weights are wrong for any other, even under the same model name,
so the KV store and shared-storage connectors key their blocks by this digest too. It must be the
same on every pod that holds the same files (prefill and decode run on different machines), so it
is computed from content only, never from paths or timestamps. And it must be fast on a 100 GB
checkpoint, so it reads a bounded amount per file:
- config.json, whole (architecture, sizes, dtype);
- for every weights file, sorted by name: its name and size; its self-description (a safetensors
  file's JSON header: every tensor's name, dtype, shape and offsets; else the first MiB, which for
  GGUF holds the metadata and tensor table); and SAMPLES slices of SAMPLE_BYTES spread evenly over
  the file. A file up to WHOLE_FILE_BYTES is read whole.
So any change of shape, dtype or tensor set changes the digest, and so does re-training or
fine-tuning (which changes nearly every value, so every sampled slice). An edit of a few values in a
large file between samples is not seen: that is not how checkpoints change.

Torch-free. Memoized per (path, each file's size and mtime), so repeated calls (every connector of
every rank builds its namespace) read nothing again until a file changes.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")
CONFIG_NAME = "config.json"
HEAD_BYTES = 2**20
SAMPLES = 8
SAMPLE_BYTES = 64 * 2**10
WHOLE_FILE_BYTES = 16 * 2**20
# A safetensors header larger than this is not a header we trust to read whole: take HEAD_BYTES.
MAX_SAFETENSORS_HEADER = 256 * 2**20
DIGEST_HEX_CHARS = 24  # 96 bits: no accidental collision between checkpoints, short in a key

_memo: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}
_memo_lock = threading.Lock()


def checkpoint_files(path: str | os.PathLike[str]) -> list[Path]:
    """config.json (if any) then the weights files, sorted by name; a file path is itself."""
    root = Path(path)
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise FileNotFoundError(f"no checkpoint at {str(root)!r}")
    weights = sorted((p for p in root.iterdir() if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)),
                     key=lambda p: p.name)
    config = root / CONFIG_NAME
    return ([config] if config.is_file() else []) + weights


def sample_offsets(size: int, samples: int = SAMPLES, sample_bytes: int = SAMPLE_BYTES) -> list[int]:
    """Start offsets of `samples` slices spread evenly from the start to the end of a file."""
    last = max(size - sample_bytes, 0)
    if samples <= 1:
        return [0]
    return sorted({last * i // (samples - 1) for i in range(samples)})


def _self_description(handle, name: str, size: int) -> bytes:
    handle.seek(0)
    if name.endswith(".safetensors") and size >= 8:
        (length,) = struct.unpack("<Q", handle.read(8))
        if 0 < length <= min(MAX_SAFETENSORS_HEADER, size - 8):
            return handle.read(length)
        handle.seek(0)
    return handle.read(HEAD_BYTES)


def _digest_file(digest: "hashlib._Hash", path: Path) -> None:
    size = path.stat().st_size
    digest.update(f"{path.name}\0{size}\0".encode())
    with open(path, "rb") as handle:
        if path.name == CONFIG_NAME or size <= WHOLE_FILE_BYTES:
            digest.update(handle.read())
            return
        digest.update(_self_description(handle, path.name, size))
        for offset in sample_offsets(size):
            handle.seek(offset)
            digest.update(handle.read(SAMPLE_BYTES))


def _stamp(files: list[Path]) -> tuple[tuple[str, int, int], ...]:
    stamps = []
    for path in files:
        st = path.stat()
        stamps.append((path.name, st.st_size, st.st_mtime_ns))
    return tuple(stamps)


def checkpoint_fingerprint(path: str | os.PathLike[str]) -> str:
    """Hex digest of the checkpoint at `path` (a model folder, or a single weights file such as a
    .gguf); FileNotFoundError if there is none."""
    files = checkpoint_files(path)
    key = (os.path.abspath(path), _stamp(files))
    with _memo_lock:
        cached = _memo.get(key)
    if cached is not None:
        return cached
    digest = hashlib.sha256(b"pdserve-checkpoint-fingerprint/1\0")
    for file in files:
        _digest_file(digest, file)
    value = digest.hexdigest()[:DIGEST_HEX_CHARS]
    with _memo_lock:
        _memo[key] = value
    return value
