"""The endpoint picker's configuration (from `pdserve epp`'s flags)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.server.tool_parsers import DEFAULT_PARSER
from pdserve.router.balancer import Policy

# Headers the gateway reads or the engines trust: what a client sends under these names never
# reaches an engine (the picker sets or removes each of them on every request).
DESTINATION_HEADER = "x-gateway-destination-endpoint"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
OBJECTIVE_HEADER = "x-gateway-inference-objective"


@dataclass
class EppSettings:
    model: str
    policy: Policy = Policy.LEAST_LOADED
    pool_name: str = "pdserve"                 # the `name` label of the inference_pool_* metrics
    max_body_bytes: int = 8 << 20
    health_interval: float = 2.0
    tokenizer: str | None = None
    tool_call_parser: str = DEFAULT_PARSER
    coordinator_address: str | None = None    # host:port of the feed
    coordinator_http_port: int = 8080
    rank_port_base: int | None = None         # pods with DP ranks: rank r listens on base + r
    internal_key: bytes | None = None
    # Above this many waiting requests on every endpoint the pool is saturated: sheddable requests
    # (objective priority < 0) get 429. None: never.
    saturation_waiting: int | None = None
    objectives: dict[str, int] = field(default_factory=dict)  # name -> priority
    destinations: int = 3                     # endpoints listed per answer: the pick, then fallbacks
    pd_min_prompt_tokens: int = 256
    prefill_timeout: float = 60.0
    connect_timeout: float = 2.0
    release_timeout: float = 2.0
