"""Incremental detokenization: text grows token by token and never ends in a broken character.

A token can hold part of a multi-byte character; its text is held back until the character is
complete. Fast tokenizers use the Rust `DecodeStream`; others fall back to decoding a short
window of ids and emitting what the newest token added.
"""

from __future__ import annotations

from typing import Any

from pdserve.engine.frontend.tokenizer import backend_tokenizer

# Prompt tokens fed first so the first generated word gets its leading space right.
_CONTEXT_TOKENS = 6
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.output_text = ""
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self._backend = backend_tokenizer(tokenizer)
        self._stream = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=list(context), skip_special_tokens=skip_special_tokens)
        self._ids = list(context)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_ids: list[int]) -> str:
        """Add generated tokens; return the text they completed (possibly empty)."""
        pieces = []
        for token in token_ids:
            piece = self._step(token)
            if piece:
                pieces.append(piece)
        delta = "".join(pieces)
        self.output_text += delta
        return delta

    def _step(self, token: int) -> str | None:
        if self._stream is not None:
            try:
                return self._stream.step(self._backend, token)
            except Exception:
                # Out-of-vocabulary ids (a model whose vocab is larger than its tokenizer) decode to nothing.
                return None
        self._ids.append(token)
        decode = self.tokenizer.decode
        before = decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=self.skip_special_tokens)
        after = decode(self._ids[self._prefix_offset:], skip_special_tokens=self.skip_special_tokens)
        if len(after) > len(before) and not after.endswith(_REPLACEMENT):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return after[len(before):]
        return None
