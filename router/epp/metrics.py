"""The endpoint picker's Prometheus metrics, in a registry of its own.

The pool and objective series carry the names the Gateway API Inference Extension's own EPP
exposes (site-src/guides/metrics.md there), so its dashboards read a pdserve pool unchanged; the
`pdserve_epp_*` series are this picker's own.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    60.0)
SIZE_BUCKETS = (64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216)

# Outcomes of releasing a prefill hold no decode leg will pull (router/release.py's labels).
RELEASED, NOT_HELD, RELEASE_FAILED = "released", "not_held", "failed"


class EppMetrics:
    def __init__(self, pool_name: str) -> None:
        r = self.registry = CollectorRegistry()
        self.pool_name = pool_name
        objective = ["model_name", "target_model_name"]
        self.requests = Counter("inference_objective_request", "Requests the picker answered, per model.",
                                objective, registry=r)
        self.request_errors = Counter("inference_objective_request_error",
                                      "Requests the picker refused or could not place, per model and error code.",
                                      objective + ["error_code"], registry=r)
        self.duration = Histogram("inference_objective_request_duration_seconds",
                                  "Seconds the picker spent on a request (from its headers to its answer; the "
                                  "prefill leg included for P/D).", objective, buckets=DURATION_BUCKETS, registry=r)
        self.sizes = Histogram("inference_objective_request_sizes", "Request body sizes in bytes.", objective,
                               buckets=SIZE_BUCKETS, registry=r)
        self.ready_pods = Gauge("inference_pool_ready_pods", "Pool endpoints admitted by health checks.", ["name"],
                                registry=r)
        self.kv_cache = Gauge("inference_pool_average_kv_cache_utilization",
                              "Mean KV cache usage (0-1) over the pool's engines, from the coordinator feed.",
                              ["name"], registry=r)
        self.queue = Gauge("inference_pool_average_queue_size",
                           "Mean waiting requests over the pool's engines, from the coordinator feed.", ["name"],
                           registry=r)
        self.per_pod_queue = Gauge("inference_pool_per_pod_queue_size",
                                   "Waiting requests per engine (data-parallel ranks apart), from the feed.",
                                   ["name", "model_server_pod"], registry=r)
        self.picks = Counter("pdserve_epp_picks", "Requests sent to each endpoint as the primary destination.",
                             ["endpoint"], registry=r)
        self.prefill_legs = Counter("pdserve_epp_prefill_legs", "Prefill legs the picker ran, by endpoint.",
                                    ["endpoint"], registry=r)
        self.prefill_fallbacks = Counter("pdserve_epp_prefill_fallbacks",
                                         "P/D requests whose prefill leg failed (or found no prefill engine): "
                                         "the decode engine computes the prompt itself.", registry=r)
        self.stream_errors = Counter("pdserve_epp_stream_errors",
                                     "ext_proc streams ended with a gRPC error, by kind: protocol (a message out "
                                     "of order or unusable), internal (a bug; see the log).", ["kind"], registry=r)
        self.feed_alive = Gauge("pdserve_epp_coordinator_feed_alive",
                                "1 while the coordinator feed is fresh (picking on its counts).", registry=r)
        # Named kv_releases: router/release.py's HoldReleaser counts into it.
        self.kv_releases = Counter("pdserve_epp_kv_releases",
                                   "Prefill holds released because no decode leg will pull them, by outcome: "
                                   "released, not_held, failed.", ["outcome"], registry=r)
        for outcome in (RELEASED, NOT_HELD, RELEASE_FAILED):
            self.kv_releases.labels(outcome)
        for kind in ("protocol", "internal"):
            self.stream_errors.labels(kind)
        self.ready_pods.labels(pool_name).set(0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
