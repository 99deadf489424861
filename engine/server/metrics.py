"""Prometheus metrics with vLLM's names, so existing dashboards and autoscalers work unchanged.

Each app gets its own registry (several servers may live in one test process). Gauges follow the
latest scheduler stats; counters advance by the difference of the core's cumulative counters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from pdserve.engine.core.liveness import RankLiveness
from pdserve.engine.frontend.output_processor import IterationStats
from pdserve.engine.protocol import SchedulerStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


@dataclass(frozen=True)
class CacheInfo:
    """One rank's KV-cache settings, for `vllm:cache_config_info` (labels as vLLM names them, values
    as vLLM writes them: Python's str of each; gateways' pickers read block_size and num_gpu_blocks)."""

    block_size: int
    num_gpu_blocks: int  # the blocks this rank measured (or was given): its KV capacity
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    # pdserve keeps the KV cache in the model's dtype, which is what vLLM's "auto" means.
    cache_dtype: str = "auto"

    def labels(self, rank: int) -> dict[str, str]:
        return {"block_size": str(self.block_size), "num_gpu_blocks": str(self.num_gpu_blocks),
                "num_gpu_blocks_override": str(self.num_gpu_blocks_override), "cache_dtype": self.cache_dtype,
                "enable_prefix_caching": str(self.enable_prefix_caching),
                "gpu_memory_utilization": str(self.gpu_memory_utilization),
                "kv_cache_memory_bytes": str(self.kv_cache_memory_bytes), "engine": str(rank)}


def cache_infos(engine: Any) -> list[CacheInfo]:
    """Each data-parallel rank's CacheInfo, read from a started AsyncLLM (every core has reported
    its block count by then). getattr: the HTTP tests' stand-in engine carries only part of a config."""
    config = engine.config
    cache = config.cache
    size = getattr(getattr(config, "parallel", None), "data_parallel_size", 1)
    client = getattr(engine, "client", None)
    ranks = getattr(client, "clients", None) if size > 1 else None
    blocks = ([c.config.num_kv_blocks for c in ranks] if ranks
              else [getattr(config, "num_kv_blocks", 0)] * size)
    return [CacheInfo(block_size=cache.block_size, num_gpu_blocks=n,
                      num_gpu_blocks_override=getattr(cache, "num_kv_blocks", None),
                      enable_prefix_caching=getattr(cache, "enable_prefix_caching", True),
                      gpu_memory_utilization=getattr(cache, "gpu_memory_utilization", 0.9),
                      kv_cache_memory_bytes=getattr(cache, "kv_cache_memory_bytes", None)) for n in blocks]


class _RankView:
    """The registry as one data-parallel rank's port shows it: series of other ranks (another
    `engine` label) left out; series without the label (the pod's own) kept."""

    def __init__(self, registry: CollectorRegistry, rank: int) -> None:
        self.registry = registry
        self.rank = str(rank)

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            view = Metric(family.name, family.documentation, family.type, family.unit)
            view.samples = [s for s in family.samples if s.labels.get("engine", self.rank) == self.rank]
            yield view


