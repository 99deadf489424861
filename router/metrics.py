"""The router's Prometheus metrics (`pdserve_router_*`), in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LEG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
               300.0, 600.0)

# P/D decisions
DISAGGREGATED = "disaggregated"
LOCAL_ONLY = "local_only"
PREFILL_FAILED = "prefill_failed"
# n>1 (or best_of>1): the decode engine computes such a prompt itself and never pulls, so a prefill
# leg would only pin blocks on the prefill engine until they expire.
LOCAL_MULTI_CHOICE = "local_multi_choice"
# The prompt's own logprobs were asked for (completions' echo + logprobs, or prompt_logprobs): only
# the engine that runs the prompt through the model has them, so one engine serves it all.
LOCAL_PROMPT_LOGPROBS = "local_prompt_logprobs"
# --pd-only-when-busy: a decode engine had nothing in flight, so it computed the prompt itself
# rather than wait for a prefill hop that would spare no running decode.
LOCAL_DECODE_IDLE = "local_decode_idle"

# Outcomes of releasing a prefill hold the decode leg will not pull
RELEASED = "released"      # the prefill engine freed the blocks
NOT_HELD = "not_held"      # it held nothing under those params any more (pulled, expired, unknown)
RELEASE_FAILED = "failed"  # no answer, or an error: the blocks expire by their lease

# Outcomes of a stream that broke after its first byte
RESUMED = "resumed"        # continued on another decode engine
NOT_RESUMED = "failed"     # ended with an SSE error (migrations exhausted, no engine, or not resumable)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdserve_router_requests", "Requests received, by API route.", ["route"], registry=r)
        self.errors = Counter("pdserve_router_errors", "Requests that ended in an error, by kind.", ["kind"],
                              registry=r)
        self.pd_decisions = Counter("pdserve_router_pd_decisions",
                                    "How requests were served: disaggregated, local_only (decode pool alone), "
                                    "local_multi_choice (n>1: decode pool alone, nothing to pull), "
                                    "local_prompt_logprobs (the prompt's logprobs asked for: decode pool alone), "
                                    "local_decode_idle (--pd-only-when-busy: a decode engine was idle), "
                                    "or prefill_failed (fell back to the decode pool).", ["decision"], registry=r)
        self.retries = Counter("pdserve_router_retries", "Legs retried on another engine.", ["pool"], registry=r)
        self.picks = Counter("pdserve_router_endpoint_picks", "Legs sent to each endpoint.", ["pool", "endpoint"],
                             registry=r)
        self.leg_seconds = Histogram("pdserve_router_leg_seconds",
                                     "Seconds per leg: prefill (until its answer), decode (until the last byte).",
                                     ["leg"], buckets=LEG_BUCKETS, registry=r)
        self.in_flight = Gauge("pdserve_router_in_flight", "Open legs per endpoint.", ["pool", "endpoint"],
                               registry=r)
        self.healthy = Gauge("pdserve_router_endpoint_healthy", "1 if the endpoint is admitted, 0 if ejected.",
                             ["pool", "endpoint"], registry=r)
        self.feed_alive = Gauge("pdserve_router_coordinator_feed_alive",
                                "1 while the coordinator feed is fresh (balancing on its counts).", registry=r)
        self.kv_releases = Counter("pdserve_router_kv_releases",
                                   "Prefill holds released because the decode leg would not pull them, by "
                                   "outcome: released, not_held, failed.", ["outcome"], registry=r)
        self.migrations = Counter("pdserve_router_migrations",
                                  "Streams that broke after their first byte, by outcome: resumed (continued on "
                                  "another decode engine) or failed (ended with an SSE error).", ["outcome"],
                                  registry=r)
        self.legs_interrupted = Counter("pdserve_router_legs_interrupted",
                                        "Legs cut short, by leg and cause: timeout (a time bound) or ejected "
                                        "(their endpoint was ejected while they waited).", ["leg", "cause"],
                                        registry=r)
        for decision in (DISAGGREGATED, LOCAL_ONLY, LOCAL_MULTI_CHOICE, LOCAL_PROMPT_LOGPROBS, LOCAL_DECODE_IDLE,
                         PREFILL_FAILED):
            self.pd_decisions.labels(decision)
        for outcome in (RELEASED, NOT_HELD, RELEASE_FAILED):
            self.kv_releases.labels(outcome)
        for outcome in (RESUMED, NOT_RESUMED):
            self.migrations.labels(outcome)

    def endpoint_added(self, pool: str, url: str, healthy: bool) -> None:
        self.healthy.labels(pool, url).set(1 if healthy else 0)
        self.in_flight.labels(pool, url).set(0)

    def endpoint_removed(self, pool: str, url: str) -> None:
        for metric in (self.healthy, self.in_flight, self.picks):
            try:
                metric.remove(pool, url)
            except KeyError:
                pass

    def render(self) -> bytes:
        return generate_latest(self.registry)
