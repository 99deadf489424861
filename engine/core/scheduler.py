"""Continuous batching: which requests run this step, with how many tokens each.

Running requests go first (mostly one decode token each), then waiting requests are admitted
while the token budget, the sequence limit and the KV pool allow. Long prompts are split into
chunks across steps. When blocks run out, the lowest-priority running request is preempted: its
blocks are freed and it is recomputed later, never dropped.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Iterable

from pdserve.engine.config import EngineConfig
from pdserve.engine.core.kv_cache_manager import KVCacheManager
from pdserve.engine.core.sched_output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from pdserve.engine.protocol import EngineCoreOutput, LogprobsLists, SchedulerStats
from pdserve.engine.request import Request, RequestStatus


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
    def __init__(self, config: EngineConfig, num_kv_blocks: int) -> None:
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
        self.step_counter = 0
        self.num_prompt_tokens = 0  # prompt tokens of admitted requests, cumulative
        self.num_generation_tokens = 0

    # -- requests in and out ------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.add(request)

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
            request.status = status
            self._free_request(request)
        return found

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    # -- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
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
        self.kv_cache_manager.free(request)
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
            if request.num_computed_tokens == 0:
                hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit_tokens
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
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_scheduled[request.request_id] = num_new
            new_reqs.append(request)
            budget -= num_new

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
        # Advance progress now: the tokens' KV is written by the step this output describes.
        for req_id, n in num_scheduled.items():
            self.requests[req_id].num_computed_tokens += n
        self.step_counter += 1
        return output

    def update_from_output(self, sched_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        for req_id in sched_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            new_tokens = runner_output.sampled_token_ids.get(req_id)
            if request is None or not new_tokens or request.is_finished:
                continue  # aborted meanwhile, or a prefill chunk that produced no token
            kept: list[int] = []
            for token in new_tokens:
                request.append_output_token_ids([token])
                kept.append(token)
                if self._check_stop(request):
                    break
            self.num_generation_tokens += len(kept)
            # Blocks filled by the tokens just appended are complete: index them for reuse.
            if self.kv_cache_manager.enable_caching:
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            logprobs = None
            if req_id in runner_output.logprobs:
                ids, lps, ranks = runner_output.logprobs[req_id]
                logprobs = LogprobsLists(ids[:len(kept)], lps[:len(kept)], ranks[:len(kept)])
            outputs.append(EngineCoreOutput(
                request_id=req_id,
                new_token_ids=kept,
                new_logprobs=logprobs,
                finish_reason=request.status.finish_reason,
                stop_reason=request.stop_reason,
                num_cached_tokens=max(request.num_cached_tokens, 0),
            ))
            if request.is_finished:
                stopped.append(request)
        if stopped:
            gone = set(stopped)
            self.running = [r for r in self.running if r not in gone]
            for request in stopped:
                self._free_request(request)
        return outputs

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
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            kv_blocks_total=kv.num_blocks,
            kv_blocks_free=kv.pool.num_free_blocks,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            step_counter=self.step_counter,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()
