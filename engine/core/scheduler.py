"""Continuous batching: which requests run this step, with how many tokens each.

Running requests go first (mostly one decode token each), then waiting requests are admitted
while the token budget, the sequence limit and the KV pool allow. Long prompts are split into
chunks across steps. When blocks run out, the lowest-priority running request is preempted: its
blocks are freed and it is recomputed later, never dropped.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Iterable

from pdserve.engine.config import EngineConfig
from pdserve.engine.core.kv_cache_manager import KVCacheManager
from pdserve.engine.core.sched_output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from pdserve.engine.protocol import EngineCoreOutput, LogprobsLists, SchedulerStats
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    from pdserve.kvstore.base import KVConnectorBase

log = logging.getLogger("pdserve.engine.scheduler")


class WaitingQueue:
    """FCFS (a deque) or priority order (a heap on priority, then arrival)."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._tiebreak = itertools.count()

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._heap)

    def __iter__(self):
        return iter(self._fifo) if self.policy == "fcfs" else (e[3] for e in sorted(self._heap))

    def add(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._fifo.append(request)
        else:
            heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._tiebreak), request))

    def add_front(self, request: Request) -> None:
        """Put a preempted request back ahead of later arrivals."""
        if self.policy == "fcfs":
            self._fifo.appendleft(request)
        else:
            self.add(request)  # the heap order already puts it by its original arrival

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][3]

    def pop(self) -> Request:
        return self._fifo.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[3]

    def remove(self, requests: set[Request]) -> None:
        if self.policy == "fcfs":
            self._fifo = deque(r for r in self._fifo if r not in requests)
        else:
            self._heap = [e for e in self._heap if e[3] not in requests]
            heapq.heapify(self._heap)


