"""The router's own tokenizer (`--tokenizer`): exact prompt lengths and prefix hashes, computed on
worker threads so that no prompt, however long, holds up the event loop; and the cheap check that
refuses an obviously too long prompt before any tokenizing.

The check: a prompt of C characters has at least C / (K * S) tokens, where K is the most
characters one vocabulary entry covers and S how many characters normalization can fold into
one (1 without a normalizer; 4 for NFC/NFKC, whose longest composition is four characters into
one). No engine accepts more tokens than the model's max_position_embeddings (the engine
refuses a larger --max-model-len), so a prompt with more than that times K * S characters cannot
be valid. Tokenizers whose normalizer or pre-tokenizer may drop characters (BERT-style clean-up,
whitespace splitting, stripping) give no bound: C characters may then be any number of tokens.
"""

from __future__ import annotations

import json
import logging
import queue
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger("pdserve.router")

TOKENIZE_THREADS = 2  # each with its own tokenizer instance: one long prompt leaves the other free
NO_LENGTH_LIMIT = 10**30  # transformers' own "no limit" value of model_max_length
# Characters one composed character can stand for under NFC/NFKC: the longest canonical
# decomposition in Unicode (e.g. U+1F8F, GREEK CAPITAL ALPHA with three marks, is four).
NFC_FOLD = 4
# Normalizers and pre-tokenizers that never drop a character (a Replace only if it never shortens).
KEEPS_CHARACTERS = {"Prepend", "Lowercase", "NFD", "NFKD", "ByteLevel", "Metaspace", "Digits", "Punctuation",
                    "UnicodeScripts", "Split"}


def _folding(spec: dict[str, Any] | None) -> int | None:
    """S for one normalizer or pre-tokenizer spec (tokenizer.json): None if it may drop characters."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        parts = spec.get("normalizers") or spec.get("pretokenizers") or []
        fold = 1
        for part in parts:
            one = _folding(part)
            if one is None:
                return None
            fold *= one
        return fold
    if kind in ("NFC", "NFKC"):
        return NFC_FOLD
    if kind == "Replace":
        pattern = spec.get("pattern") or {}
        content = spec.get("content") or ""
        literal = pattern.get("String")
        return 1 if literal is not None and len(content) >= len(literal) else None
    if kind == "Split":
        return 1 if spec.get("behavior") != "Removed" else None
    return 1 if kind in KEEPS_CHARACTERS else None


def model_max_tokens(path: str, tokenizer: Any) -> int | None:
    """The most tokens any engine of this model accepts: its max_position_embeddings, as the engine
    reads it (2048 when config.json lacks it); else the tokenizer's own model_max_length."""
    config = Path(path) / "config.json"
    if config.is_file():
        try:
            return int(json.loads(config.read_text()).get("max_position_embeddings", 2048))
        except (ValueError, TypeError, AttributeError):
            return None
    limit = getattr(tokenizer, "model_max_length", None)
    return int(limit) if isinstance(limit, int) and 0 < limit < 10**8 else None


def derived_char_limit(path: str, tokenizer: Any) -> int | None:
    """Characters beyond which no prompt can fit the model (see the module's docstring), or None."""
    from pdserve.engine.frontend.tokenizer import backend_tokenizer

    tokens = model_max_tokens(path, tokenizer)
    backend = backend_tokenizer(tokenizer)
    if tokens is None or backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # not a tokenizers.Tokenizer after all: no bound, the engine still counts
        return None
    normalizer, pre_tokenizer = _folding(spec.get("normalizer")), _folding(spec.get("pre_tokenizer"))
    if normalizer is None or pre_tokenizer is None:
        log.info("the tokenizer may drop characters: prompts are not refused by length before tokenizing")
        return None
    # Entries are as the tokenizer spells them (byte-level: one character per byte, so at least
    # as long as the text they cover); added tokens are matched on the raw text.
    longest = max((len(entry) for entry in tokenizer.get_vocab()), default=1)
    return tokens * max(1, longest) * normalizer * pre_tokenizer


class LocalTokenizer:
    """Token ids of a request body with the model's own tokenizer, as the engine computes them.

    `completion` and `chat` run on the calling thread; the router calls them through `executor`,
    whose threads each take one of the instances (a fast tokenizer must not serve two threads at
    once: it mutates its settings per call)."""

    def __init__(self, path: str, threads: int = TOKENIZE_THREADS) -> None:
        from pdserve.engine.frontend.tokenizer import auto_tokenizer
        from pdserve.engine.server.tools import template_knows_tools

        instances = [auto_tokenizer(path) for _ in range(threads)]
        self.char_limit = derived_char_limit(path, instances[0])
        self.knows_tools = template_knows_tools(instances[0])  # else the engines describe tools in the messages
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        for tokenizer in instances:
            # Nothing is truncated here, and the engine judges the length: no "longer than the
            # maximum sequence length" warning for every long prompt.
            tokenizer.model_max_length = NO_LENGTH_LIMIT
            self._idle.put(tokenizer)
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="router-tokenize")

    def _run(self, work: Any) -> list[int]:
        tokenizer = self._idle.get()  # never waits: as many instances as threads
        try:
            return work(tokenizer)
        finally:
            self._idle.put(tokenizer)

    def completion(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        return self._run(lambda tokenizer: list(tokenizer.encode(prompt)))

    def chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
             template_kwargs: dict[str, Any] | None, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The chat's prompt ids as the model's template renders them, `tools` included (for a
        template that reads them; see Router.chat_prompt)."""
        from pdserve.engine.frontend.template_kwargs import check_chat_template_kwargs

        kwargs = dict(template_kwargs or {})
        check_chat_template_kwargs(kwargs)  # a client's own template never runs here either
        if tools:
            kwargs["tools"] = tools

        def render(tokenizer: Any) -> list[int]:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                                **kwargs)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

        return self._run(render)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
