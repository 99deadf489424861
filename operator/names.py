"""Names and labels of the objects rendered for one InferenceService.

Rendering, status and the autoscaler all find objects by these names; keeping them in one place
means a rename cannot leave one of them looking for an object that no longer exists.
"""

from __future__ import annotations

from dataclasses import dataclass

# "epp" (the Gateway API Inference Extension's endpoint picker) runs only when spec.router.gateway asks.
ROLES = ("prefill", "decode", "router", "coordinator", "kvstore", "epp")
ENGINE_ROLES = ("prefill", "decode")

APP_NAME = "pdserve"
MANAGED_BY = "pdserve-operator"
ROLE_LABEL = "pdserve.io/role"
INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"

# Ports every rendered pod agrees on (the pod commands in commands.py use the same numbers).
ENGINE_PORT = 8000
KV_TRANSFER_PORT = 5600
COORDINATOR_STATS_PORT = 5557
COORDINATOR_PUBLISH_PORT = 5558
COORDINATOR_HTTP_PORT = 8080
KVSTORE_PORT = 5700
# With the inference gateway on, a decode pod running several data-parallel ranks also serves
# rank r alone on RANK_PORT_BASE + r (`pdserve serve --rank-port-base`): the InferencePool lists
# one target port per rank, so the endpoint picker can choose a rank, not only a pod.
RANK_PORT_BASE = 8100
# The InferencePool API allows at most this many target ports, hence at most this many ranks.
MAX_TARGET_PORTS = 8

# The operator's own pods (charts/pdserve): the coordinator lets them read its load for autoscaling.
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "pdserve-operator"}


@dataclass(frozen=True)
class Names:
    instance: str

    def deployment(self, role: str) -> str:
        return f"{self.instance}-{role}"

    def service(self, role: str) -> str:
        # Engine services are headless (the router reads their EndpointSlices); the router's is public.
        return f"{self.instance}-{role}"

    @property
    def router_account(self) -> str:
        return f"{self.instance}-router"

    @property
    def epp_account(self) -> str:
        return f"{self.instance}-epp"

    def inference_pool(self, override: str | None = None) -> str:
        return override or f"{self.instance}-pool"

    @property
    def http_route(self) -> str:
        return f"{self.instance}-route"

    @property
    def engine_config(self) -> str:
        return f"{self.instance}-engine"

    @property
    def internal_key_secret(self) -> str:
        return f"{self.instance}-internal-key"

    def network_policy(self, role: str) -> str:
        return f"{self.instance}-{role}"

    def instance_selector(self) -> dict[str, str]:
        """Every pod of this InferenceService (and of no other: the instance label is its name)."""
        return {"app.kubernetes.io/name": APP_NAME, INSTANCE_LABEL: self.instance}

    def selector(self, role: str) -> dict[str, str]:
        """Deployment selectors are immutable: only labels that never change for a role go here."""
        return {**self.instance_selector(), ROLE_LABEL: role}

    def selector_string(self, role: str) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted(self.selector(role).items()))

    def labels(self, component: str) -> dict[str, str]:
        """Labels of every object; `pdserve.io/role` only on what belongs to one role's pods."""
        labels = {
            "app.kubernetes.io/name": APP_NAME,
            INSTANCE_LABEL: self.instance,
            "app.kubernetes.io/component": component,
            MANAGED_BY_LABEL: MANAGED_BY,
            "app.kubernetes.io/part-of": APP_NAME,
        }
        if component in ROLES:
            labels[ROLE_LABEL] = component
        return labels

    def coordinator_address(self, port: int) -> str:
        return f"{self.service('coordinator')}:{port}"

    def endpoint(self, namespace: str, port: int) -> str:
        return f"http://{self.service('router')}.{namespace}.svc:{port}/v1"
