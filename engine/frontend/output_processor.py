"""Turns EngineCore outputs into RequestOutputs: detokenize, apply stop strings, gather logprobs.

One pass over each batch of core outputs. Stop strings are found here, not in the core, since
they are text; a request that hits one is reported finished and listed for the core to abort.
While a request runs, text that could still turn out to be the start of a stop string is held
back, so streamed text never includes part of a stop string.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.frontend.detokenizer import IncrementalDetokenizer
from pdserve.engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput, SampleLogprobs
from pdserve.engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists, PromptLogprobsLists
from pdserve.engine.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class IterationStats:
    """Latency samples gathered since the metrics last read them (seconds)."""

    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    e2e_latency: list[float] = field(default_factory=list)
    finished_reasons: list[str] = field(default_factory=list)


class ParentRequest:
    """A request with n > 1: its samples run as separate core requests and are reported together."""

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.n = params.n
        self.kind = params.output_kind
        self.latest: dict[int, CompletionOutput] = {}
        self.num_finished = 0

    def child_id(self, index: int) -> str:
        return f"{index}_{self.request_id}"

    def child_params(self, params: SamplingParams, index: int) -> SamplingParams:
        seed = None if params.seed is None else params.seed + index
        return params.clone(n=1, seed=seed)


class RequestState:
    def __init__(self, request: EngineCoreRequest, prompt: str | None, tokenizer: Any,
                 parent: ParentRequest | None, index: int) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.external_id = parent.request_id if parent else request.request_id
        self.parent = parent
        self.index = index
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.params = params
        self.kind = params.output_kind
        self.tokenizer = tokenizer
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params.skip_special_tokens)
        self.token_ids: list[int] = []
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        # Position 0 has no logprob; the others arrive in step-sized runs, in order.
        self.prompt_logprobs: PromptLogprobs | None = [None] if params.prompt_logprobs is not None else None
        self.stop_strings = params.stop or []
        self.hold_back = 0 if (params.include_stop_str_in_output or not self.stop_strings) else \
            max(len(s) for s in self.stop_strings) - 1
        self.text = ""  # detokenized output, cut at a stop string once one is found
        self.sent_chars = self.sent_tokens = self.sent_logprobs = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict[str, Any] | None = None
        self.arrival_time = request.arrival_time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: EngineCoreOutput, now: float, stats: IterationStats) -> bool:
        """Apply one core output. Returns True when a stop string ended the request here."""
        if out.new_token_ids:
            if self.first_token_time is None:
                self.first_token_time = now
                stats.time_to_first_token.append(now - self.arrival_time)
            elif self.last_token_time is not None:
                gap = (now - self.last_token_time) / len(out.new_token_ids)
                stats.inter_token_latency.extend([gap] * len(out.new_token_ids))
            self.last_token_time = now
        self.token_ids.extend(out.new_token_ids)
        self.num_cached_tokens = out.num_cached_tokens
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
        if out.new_logprobs is not None and self.logprobs is not None:
            self._add_logprobs(out.new_logprobs)
        if out.prompt_logprobs is not None and self.prompt_logprobs is not None:
            self._add_prompt_logprobs(out.prompt_logprobs)
        delta = self.detokenizer.push(out.new_token_ids)
        self.text += delta
        stopped_by_string = False
        if delta and self.stop_strings:
            hit = self._find_stop_string(len(delta))
            if hit is not None:
                stop, end = hit
                self.text = self.text[:end]
                self.finish_reason, self.stop_reason = str(FinishReason.STOP), stop
                stopped_by_string = True
        if not self.finished and out.finish_reason is not None:
            self.finish_reason, self.stop_reason = str(out.finish_reason), out.stop_reason
        if self.finished:
            stats.e2e_latency.append(now - self.arrival_time)
            stats.finished_reasons.append(self.finish_reason)
        return stopped_by_string

    def _find_stop_string(self, num_new_chars: int) -> tuple[str, int] | None:
        best: tuple[str, int, int] | None = None
        for stop in self.stop_strings:
            index = self.text.find(stop, max(0, len(self.text) - num_new_chars - len(stop) + 1))
            if index != -1 and (best is None or index < best[1]):
                best = (stop, index, index + len(stop) if self.params.include_stop_str_in_output else index)
        return None if best is None else (best[0], best[2])

    def _add_logprobs(self, lists: LogprobsLists) -> None:
        assert self.logprobs is not None
        for ids, lps, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
            self.logprobs.append(self._logprob_entry(ids, lps, rank))
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + lps[0]

    def _add_prompt_logprobs(self, lists: PromptLogprobsLists) -> None:
        assert self.prompt_logprobs is not None
        # A request recomputed after a preemption sends positions it sent before: keep the first copy.
        skip = len(self.prompt_logprobs) - lists.first_position
        if skip < 0:  # never expected: a gap would misalign every later position
            self.prompt_logprobs.extend([None] * -skip)
            skip = 0
        for ids, lps, rank in zip(lists.token_ids[skip:], lists.logprobs[skip:], lists.ranks[skip:]):
            self.prompt_logprobs.append(self._logprob_entry(ids, lps, rank))

    def _logprob_entry(self, ids: list[int], lps: list[float], rank: int) -> dict[int, Logprob]:
        """Column 0 is the token itself (its true rank), then the top-k (ranks 1, 2, ...)."""
        entry: dict[int, Logprob] = {}
        for position, (token, lp) in enumerate(zip(ids, lps)):
            if token in entry:
                continue
            entry[token] = Logprob(lp, rank if position == 0 else position, self._token_text(token))
        return entry

    @property
    def complete_prompt_logprobs(self) -> PromptLogprobs | None:
        lps = self.prompt_logprobs
        return lps if lps is not None and len(lps) >= len(self.prompt_token_ids) else None

    def _token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def completion_output(self) -> CompletionOutput | None:
        """What to report now for this sample, per the request's output kind; None: nothing new."""
        visible = len(self.text) if self.finished else max(self.sent_chars, len(self.text) - self.hold_back)
        if self.kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        if self.kind == RequestOutputKind.DELTA:
            text = self.text[self.sent_chars:visible]
            token_ids = self.token_ids[self.sent_tokens:]
            logprobs = self.logprobs[self.sent_logprobs:] if self.logprobs is not None else None
            if not text and not token_ids and not self.finished:
                return None
        else:
            text, token_ids, logprobs = self.text[:visible], list(self.token_ids), self.logprobs
        self.sent_chars, self.sent_tokens = visible, len(self.token_ids)
        self.sent_logprobs = len(self.logprobs) if self.logprobs is not None else 0
        return CompletionOutput(self.index, text, token_ids, self.cumulative_logprob,
                                list(logprobs) if logprobs is not None else None, self.finish_reason, self.stop_reason)

    def request_output(self, completion: CompletionOutput, finished: bool, outputs: list[CompletionOutput] | None = None) -> RequestOutput:
        metrics = {}
        if finished:
            metrics = {"arrival_time": self.arrival_time, "first_token_time": self.first_token_time or 0.0,
                       "finished_time": self.last_token_time or time.time()}
        return RequestOutput(self.external_id, self.prompt, self.prompt_token_ids, outputs or [completion], finished,
                             self.num_cached_tokens, self.kv_transfer_params, metrics,
                             self.complete_prompt_logprobs)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]  # core request ids finished here (stop strings): the core must drop them


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.children: dict[str, list[str]] = {}  # external id -> core request ids
        self.stats = IterationStats()

    def add_request(self, request: EngineCoreRequest, prompt: str | None, parent: ParentRequest | None = None,
                    index: int = 0) -> None:
        if request.request_id in self.states:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        state = RequestState(request, prompt, self.tokenizer, parent, index)
        self.states[request.request_id] = state
        self.children.setdefault(state.external_id, []).append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    def core_ids(self, external_ids: list[str]) -> list[str]:
        return [core for ext in external_ids for core in self.children.get(ext, [])]

    def abort_requests(self, external_ids: list[str]) -> list[str]:
        """Forget these requests; returns the core request ids to abort."""
        ids = self.core_ids(external_ids)
        for core_id in ids:
            self.states.pop(core_id, None)
        for ext in external_ids:
            self.children.pop(ext, None)
        return ids

    def take_stats(self) -> IterationStats:
        stats, self.stats = self.stats, IterationStats()
        return stats

    def process_outputs(self, outputs: list[EngineCoreOutput], now: float | None = None) -> ProcessedOutputs:
        now = time.time() if now is None else now
        results: list[RequestOutput] = []
        to_abort: list[str] = []
        for out in outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue  # aborted by the client while this output was in flight
            if state.update(out, now, self.stats):
                to_abort.append(out.request_id)
            if not out.new_token_ids and not state.finished:
                continue  # a prefill chunk's prompt logprobs: nothing to report yet
            completion = state.completion_output()
            if state.finished:
                self._forget(state)
            if completion is None:
                continue
            result = self._to_request_output(state, completion)
            if result is not None:
                results.append(result)
        return ProcessedOutputs(results, to_abort)

    def _forget(self, state: RequestState) -> None:
        del self.states[state.request_id]
        siblings = self.children.get(state.external_id, [])
        if state.request_id in siblings:
            siblings.remove(state.request_id)
        if not siblings:
            self.children.pop(state.external_id, None)

    def _to_request_output(self, state: RequestState, completion: CompletionOutput) -> RequestOutput | None:
        parent = state.parent
        if parent is None:
            return state.request_output(completion, state.finished)
        parent.latest[completion.index] = completion
        if state.finished:
            parent.num_finished += 1
        all_done = parent.num_finished == parent.n
        if parent.kind == RequestOutputKind.DELTA:
            return state.request_output(completion, all_done)
        if parent.kind == RequestOutputKind.FINAL_ONLY and not all_done:
            return None
        outputs = [parent.latest[i] for i in sorted(parent.latest)]
        return state.request_output(completion, all_done, outputs)