class EngineMetrics:
    def __init__(self, model_name: str, cache: list[CacheInfo] | None = None) -> None:
        self.registry = CollectorRegistry()
        # `engine` is the data-parallel rank (engine core index) the numbers come from, as in vLLM.
        labels = ["model_name", "engine"]
        r = self.registry
        self.running = Gauge("vllm:num_requests_running", "Requests in model execution batches.", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", labels, registry=r)
        self.kv_mapped = Gauge("pdserve:kv_cache_mapped_ratio",
                               "Fraction of the KV cache's memory mapped ahead of first use (an idle CPU engine maps "
                               "it; until then first writes page-fault). 1 when all is, or no more will be.", labels,
                               registry=r)
        self.cache_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", labels, registry=r)
        self.cache_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed.", labels, registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative preemptions.", labels, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token in seconds.", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", labels,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", labels,
                             buckets=E2E_BUCKETS, registry=r)
        self.success = Counter("vllm:request_success", "Successfully finished requests.", labels + ["finished_reason"],
                               registry=r)
        # Disaggregated prefill/decode (stay at zero without a KV connector).
        self.waiting_for_kv = Gauge("pdserve:num_requests_waiting_for_remote_kvs",
                                    "Requests waiting for their KV cache to arrive from another engine.", labels,
                                    registry=r)
        self.kv_held = Gauge("pdserve:kv_blocks_held_for_remote",
                             "KV blocks of finished prefills kept until a decode engine pulls them.", labels, registry=r)
        self.prompt_computed = Counter("pdserve:prompt_tokens_computed", "Prompt tokens run through the model here.",
                                       labels, registry=r)
        self.kv_external = Counter("pdserve:kv_external_tokens", "Prompt tokens whose KV was loaded from elsewhere.",
                                   labels, registry=r)
        self.kv_transfers = Counter("pdserve:kv_transfers", "KV transfers completed (loads and remote reads).",
                                    labels, registry=r)
        self.kv_bytes = Counter("pdserve:kv_transfer_bytes", "Bytes of KV moved in or out.", labels, registry=r)
        self.kv_seconds = Counter("pdserve:kv_transfer_seconds", "Seconds spent loading KV.", labels, registry=r)
        self.kv_failures = Counter("pdserve:kv_transfer_failures", "KV transfers or saves that failed.", labels,
                                   registry=r)
        self.kv_expired = Counter("pdserve:kv_transfers_expired",
                                  "Held prefill blocks freed when their lease ran out, never pulled.", labels,
                                  registry=r)
        self.kv_lease_failures = Counter("pdserve:kv_lease_renewal_failures",
                                         "Renewals of a prefill engine's hold on KV this decode engine will pull "
                                         "that failed (the prefill unreachable, or the hold already gone).", labels,
                                         registry=r)
        # Lock-step data parallelism (absent otherwise).
        self.dp_wave = Gauge("pdserve:dp_wave", "The engine core's current lock-step wave.", labels, registry=r)
        self.dp_steps = Counter("pdserve:dp_lockstep_steps", "Steps run inside lock-step waves, dummy ones included.",
                                labels, registry=r)
        self.dp_dummy_steps = Counter("pdserve:dp_dummy_steps",
                                      "Dummy steps an idle engine core ran to keep pace with busy ones.", labels,
                                      registry=r)
        self.dp_step_seconds = Counter("pdserve:dp_lockstep_step_seconds", "Seconds of steps inside lock-step waves.",
                                       labels, registry=r)
        self.dp_dummy_seconds = Counter("pdserve:dp_dummy_step_seconds", "Seconds of dummy steps.", labels, registry=r)
        # Liveness (engine/core/liveness.py), read from the cores' heartbeats at each scrape.
        self.unresponsive = Gauge("pdserve:engine_unresponsive",
                                  "1 while the engine core is stopped or its step overran --step-timeout.", labels,
                                  registry=r)
        self.step_age = Gauge("pdserve:engine_step_running_seconds",
                              "How long the engine core's current step has been running; 0 between steps.", labels,
                              registry=r)
        # What gateways' endpoint pickers read (the GIE model-server protocol), as vLLM has them.
        # An info metric as a gauge fixed at 1, one series per rank, as vLLM's (no model_name label).
        cache = cache or []
        if cache:
            self.cache_info = Gauge("vllm:cache_config_info", "Information of the engine's KV-cache config.",
                                    list(cache[0].labels(0)), registry=r)
            for rank, info in enumerate(cache):
                self.cache_info.labels(**info.labels(rank)).set(1)
        # pdserve serves no LoRA adapters: both lists stay empty and max_lora is 0. The value is
        # when the series was last updated, as in vLLM, where pickers take the newest series.
        self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on LoRA requests.",
                               ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)
        self._lora = self.lora_info.labels(max_lora="0", waiting_lora_adapters="", running_lora_adapters="")
        self._lora.set(time.time())
        # Present from start-up, before the first step reports: a picker that finds no queue
        # gauge marks the engine as failing to scrape, and an idle engine's queue is empty.
        for rank in range(max(1, len(cache))):
            for gauge in (self.running, self.waiting, self.kv_usage):
                gauge.labels(model_name, str(rank)).set(0)
        self._liveness_probe: Callable[[], list[RankLiveness]] | None = None
        self.model = model_name
        self._last: dict[int, SchedulerStats] = {}

    def watch_liveness(self, probe: Callable[[], list[RankLiveness]]) -> None:
        """Read the cores' liveness from `probe` at every render (called on the server's event loop)."""
        self._liveness_probe = probe

    def _update_liveness(self) -> None:
        if self._liveness_probe is None:
            return
        for rank in self._liveness_probe():
            m = (self.model, str(rank.rank))
            self.unresponsive.labels(*m).set(1 if rank.unresponsive else 0)
            self.step_age.labels(*m).set(rank.step_running_s)

    def observe(self, stats: SchedulerStats | None, iteration: IterationStats, engine_index: int = 0) -> None:
        m = (self.model, str(engine_index))
        if stats is not None:
            self._lora.set(time.time())
            self.running.labels(*m).set(stats.num_running_reqs)
            self.waiting.labels(*m).set(stats.num_waiting_reqs)
            self.kv_usage.labels(*m).set(stats.kv_cache_usage)
            self.kv_mapped.labels(*m).set(stats.kv_cache_mapped)
            self.waiting_for_kv.labels(*m).set(stats.num_waiting_for_remote_kvs)
            self.kv_held.labels(*m).set(stats.kv_blocks_held_for_remote)
            last = self._last.get(engine_index) or SchedulerStats()
            for counter, now, before in (
                (self.cache_queries, stats.prefix_cache_queries, last.prefix_cache_queries),
                (self.cache_hits, stats.prefix_cache_hits, last.prefix_cache_hits),
                (self.prompt_tokens, stats.num_prompt_tokens, last.num_prompt_tokens),
                (self.generation_tokens, stats.num_generation_tokens, last.num_generation_tokens),
                (self.preemptions, stats.num_preemptions, last.num_preemptions),
                (self.prompt_computed, stats.prompt_tokens_computed, last.prompt_tokens_computed),
                (self.kv_external, stats.kv_external_tokens, last.kv_external_tokens),
                (self.kv_transfers, stats.kv_transfers, last.kv_transfers),
                (self.kv_bytes, stats.kv_transfer_bytes, last.kv_transfer_bytes),
                (self.kv_seconds, stats.kv_transfer_seconds, last.kv_transfer_seconds),
                (self.kv_failures, stats.kv_transfer_failures, last.kv_transfer_failures),
                (self.kv_expired, stats.kv_transfers_expired, last.kv_transfers_expired),
                (self.kv_lease_failures, stats.kv_lease_renewal_failures, last.kv_lease_renewal_failures),
                (self.dp_steps, stats.dp_steps, last.dp_steps),
                (self.dp_dummy_steps, stats.dp_dummy_steps, last.dp_dummy_steps),
                (self.dp_step_seconds, stats.dp_step_seconds, last.dp_step_seconds),
                (self.dp_dummy_seconds, stats.dp_dummy_seconds, last.dp_dummy_seconds),
            ):
                if now > before:
                    counter.labels(*m).inc(now - before)
            if stats.dp_steps:
                self.dp_wave.labels(*m).set(stats.dp_wave)
            self._last[engine_index] = stats
        for value in iteration.time_to_first_token:
            self.ttft.labels(*m).observe(value)
        for value in iteration.inter_token_latency:
            self.itl.labels(*m).observe(value)
        for value in iteration.e2e_latency:
            self.e2e.labels(*m).observe(value)
        for reason in iteration.finished_reasons:
            self.success.labels(*m, reason).inc()

    def render(self, rank: int | None = None) -> bytes:
        """The exposition text: every rank's series, or with `rank` only that rank's (its own port)."""
        self._update_liveness()
        return generate_latest(self.registry if rank is None else _RankView(self.registry, rank))
