"""Loading the Hugging Face tokenizer of a model directory."""

from __future__ import annotations

from functools import lru_cache
from typing import Any


@lru_cache(maxsize=8)
def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def backend_tokenizer(tokenizer: Any) -> Any | None:
    """The Rust `tokenizers.Tokenizer` behind a fast tokenizer, if there is one."""
    return getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
