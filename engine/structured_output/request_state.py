"""One request's grammar: the compile it waits for, then the matcher that follows its tokens."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from pdserve.engine.structured_output.params import StructuredOutputsParams


class StructuredOutputRequest:
    def __init__(self, params: StructuredOutputsParams) -> None:
        self.params = params
        self.grammar: Future | None = None  # the compiled grammar, set by the manager
        self.matcher: Any = None  # an xgrammar GrammarMatcher once the grammar is ready
        self.error: str | None = None  # why the grammar cannot be used

    @property
    def compiled(self) -> bool:
        """The compile has ended (successfully or not): the scheduler can act on this request."""
        return self.grammar is not None and self.grammar.done()

    def take_result(self, new_matcher: Any) -> bool:
        """After the compile has ended: build the matcher, or record the error. True when usable."""
        assert self.grammar is not None and self.grammar.done()
        exc = self.grammar.exception()
        if exc is not None:
            self.error = str(exc) or type(exc).__name__
            return False
        try:
            self.matcher = new_matcher(self.grammar.result())
        except Exception as exc:  # noqa: BLE001 - a matcher that cannot be built fails this request only
            self.error = f"cannot start a matcher: {exc}"
            return False
        return True

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()
