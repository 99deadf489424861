"""Build a model and fill it from a Hugging Face directory of safetensors, sharded or not.

Each tensor-parallel rank opens the files lazily and reads only its slice of every weight.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.engine.config import GGUF_TYPES_KEY, ModelConfig
from pdserve.engine.model.layers import pack_model_weights
from pdserve.engine.model.llama import MODEL_CLASSES

log = logging.getLogger("pdserve.engine.loader")


def safetensors_files(path: str) -> list[Path]:
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / _index_entry(index, n) for n in names]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors files in {path!r}")
    return files


def _index_entry(index: Path, name: object) -> Path:
    """A file named by a safetensors index, which must lie inside the model directory: a downloaded
    checkpoint must not make the server read files elsewhere. (Symlinks inside the directory are
    followed, as the Hugging Face cache's snapshot folders are made of them.)"""
    entry = Path(name) if isinstance(name, str) and name else None
    if entry is None or entry.is_absolute() or ".." in entry.parts or entry.drive:
        raise ValueError(f"{index}: weight_map entry {name!r} is not a file name inside the model directory")
    return entry


def gguf_q8_0_modules(model: torch.nn.Module, cfg: ModelConfig) -> set[str]:
    """The linear layers every checkpoint tensor of which was Q8_0 in the GGUF file (gguf_convert
    records the types); a tied lm_head counts when the embedding was."""
    types: dict[str, set[str]] = {}
    for name, kind in cfg.hf_config.get(GGUF_TYPES_KEY, {}).items():
        target = model.checkpoint_name_to_param(name)
        if target is not None:
            types.setdefault(target[0].rsplit(".", 1)[0], set()).add(kind)
    if cfg.tie_word_embeddings and "model.embed_tokens" in types:
        types["lm_head"] = types["model.embed_tokens"]
    return {module for module, kinds in types.items() if kinds == {"Q8_0"}}


def load_model(cfg: ModelConfig, device: str | torch.device, progress: bool = False) -> torch.nn.Module:
    start = time.perf_counter()
    with torch.device(device):
        model = MODEL_CLASSES[cfg.architecture](cfg)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    files = safetensors_files(cfg.path)
    if progress:
        from tqdm import tqdm
        files = tqdm(files, desc="Loading safetensors", unit="file")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                target = model.checkpoint_name_to_param(name)
                if target is None:
                    continue
                param_name, part = target
                if param_name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in {cfg.architecture}")
                param = params[param_name]
                loader = getattr(param, "weight_loader", None)
                sl = f.get_slice(name)
                with torch.no_grad():
                    if loader is None:
                        param.data.copy_(sl[:])
                    else:
                        loader(param, sl, part)
                loaded.add(param_name)
    missing = {n for n in params if n not in loaded}
    if cfg.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint {cfg.path!r} lacks weights for: {sorted(missing)[:8]}")
    model.eval()
    if cfg.quantization:
        # After loading, so each tensor-parallel rank quantizes its own shard.
        from pdserve.engine.model.quant import quantize_model

        only = gguf_q8_0_modules(model, cfg) if cfg.keep_gguf_q8_0 else None
        count = quantize_model(model, cfg.quantization, only=only, lossless=cfg.keep_gguf_q8_0,
                               int8_activations=cfg.int8_activations)
        log.info("quantized %d weight matrices to %s%s%s (%s)", count, cfg.quantization,
                 ", as the GGUF file stores them" if cfg.keep_gguf_q8_0 else "",
                 ", int8 activations in decode steps" if cfg.int8_activations else "",
                 _int8_kernels(model))
    # The float weights left (all of them without quantization) get the CPU's fast paths.
    if os.environ.get("PDSERVE_PACK_WEIGHTS", "1") != "0":
        packed = pack_model_weights(model)
        if packed:
            log.info("prepacked %d weight matrices for the CPU", packed)
    from pdserve.engine.model.linear_tuning import maybe_tune

    maybe_tune(model)
    log.info("loaded %s (%s, %s) in %.2fs", cfg.path, cfg.architecture, cfg.dtype, time.perf_counter() - start)
    return model


def _int8_kernels(model: torch.nn.Module) -> str:
    """Which kernels multiply the model's int8 weights, for the load log."""
    from pdserve.engine.model.quant import kernel_available

    if any(getattr(getattr(m, "quantized", None), "tiles", None) is not None for m in model.modules()):
        return "bfloat16 rows on AMX tiles"
    return "int8 kernels for decode and prefill" if kernel_available() else "float32 slabs only: no vectorized kernel"
