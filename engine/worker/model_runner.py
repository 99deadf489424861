"""Runs one scheduled step on the model: builds the flat batch, runs the forward, samples.

The runner keeps each request's tokens and blocks between steps, so the scheduler sends only
what changed. Within a step, requests with a single query token (decodes) come first: the
attention backends batch them together. A step's inputs are written into arrays allocated once
(step_inputs.StepInputs), and an all-greedy batch samples with a bare argmax.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from pdserve.engine.attention import torch_paged
from pdserve.engine.attention.metadata import AttentionMetadata
from pdserve.engine.config import EngineConfig
from pdserve.engine.core.kv_cache_manager import cdiv
from pdserve.engine.core.sched_output import ModelRunnerOutput, SchedulerOutput, StepTiming
from pdserve.engine.model.loader import load_model
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured_output.bitmask import GrammarMask
from pdserve.engine.worker.prompt_logprobs import PromptLogprobsJob, compute_prompt_logprobs, plan_job
from pdserve.engine.worker.sampler import SamplingMetadata, sample
from pdserve.engine.worker.kv_memory import CacheWarmer, zeroed_cache
from pdserve.engine.worker import decode_graphs
from pdserve.engine.worker.step_inputs import StepInputs
from pdserve.engine.distributed import tp_rank, tp_size
from pdserve.kvstore.base import KVConnectorRole
from pdserve.kvstore.factory import create_connector

log = logging.getLogger("pdserve.engine.runner")


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    # Vocabulary entries banned until min_tokens outputs exist (eos and stop tokens).
    min_tokens_banned: list[int] = field(default_factory=list)
    # Prompt logprobs still to compute: not when the request comes back after a preemption with
    # tokens generated (its whole prompt ran before it sampled, so they were all sent then).
    prompt_logprobs_due: bool = False

    @property
    def needs_sampler(self) -> bool:
        """Whether sampling this request takes more than an argmax of its logits."""
        p = self.params
        return (not p.greedy or p.logprobs is not None or bool(p.logit_bias) or bool(self.min_tokens_banned)
                or bool(p.presence_penalty) or bool(p.frequency_penalty) or p.repetition_penalty != 1.0)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class AttentionBackend:
    plan: Callable[[AttentionMetadata], Any]
    attend: Callable[..., torch.Tensor]
    write_kv: Callable[..., None]


def attention_backend(device: torch.device) -> AttentionBackend:
    if device.type == "cuda":
        from pdserve.engine.attention import triton_paged

        def attend_gpu(q, key_cache, value_cache, meta, scale, key=None, value=None):
            return triton_paged.paged_attention(q, key_cache, value_cache, meta, scale)

        return AttentionBackend(triton_paged.plan, attend_gpu, triton_paged.write_kv)
    from pdserve.engine.attention import cpu_attention, cpu_kernels

    if cpu_kernels.available():
        return AttentionBackend(cpu_attention.plan, cpu_attention.paged_attention, torch_paged.write_kv)
    return AttentionBackend(torch_paged.plan, torch_paged.paged_attention, torch_paged.write_kv)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device
        mc = config.model
        self.block_size = config.cache.block_size
        self.max_blocks_per_req = cdiv(mc.max_model_len, self.block_size)
        self.eos_token_ids = mc.eos_token_ids
        self.vocab_size = mc.vocab_size
        self.requests: dict[str, RequestState] = {}
        self.backend = attention_backend(device)
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.kv_warmer = CacheWarmer([])  # maps the cache's pages ahead of use (kv_memory.py)
        self.connector: Any = None  # the KV connector's worker side, when one is configured
        sched = config.scheduler
        self.inputs = StepInputs(max(sched.max_num_batched_tokens, sched.max_num_seqs), sched.max_num_seqs,
                                 self.max_blocks_per_req, device)
        # The sampling function; an attribute so a profiler can wrap it (pdserve.bench.step_profile).
        self.sample_fn = sample
        # Captured decode steps (CUDA), once the cache exists.
        self.decode_graphs: decode_graphs.DecodeGraphs | None = None

    # -- setup --------------------------------------------------------------------------------

    def load_model(self, progress: bool = False) -> None:
        self.model = load_model(self.config.model, self.device, progress=progress)

    def kv_bytes_per_block(self) -> int:
        attn = self.model.model.layers[0].self_attn  # type: ignore[union-attr]
        elem = torch.empty((), dtype=self.config.model.dtype).element_size()
        return 2 * self.config.model.num_hidden_layers * self.block_size * attn.num_kv_heads * attn.head_dim * elem

    def initialize_kv_cache(self, num_blocks: int) -> dict[str, Any] | None:
        """Allocate the cache; with a KV connector, hand it the tensors and return what it says."""
        attn = self.model.model.layers[0].self_attn  # type: ignore[union-attr]
        shape = (2, num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
        self.kv_caches = [zeroed_cache(shape, self.config.model.dtype, self.device)
                          for _ in range(self.config.model.num_hidden_layers)]
        self.kv_warmer = CacheWarmer(self.kv_caches)
        self.connector = create_connector(self.config, KVConnectorRole.WORKER, tp_rank())
        if self.connector is None:
            return None
        return self.connector.register_kv_caches(self.kv_caches)

    def capture_decode_graphs(self) -> None:
        """Capture decode steps as graphs where the device records them (decode_graphs.py), unless
        --enforce-eager; tensor-parallel ranks run eagerly (their all-reduces are not captured)."""
        new_graph = decode_graphs.graph_factory(self.device)
        if new_graph is None or self.config.enforce_eager or tp_size() != 1:
            return

        def forward(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
            hidden = self.model(input_ids, positions, self.kv_caches, meta,  # type: ignore[misc]
                                self.backend.attend, self.backend.write_kv)
            return self.model.compute_logits(hidden)  # type: ignore[union-attr]

        sched = self.config.scheduler
        graphs = decode_graphs.DecodeGraphs(forward, self.backend.plan, new_graph,
                                            decode_graphs.capture_sizes(sched.max_num_seqs), self.block_size,
                                            self.max_blocks_per_req, self.config.model.max_model_len, self.device)
        with torch.inference_mode():
            graphs.capture()
        self.decode_graphs = graphs if graphs.sizes else None

    # -- one step -----------------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            params = new.sampling_params
            generator = None
            if params.seed is not None and not params.greedy:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
            banned = []
            if params.min_tokens:
                banned = sorted(set(params.stop_token_ids or ()) | ({*self.eos_token_ids} if not params.ignore_eos else set()))
            self.requests[new.req_id] = RequestState(new.req_id, list(new.token_ids), new.num_prompt_tokens, params,
                                                     list(new.block_ids), new.num_computed_tokens, generator, banned,
                                                     prompt_logprobs_due=params.prompt_logprobs is not None
                                                     and len(new.token_ids) == new.num_prompt_tokens)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            state = self.requests[req_id]
            state.block_ids.extend(new_blocks)
            state.num_computed_tokens = num_computed

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        kv = self.connector
        if kv is None:
            return self._execute(so)
        # Loads run in the connector's threads while this step computes other requests.
        kv.bind_connector_metadata(so.kv_connector_metadata)
        kv.start_load_kv()
        output = self._execute(so)
        if so.total_num_scheduled_tokens:
            for layer, cache in enumerate(self.kv_caches):
                kv.save_kv_layer(layer, cache)
            kv.wait_for_save()
        output.finished_sending, output.finished_recving = kv.get_finished(so.finished_req_ids)
        output.failed_recving = kv.get_failed_loads()
        output.kv_stats = kv.take_stats()
        return output

    @torch.inference_mode()
    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        step_start = time.perf_counter()
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput({})
        num_sched = so.num_scheduled_tokens
        order = sorted(num_sched, key=lambda r: num_sched[r] != 1)  # decodes first, stable otherwise
        num_reqs, num_tokens = len(order), sum(num_sched.values())
        buf = self.inputs
        buf.reserve(num_tokens, num_reqs)
        query_lens, starts, ids = buf.query_lens[:num_reqs], buf.starts[:num_reqs], buf.input_ids
        sampling_rows: list[int] = []
        prompt_lp_rows: list[int] = []  # batch rows of requests that want prompt logprobs
        tok = 0  # where the next request's tokens go in input_ids
        for i, req_id in enumerate(order):
            state = self.requests[req_id]
            start, n = state.num_computed_tokens, num_sched[req_id]
            query_lens[i], starts[i] = n, start
            if n == 1:
                ids[tok] = state.token_ids[start]
            else:
                ids[tok:tok + n] = state.token_ids[start:start + n]
            tok += n
            buf.set_blocks(i, state, state.block_ids)
            if start + n >= len(state.token_ids):
                sampling_rows.append(i)
            if state.prompt_logprobs_due:
                prompt_lp_rows.append(i)
            state.num_computed_tokens = start + n

        cu = buf.cu[:num_reqs + 1]
        np.cumsum(query_lens, out=cu[1:])
        positions, slots = buf.positions[:num_tokens], buf.slots[:num_tokens]
        table, bs = buf.block_table, self.block_size
        if num_tokens == num_reqs:  # decodes only: one token per request, at its context length
            positions[:] = starts
            rows = buf.arange[:num_reqs]
        else:
            rows = np.repeat(buf.arange[:num_reqs], query_lens)
            np.subtract(buf.arange[:num_tokens], np.repeat(cu[:-1] - starts, query_lens), out=positions)
        np.multiply(table[rows, positions // bs], bs, out=slots)
        slots += positions % bs
        seq_lens = buf.seq_lens[:num_reqs]
        np.add(starts, query_lens, out=seq_lens, casting="unsafe")
        qsl = buf.query_start_loc[:num_reqs + 1]
        qsl[:] = cu
        num_decodes = int(np.count_nonzero(query_lens == 1))
        max_seq_len = int(seq_lens.max())
        max_blocks = cdiv(max_seq_len, bs)
        timing = StepTiming(num_reqs=num_reqs, num_tokens=num_tokens, num_decodes=num_decodes,
                            decode_context_tokens=int(seq_lens[:num_decodes].sum()))
        graphs = self.decode_graphs
        # A one-token chunk of a longer prompt is a row that does not sample: those steps run eagerly.
        replayable = (graphs is not None and num_decodes == num_tokens and len(sampling_rows) == num_reqs
                      and not prompt_lp_rows)
        size = graphs.size_for(num_reqs) if replayable else None
        prompt_logprobs: dict[str, Any] = {}
        if size is not None:  # decodes alone, each sampling: replay the captured step
            prepared = time.perf_counter()
            timing.prepare_s = prepared - step_start
            logits = graphs.run(num_reqs, size, buf.input_ids_t, buf.positions_t, buf.slots_t, buf.seq_lens_t,
                                table[:num_reqs, :max_blocks])
        else:
            meta = AttentionMetadata(
                num_reqs=num_reqs, num_decodes=num_decodes, num_tokens=num_tokens,
                max_query_len=int(query_lens.max()), max_seq_len=max_seq_len, block_size=bs,
                query_start_loc=buf.to_device(buf.query_start_loc_t, num_reqs + 1, "query_start_loc"),
                seq_lens=buf.to_device(buf.seq_lens_t, num_reqs, "seq_lens"),
                block_tables=buf.block_tables(num_reqs, max_blocks),
                slot_mapping=buf.to_device(buf.slots_t, num_tokens, "slots"),
                query_start_loc_np=cu, seq_lens_np=seq_lens, block_tables_np=table[:num_reqs, :max_blocks],
            )
            meta.backend_plan = self.backend.plan(meta)
            prepared = time.perf_counter()
            timing.prepare_s = prepared - step_start
            hidden = self.model(buf.to_device(buf.input_ids_t, num_tokens, "input_ids"),  # type: ignore[misc]
                                buf.to_device(buf.positions_t, num_tokens, "positions"),
                                self.kv_caches, meta, self.backend.attend, self.backend.write_kv)
            if prompt_lp_rows:
                prompt_logprobs = self._prompt_logprobs(hidden, [order[i] for i in prompt_lp_rows],
                                                        starts[prompt_lp_rows], query_lens[prompt_lp_rows],
                                                        cu[prompt_lp_rows])
            if not sampling_rows:
                timing.forward_s = self._synchronized_time() - prepared
                return ModelRunnerOutput({}, prompt_logprobs=prompt_logprobs, timing=timing)
            if len(sampling_rows) == num_tokens:  # every token is its request's last (a decode batch)
                last_hidden = hidden
            else:
                last_hidden = hidden[torch.from_numpy(cu[1:][sampling_rows] - 1).to(self.device)]
            logits = self.model.compute_logits(last_hidden)  # type: ignore[union-attr]
        forwarded = self._synchronized_time()
        timing.forward_s = forwarded - prepared
        states = [self.requests[order[i]] for i in sampling_rows]
        md = self._sampling_metadata(states)
        if so.grammar_bitmask is not None:  # structured outputs: the sampler masks the whole batch at once
            md.grammar_mask = GrammarMask.for_rows(so.grammar_bitmask, so.structured_output_request_ids,
                                                   [s.req_id for s in states])
        output = self._record(states, self.sample_fn(logits, md))
        timing.sample_s = time.perf_counter() - forwarded
        output.timing = timing
        output.prompt_logprobs = prompt_logprobs
        return output

    def _prompt_logprobs(self, hidden: torch.Tensor, req_ids: list[str], starts: np.ndarray, query_lens: np.ndarray,
                         first_rows: np.ndarray) -> dict[str, Any]:
        """Prompt logprobs of the positions this step computed, for the requests that want them."""
        jobs: list[PromptLogprobsJob] = []
        for req_id, start, n, row in zip(req_ids, starts.tolist(), query_lens.tolist(), first_rows.tolist()):
            state = self.requests[req_id]
            job = plan_job(req_id, state.token_ids, state.num_prompt_tokens, start, n, row,
                           state.params.prompt_logprobs or 0)
            if job is not None:
                jobs.append(job)
            if start + n >= state.num_prompt_tokens - 1:
                state.prompt_logprobs_due = False  # the rest of its positions predict generated tokens
        if not jobs:
            return {}
        return compute_prompt_logprobs(hidden, jobs, self.model.compute_logits,  # type: ignore[union-attr]
                                       self.vocab_size, driver=tp_rank() == 0)

    def _synchronized_time(self) -> float:
        # GPU kernels run asynchronously: wait for them, or the forward would look free.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _sampling_metadata(self, states: list[RequestState]) -> SamplingMetadata:
        if not any(s.needs_sampler for s in states):
            return SamplingMetadata(all_greedy=True)  # argmax only: no tensors to build
        dev = self.device
        params = [s.params for s in states]
        greedy = [p.greedy for p in params]
        md = SamplingMetadata(
            temperature=torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], dtype=torch.float32, device=dev),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=dev),
            all_greedy=all(greedy),
        )
        if not md.all_greedy:
            if any(p.top_k for p in params):
                md.top_k = torch.tensor([p.top_k or self.vocab_size for p in params], dtype=torch.long, device=dev)
            if any(p.top_p < 1.0 for p in params):
                md.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
            if any(p.min_p > 0.0 for p in params):
                md.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
            md.generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        if wanted:
            md.max_num_logprobs = max(wanted)
        if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params):
            md.output_token_ids = [s.output_token_ids for s in states]
            md.prompt_token_ids = [s.token_ids[:s.num_prompt_tokens] for s in states]
            md.presence_penalty = torch.tensor([p.presence_penalty for p in params], device=dev)
            md.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], device=dev)
            md.repetition_penalty = torch.tensor([p.repetition_penalty for p in params], device=dev)
        for i, s in enumerate(states):
            if s.min_tokens_banned and len(s.token_ids) - s.num_prompt_tokens < s.params.min_tokens:
                md.banned_token_ids[i] = s.min_tokens_banned
            if s.params.logit_bias:
                md.logit_bias[i] = {int(k): float(v) for k, v in s.params.logit_bias.items()}
        return md

    def _record(self, states: list[RequestState], result) -> ModelRunnerOutput:
        tokens = result.token_ids.tolist()
        sampled: dict[str, list[int]] = {}
        for state, token in zip(states, tokens):
            state.token_ids.append(token)
            sampled[state.req_id] = [token]
        logprobs: dict[str, tuple[list[list[int]], list[list[float]], list[int]]] = {}
        if result.logprobs is not None:
            ids, lps, ranks = result.logprob_token_ids.tolist(), result.logprobs.tolist(), result.ranks.tolist()
            for i, state in enumerate(states):
                k = state.params.logprobs
                if k is not None:
                    logprobs[state.req_id] = ([ids[i][:k + 1]], [lps[i][:k + 1]], [ranks[i]])
        return ModelRunnerOutput(sampled, logprobs)
