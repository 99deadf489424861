"""Loading the Hugging Face tokenizer of a model directory."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any


@lru_cache(maxsize=8)
def load_tokenizer(path: str) -> Any:
    try:
        return auto_tokenizer(path)
    except (ValueError, OSError, TypeError, KeyError) as exc:  # transformers' own, often without the path
        raise ValueError(f"cannot load the tokenizer of {path}: {type(exc).__name__}: {exc}") from exc


def auto_tokenizer(path: str) -> Any:
    """AutoTokenizer.from_pretrained(path), without the model config's import cost where it is
    not needed.

    transformers loads the model's AutoConfig only to read four fields of it (model_type,
    model_name, tokenizer_class, _name_or_path) when tokenizer_config.json names its class and
    there is no remote code; but loading it imports the model family's modules, and through them
    torch's compiler and distributed packages: about 3 s of a server's start on a small CPU, for
    a tokenizer that then loads in 20 ms. So where the tokenizer's folder has both files and
    names its class, AutoTokenizer gets a plain config with those four fields from config.json,
    and makes the same choice it would make with the full one."""
    from transformers import AutoTokenizer

    config = light_config(path)
    if config is None:
        return AutoTokenizer.from_pretrained(path)
    return AutoTokenizer.from_pretrained(path, config=config)


def light_config(path: str) -> Any | None:
    folder = Path(path)
    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
        model_config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):  # a hub name, a GGUF file, no such files: the usual way
        return None
    if (not isinstance(tokenizer_config, dict) or not isinstance(model_config, dict)
            or not tokenizer_config.get("tokenizer_class") or "auto_map" in tokenizer_config
            or "auto_map" in model_config or not isinstance(model_config.get("model_type"), str)):
        return None
    from transformers import PretrainedConfig

    config = PretrainedConfig(name_or_path=str(path))
    config.model_type = model_config["model_type"]
    for field in ("model_name", "tokenizer_class"):
        if field in model_config:
            setattr(config, field, model_config[field])
    return config


def backend_tokenizer(tokenizer: Any) -> Any | None:
    """The Rust `tokenizers.Tokenizer` behind a fast tokenizer, if there is one."""
    return getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
