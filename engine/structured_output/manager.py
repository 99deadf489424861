"""The engine core's structured-output manager: compiles grammars off the busy loop, caches them,
and fills each step's token bitmask.

Compiles run on a small thread pool (xgrammar releases the GIL while it compiles), so the busy
loop only ever submits a compile and later polls whether it is done. Compiled grammars are kept
in a bounded LRU keyed by StructuredOutputsParams.key(): equal specs share one compile, and
every request (each n>1 sample included) gets its own matcher from the shared grammar. The cache
holds futures, so a spec asked for again while it compiles waits on the same compile.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.engine.structured_output.compiler import GrammarCompiler
from pdserve.engine.structured_output.params import StructuredOutputsParams
from pdserve.engine.structured_output.request_state import StructuredOutputRequest

if TYPE_CHECKING:
    from pdserve.engine.config import ModelConfig

log = logging.getLogger("pdserve.engine.structured_output")

DEFAULT_CACHE_SIZE = 256
DEFAULT_COMPILE_THREADS = 2
# From this many rows on, the step's bitmask rows are filled by xgrammar's threads in parallel.
BATCH_FILL_MIN_ROWS = 8


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row: one bit per token id."""
    return (vocab_size + 31) // 32


class StructuredOutputManager:
    def __init__(self, model: "ModelConfig", *, cache_size: int = DEFAULT_CACHE_SIZE,
                 compile_threads: int = DEFAULT_COMPILE_THREADS) -> None:
        self.vocab_size = model.vocab_size
        self.compiler = GrammarCompiler(model.tokenizer, model.vocab_size, model.eos_token_ids,
                                        max_threads=max(1, min(compile_threads, os.cpu_count() or 1)))
        self.cache_size = cache_size
        self.compile_threads = compile_threads
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._batch_matcher: Any = None
        self._compiled_event = threading.Event()
        # Counters (cumulative): compiles started, cache hits, compiles that failed, compile seconds.
        self.num_compiles = 0
        self.num_cache_hits = 0
        self.num_failures = 0
        self.compile_seconds = 0.0

    # -- compiling ----------------------------------------------------------------------------

    def start(self, state: StructuredOutputRequest) -> None:
        """Point the request at its grammar: a cached (maybe still compiling) one, or a new compile."""
        state.grammar = self.grammar_for(state.params)

    def grammar_for(self, params: StructuredOutputsParams) -> Future:
        key = params.key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return future
            future = self._submit(params, key)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.num_compiles += 1
            return future

    def _submit(self, params: StructuredOutputsParams, key: tuple) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.compile_threads, thread_name_prefix="grammar-compile")
        future = self._pool.submit(self._compile, params)
        future.add_done_callback(lambda f: self._compiled(key, f))
        return future

    def _compile(self, params: StructuredOutputsParams) -> Any:
        start = time.perf_counter()
        try:
            return self.compiler.compile(params)
        finally:
            with self._lock:
                self.compile_seconds += time.perf_counter() - start

    def _compiled(self, key: tuple, future: Future) -> None:
        if future.exception() is not None:
            with self._lock:
                self.num_failures += 1
                # A failure is not cached: the same spec compiles again if asked for again.
                if self._cache.get(key) is future:
                    del self._cache[key]
        self._compiled_event.set()

    def activate(self, state: StructuredOutputRequest) -> bool:
        """The compile has ended: give the request its matcher. False (and `state.error`) if not."""
        return state.take_result(self.compiler.new_matcher)

    def wait_for_compile(self, timeout: float) -> None:
        """Block until some compile ends (or `timeout`): for a caller with nothing else to do."""
        self._compiled_event.wait(timeout)
        self._compiled_event.clear()

    # -- each step ----------------------------------------------------------------------------

    def fill_bitmask(self, states: list[StructuredOutputRequest]) -> np.ndarray:
        """One row per state, in order: bit t of a row set when token t may come next."""
        bitmask = np.full((len(states), bitmask_width(self.vocab_size)), -1, dtype=np.int32)
        if len(states) >= BATCH_FILL_MIN_ROWS and (os.cpu_count() or 1) > 2:
            if self._batch_matcher is None:
                import xgrammar as xgr

                self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=min(8, (os.cpu_count() or 2) // 2))
            self._batch_matcher.batch_fill_next_token_bitmask([s.matcher for s in states], bitmask)
        else:
            for row, state in enumerate(states):
                state.matcher.fill_next_token_bitmask(bitmask, row)
        return bitmask

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
