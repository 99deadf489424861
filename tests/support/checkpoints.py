"""Broken copies of test checkpoints, for start-up failure tests."""

from __future__ import annotations

from pathlib import Path


def truncated_checkpoint(source: str, target: Path) -> Path:
    """Copy the checkpoint at `source` to `target` with its safetensors file cut to 4 KiB: the
    config and tokenizer load, the weights do not."""
    target.mkdir()
    for f in Path(source).iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    shard = next(target.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:4096])
    return target