class Scheduler:
    def __init__(self, config: EngineConfig, num_kv_blocks: int, connector: "KVConnectorBase | None" = None,
                 structured_output: StructuredOutputManager | None = None) -> None:
        self.config = config
        sc = config.scheduler
        self.max_num_seqs = sc.max_num_seqs
        self.max_num_batched_tokens = sc.max_num_batched_tokens
        self.long_prefill_token_threshold = sc.long_prefill_token_threshold
        self.enable_chunked_prefill = sc.enable_chunked_prefill
        self.policy = sc.policy
        self.max_model_len = config.model.max_model_len
        self.block_size = config.cache.block_size
        self.kv_cache_manager = KVCacheManager(num_kv_blocks, self.block_size, self.max_model_len,
                                               config.cache.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(self.policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # sent to the runner with the next step
        self.num_preemptions = 0
        self.kv_cache_mapped = 0.0  # set by the engine core, which maps the cache ahead (warm_kv_cache)
        self.step_counter = 0
        self.num_prompt_tokens = 0  # prompt tokens of admitted requests, cumulative
        self.num_generation_tokens = 0
        self.prompt_tokens_computed = 0  # prompt tokens run through the model, cumulative
        # Disaggregated prefill/decode: the connector moves KV; these track who waits on it.
        self.connector = connector
        self.waiting_for_kv: dict[str, tuple[Request, int]] = {}  # loading: (request, external tokens)
        self.held_for_send: dict[str, Request] = {}  # finished; blocks kept for a remote decode
        self.kv_external_tokens = 0
        self.kv_stats: Any = None  # the connector's cumulative transfer counters
        # Structured outputs: requests whose grammar compiles off the busy loop wait here (in
        # arrival order) and join `waiting` once it is done; they never hold up the queue.
        self.structured_output = structured_output or StructuredOutputManager(config.model)
        self.waiting_for_grammar: dict[str, Request] = {}
        self.model_eos_token_ids = set(config.model.eos_token_ids)  # a grammar's stop tokens
        # Requests finished by schedule() itself (a grammar that failed to compile): their
        # outputs go out with the step's.
        self._finished_outside_step: list[EngineCoreOutput] = []

    # -- requests in and out ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        if request.structured_output is not None:
            # Even a cached grammar goes through the wait: schedule() gives it its matcher.
            self.structured_output.start(request.structured_output)
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar[request.request_id] = request
        else:
            self.waiting.add(request)
        if self.connector is not None:  # e.g. keep the prefill's KV alive while this waits its turn
            self.connector.request_added(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (normally: abort) requests wherever they are; unknown ids are ignored."""
        found = [self.requests[i] for i in request_ids if i in self.requests]
        running = {r for r in found if r.status == RequestStatus.RUNNING}
        if running:
            self.running = [r for r in self.running if r not in running]
        waiting = set(found) - running
        if waiting:
            self.waiting.remove(waiting)
        for request in found:
            self.waiting_for_grammar.pop(request.request_id, None)
            request.structured_output = None
            request.status = status
            if request.request_id in self.waiting_for_kv:
                # A load may be writing into its blocks: they are freed once it ends.
                self.connector.request_finished(request, [])  # type: ignore[union-attr]
                self.finished_req_ids.add(request.request_id)
                del self.requests[request.request_id]
            else:
                self._free_request(request)
        return found

    def _free_request(self, request: Request) -> dict[str, Any] | None:
        """Release a finished request; returns the connector's kv_transfer_params for its output."""
        request.structured_output = None
        delay, params = False, None
        if self.connector is not None:
            delay, params = self.connector.request_finished(
                request, self.kv_cache_manager.get_block_ids(request.request_id))
        if delay:
            self.held_for_send[request.request_id] = request
        else:
            self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        return params

    @property
    def has_unfinished_requests(self) -> bool:
        return (bool(self.running) or len(self.waiting) > 0 or bool(self.waiting_for_kv)
                or bool(self.waiting_for_grammar))

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.waiting_for_kv) + len(self.waiting_for_grammar)

    @property
    def has_ready_requests(self) -> bool:
        """Something a step can act on: false while every request left waits for its grammar."""
        return bool(self.running) or len(self.waiting) > 0 or bool(self.waiting_for_kv) or any(
            r.structured_output and r.structured_output.compiled for r in self.waiting_for_grammar.values())

    @property
    def has_kv_transfers(self) -> bool:
        """Workers must keep stepping (even with nothing to compute) to report these."""
        return bool(self.waiting_for_kv) or bool(self.held_for_send)

    # -- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self.waiting_for_grammar:
            self._take_compiled_grammars()
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[Request] = []
        new_block_ids: dict[str, list[int]] = {}
        preempted: list[Request] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._num_tokens_to_schedule(request, budget)
            if num_new == 0:
                index += 1
                continue
            while True:
                blocks = self.kv_cache_manager.allocate_slots(request, num_new)
                if blocks is not None:
                    break
                victim = self._pick_victim()
                self.running.remove(victim)
                if victim.request_id in num_scheduled:  # only possible under the priority policy
                    budget += num_scheduled.pop(victim.request_id)
                    new_block_ids.pop(victim.request_id, None)
                    index -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if blocks is None:
                continue  # the request itself was preempted; `index` already points past it
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            new_block_ids[request.request_id] = [b.block_id for b in blocks]
            index += 1

        if not preempted:
            self._admit_waiting(budget, num_scheduled, new_reqs)

        return self._build_output(num_scheduled, new_reqs, new_block_ids)

    def _take_compiled_grammars(self) -> None:
        """Requests whose grammar is compiled join the waiting queue; a failed compile finishes
        its request (aborted, with the reason), never the engine."""
        compiled = [r for r in self.waiting_for_grammar.values() if r.structured_output and r.structured_output.compiled]
        for request in compiled:
            del self.waiting_for_grammar[request.request_id]
            state = request.structured_output
            assert state is not None
            if self.structured_output.activate(state):
                request.status = RequestStatus.WAITING
                self.waiting.add(request)
                continue
            log.warning("request %s: its %s grammar does not compile: %s", request.request_id, state.params.kind,
                        state.error)
            request.status = RequestStatus.FINISHED_ABORTED
            request.stop_reason = f"grammar_error: {state.error}"
            kv_params = self._free_request(request)
            self._finished_outside_step.append(EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[], finish_reason=request.status.finish_reason,
                stop_reason=request.stop_reason, kv_transfer_params=kv_params))

    def take_finished_outside_step(self) -> list[EngineCoreOutput]:
        outputs, self._finished_outside_step = self._finished_outside_step, []
        return outputs

    def _num_tokens_to_schedule(self, request: Request, budget: int) -> int:
        num_new = request.num_tokens - request.num_computed_tokens
        if 0 < self.long_prefill_token_threshold < num_new:
            num_new = self.long_prefill_token_threshold
        return max(0, min(num_new, budget, self.max_model_len - request.num_computed_tokens))

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        # A victim scheduled earlier in this step had its new blocks hashed at allocation, but
        # num_computed_tokens only advances in _build_output: blocks past it hold no KV yet.
        self.kv_cache_manager.free(request, request.num_computed_tokens)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.finished_req_ids.add(request.request_id)  # the runner drops it; it comes back whole
        self.waiting.add_front(request)

    def _admit_waiting(self, budget: int, num_scheduled: dict[str, int], new_reqs: list[Request]) -> None:
        while len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            hit_blocks, num_hit_tokens = [], 0
            resumed = request.num_computed_tokens > 0  # its KV arrived through the connector
            if not resumed:
                hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
                # Prompt logprobs need every prompt position computed here: no external KV either.
                if self.connector is not None and not request.kv_load_failed \
                        and request.sampling_params.prompt_logprobs is None:
                    num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
                    if num_external > 0 and load_async:
                        if not self._start_remote_load(request, num_hit_tokens, hit_blocks, num_external):
                            break
                        continue
            computed = request.num_computed_tokens if resumed else num_hit_tokens
            num_new = request.num_tokens - computed
            if 0 < self.long_prefill_token_threshold < num_new:
                num_new = self.long_prefill_token_threshold
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            blocks = self.kv_cache_manager.allocate_slots(request, num_new, num_hit_tokens, hit_blocks)
            if blocks is None:
                break
            self.waiting.pop()
            if request.num_cached_tokens < 0:  # first admission, not a resume after preemption
                request.num_cached_tokens = num_hit_tokens
                self.num_prompt_tokens += request.num_prompt_tokens
            request.num_computed_tokens = computed
            if self.connector is not None:
                self.connector.update_state_after_alloc(request, self.kv_cache_manager.get_block_ids(
                    request.request_id), 0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            new_reqs.append(request)
            budget -= num_new

    def _start_remote_load(self, request: Request, num_hit_tokens: int, hit_blocks: list, num_external: int) -> bool:
        """Allocate the blocks the connector will fill and park the request until they are full.
        False when the pool has no room (the request stays first in line)."""
        blocks = self.kv_cache_manager.allocate_slots(request, num_external, num_hit_tokens, hit_blocks,
                                                      delay_cache_blocks=True)
        if blocks is None:
            return False
        self.waiting.pop()
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting_for_kv[request.request_id] = (request, num_external)
        self.connector.update_state_after_alloc(  # type: ignore[union-attr]
            request, self.kv_cache_manager.get_block_ids(request.request_id), num_external)
        return True

    def _finish_remote_load(self, request_id: str, failed: bool) -> None:
        request, num_external = self.waiting_for_kv.pop(request_id, (None, 0))
        if request is None:
            return
        if request.is_finished:  # aborted while its KV was arriving
            self.kv_cache_manager.free(request)
            return
        if failed:
            # Back to a fresh request: it is admitted again and computes what it lacks.
            self.kv_cache_manager.free(request)
            request.num_computed_tokens = 0
            request.kv_load_failed = True
        else:
            request.num_computed_tokens += num_external
            if self.kv_cache_manager.enable_caching:
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            request.num_cached_tokens = request.num_computed_tokens
            self.num_prompt_tokens += request.num_prompt_tokens
            self.kv_external_tokens += num_external
        request.status = RequestStatus.WAITING
        self.waiting.add_front(request)

    def _update_kv_transfers(self, runner_output: ModelRunnerOutput) -> None:
        failed = runner_output.failed_recving or set()
        for request_id in runner_output.finished_recving or ():
            self._finish_remote_load(request_id, request_id in failed)
        for request_id in runner_output.finished_sending or ():
            request = self.held_for_send.pop(request_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)
        if runner_output.kv_stats is not None:
            if self.kv_stats is None:
                self.kv_stats = runner_output.kv_stats
            else:
                self.kv_stats.add(runner_output.kv_stats)

    def _build_output(self, num_scheduled: dict[str, int], new_reqs: list[Request],
                      new_block_ids: dict[str, list[int]]) -> SchedulerOutput:
        new_data = [
            NewRequestData(
                req_id=r.request_id,
                token_ids=list(r.all_token_ids),
                num_prompt_tokens=r.num_prompt_tokens,
                sampling_params=r.sampling_params,
                block_ids=self.kv_cache_manager.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
            )
            for r in new_reqs
        ]
        new_ids = {r.request_id for r in new_reqs}
        cached = CachedRequestData()
        for req_id in num_scheduled:
            if req_id in new_ids:
                continue
            cached.req_ids.append(req_id)
            cached.new_block_ids.append(new_block_ids.get(req_id, []))
            cached.num_computed_tokens.append(self.requests[req_id].num_computed_tokens)
        output = SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            # The runner drops these before adding the new requests, so a resumed id is safe.
            finished_req_ids=self.finished_req_ids,
        )
        self.finished_req_ids = set()
        output.grammar_bitmask, output.structured_output_request_ids = self._grammar_bitmask(num_scheduled)
        # Advance progress now: the tokens' KV is written by the step this output describes.
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            if request.num_computed_tokens < request.num_prompt_tokens:
                self.prompt_tokens_computed += min(n, request.num_prompt_tokens - request.num_computed_tokens)
            request.num_computed_tokens += n
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        self.step_counter += 1
        return output

    def _grammar_bitmask(self, num_scheduled: dict[str, int]) -> tuple[Any, list[str]]:
        """One bitmask row per request that samples this step under a grammar (a decode, or the
        last chunk of a prefill); (None, []) when there is none."""
        ids, states = [], []
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            state = request.structured_output
            samples = request.num_computed_tokens + n >= request.num_tokens
            if samples and state is not None and state.matcher is not None:
                ids.append(req_id)
                states.append(state)
        if not states:
            return None, []
        return self.structured_output.fill_bitmask(states), ids

    def update_from_output(self, sched_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = self.take_finished_outside_step()
        stopped: list[Request] = []
        if self.connector is not None:
            self._update_kv_transfers(runner_output)
        for req_id in sched_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            new_tokens = runner_output.sampled_token_ids.get(req_id)
            prompt_logprobs = runner_output.prompt_logprobs.get(req_id)
            if request is None or not new_tokens or request.is_finished:
                if prompt_logprobs is not None and request is not None and not request.is_finished:
                    outputs.append(EngineCoreOutput(req_id, [], prompt_logprobs=prompt_logprobs))
                continue  # aborted meanwhile, or a prefill chunk that produced no token
            kept: list[int] = []
            for token in new_tokens:
                request.append_output_token_ids([token])
                kept.append(token)
                if self._advance_grammar(request, token) or self._check_stop(request):
                    break
            self.num_generation_tokens += len(kept)
            # Blocks filled by the tokens just appended are complete: index them for reuse.
            if self.kv_cache_manager.enable_caching:
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            logprobs = None
            if req_id in runner_output.logprobs:
                ids, lps, ranks = runner_output.logprobs[req_id]
                logprobs = LogprobsLists(ids[:len(kept)], lps[:len(kept)], ranks[:len(kept)])
            kv_params = None
            if request.is_finished:
                stopped.append(request)
                kv_params = self._free_request(request)
            outputs.append(EngineCoreOutput(
                request_id=req_id,
                new_token_ids=kept,
                new_logprobs=logprobs,
                finish_reason=request.status.finish_reason,
                stop_reason=request.stop_reason,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                kv_transfer_params=kv_params,
                prompt_logprobs=prompt_logprobs,
            ))
        if stopped:
            gone = set(stopped)
            self.running = [r for r in self.running if r not in gone]
        return outputs

    def _advance_grammar(self, request: Request, token: int) -> bool:
        """Feed the token to the request's grammar; True when that finishes the request."""
        state = request.structured_output
        if state is None or state.matcher is None:
            return False
        if not state.accept(token):
            # The bitmask should make this impossible: end the request, never the engine.
            log.error("request %s: sampled token %d, which its %s grammar rejects; finishing it", request.request_id,
                      token, state.params.kind)
            request.status = RequestStatus.FINISHED_ABORTED
            request.stop_reason = f"grammar_error: token {token} does not match the grammar"
            return True
        if state.terminated:  # one of the model's EOS tokens completed the grammar
            request.status = RequestStatus.FINISHED_STOPPED
            if token != request.eos_token_id and token not in self.model_eos_token_ids:
                request.stop_reason = token
            return True
        return False

    def _check_stop(self, request: Request) -> bool:
        params = request.sampling_params
        token = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if token in request.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token
                return True
        if request.num_tokens >= self.max_model_len or (
                request.max_tokens is not None and request.num_output_tokens >= request.max_tokens):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    # -- introspection ------------------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.waiting_for_grammar),
            kv_cache_usage=kv.usage,
            kv_cache_mapped=self.kv_cache_mapped,
            kv_blocks_total=kv.num_blocks,
            kv_blocks_free=kv.pool.num_free_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            step_counter=self.step_counter,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            prompt_tokens_computed=self.prompt_tokens_computed,
            **(self._kv_transfer_stats() if self.connector is not None else {}),
        )

    def _kv_transfer_stats(self) -> dict[str, Any]:
        held = sum(len(self.kv_cache_manager.get_block_ids(r)) for r in self.held_for_send)
        stats = dict(num_waiting_for_remote_kvs=len(self.waiting_for_kv), kv_blocks_held_for_remote=held,
                     kv_external_tokens=self.kv_external_tokens)
        s = self.kv_stats
        if s is not None:
            stats.update(kv_transfers=s.transfers, kv_transfer_bytes=s.bytes, kv_transfer_seconds=s.seconds,
                         kv_transfer_failures=s.failures, kv_transfers_expired=s.expired,
                         kv_lease_renewal_failures=s.lease_renewal_failures)
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()
