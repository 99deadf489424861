"""A small synchronous Kubernetes API client for the handful of calls the operator makes.

Credentials come from the official client's loaders (in-cluster service account, or a kubeconfig
with its auth plugins), so the operator authenticates exactly like `kubectl`; the requests
themselves are plain JSON over httpx, because manifests are dicts and a typed client would only
convert them back and forth. kopf gets the same credentials through `connection_info()`.
"""

from __future__ import annotations

import os
import ssl
import threading
from dataclasses import dataclass
from typing import Any, Mapping

import httpx
import kopf
import kubernetes.client
import kubernetes.config

from pdserve.operator import crd

# Every kind the operator reads or writes, and the URL segment it lives under.
PLURALS: dict[tuple[str, str], str] = {
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Secret"): "secrets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    ("v1", "Service"): "services",
    ("apps/v1", "Deployment"): "deployments",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    (crd.API_VERSION, crd.KIND): crd.PLURAL,
    # Gateway API Inference Extension objects (spec.router.gateway); their CRDs come with the gateway.
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproutes",
}

MERGE_PATCH = "application/merge-patch+json"


class ApiError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, message: str):
        self.status = status
        super().__init__(f"{method} {path}: HTTP {status}: {message}")


class Conflict(ApiError):
    """409: the object already exists (create) or changed since it was read (patch with resourceVersion)."""


@dataclass
class Credentials:
    configuration: kubernetes.client.Configuration

    @classmethod
    def load(cls, kubeconfig: str | None = None, context: str | None = None) -> Credentials:
        """In-cluster service account when running in a pod (and no kubeconfig is named), else kubeconfig."""
        configuration = kubernetes.client.Configuration()
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            kubernetes.config.load_incluster_config(client_configuration=configuration)
        else:
            kubernetes.config.load_kube_config(config_file=kubeconfig, context=context,
                                               client_configuration=configuration, persist_config=False)
        return cls(configuration)

    @property
    def server(self) -> str:
        return self.configuration.host.rstrip("/")

    def authorization(self) -> str | None:
        # The official client refreshes expiring tokens (projected service-account tokens, exec
        # plugins) inside this getter, so it is called per request rather than cached.
        config = self.configuration
        token = config.get_api_key_with_prefix("BearerToken") or config.get_api_key_with_prefix("authorization")
        if token:
            return token if " " in token else f"Bearer {token}"
        if config.username:
            return config.get_basic_auth_token()
        return None

    def connection_info(self) -> kopf.ConnectionInfo:
        header = self.authorization() or ""
        scheme, _, token = header.partition(" ")
        config = self.configuration
        return kopf.ConnectionInfo(
            server=self.server, ca_path=config.ssl_ca_cert, insecure=not config.verify_ssl,
            scheme=scheme or None, token=token or None,
            certificate_path=config.cert_file, private_key_path=config.key_file,
        )

    def verify(self) -> ssl.SSLContext | bool:
        config = self.configuration
        if not config.verify_ssl:
            return False
        return ssl.create_default_context(cafile=config.ssl_ca_cert) if config.ssl_ca_cert else True


def resource_path(api_version: str, kind: str, namespace: str | None, name: str | None = None,
                  subresource: str | None = None) -> str:
    plural = PLURALS[(api_version, kind)]
    root = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    path = f"{root}/namespaces/{namespace}/{plural}" if namespace else f"{root}/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


REQUEST_TIMEOUT_S = 30.0  # httpx applies it to each phase of a request: connect, write, each read


class KubeClient:
    """Called from kopf's handler threads at once; each thread gets its own connection pool, as
    one httpx.Client shared between threads has shown closed-socket errors under load."""

    def __init__(self, credentials: Credentials, timeout: float = REQUEST_TIMEOUT_S):
        self._credentials = credentials
        self._timeout = timeout
        self._local = threading.local()
        self._clients: list[httpx.Client] = []
        self._clients_lock = threading.Lock()

    @property
    def _http(self) -> httpx.Client:
        client = getattr(self._local, "client", None)
        if client is None:
            config = self._credentials.configuration
            cert = (config.cert_file, config.key_file) if config.cert_file else None
            client = httpx.Client(base_url=self._credentials.server, verify=self._credentials.verify(), cert=cert,
                                  timeout=self._timeout)
            self._local.client = client
            with self._clients_lock:
                self._clients.append(client)
        return client

    def close(self) -> None:
        with self._clients_lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()

    def _request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        headers = {"Accept": "application/json"}
        auth = self._credentials.authorization()
        if auth:
            headers["Authorization"] = auth
        if body is not None:
            headers["Content-Type"] = content_type
        response = self._http.request(method, path, json=body, headers=headers)
        if response.status_code >= 400:
            try:
                message = response.json().get("message", response.text)
            except ValueError:
                message = response.text
            error = Conflict if response.status_code == 409 else ApiError
            raise error(response.status_code, method, path, message)
        return response.json() if response.content else None

    def get(self, api_version: str, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self._request("GET", resource_path(api_version, kind, namespace, name))
        except ApiError as error:
            if error.status == 404:
                return None
            raise

    def create(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        meta = manifest["metadata"]
        path = resource_path(manifest["apiVersion"], manifest["kind"], meta.get("namespace"))
        return self._request("POST", path, dict(manifest))

    def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> None:
        try:
            # Background: the Deployment goes now, its ReplicaSets and pods follow through GC.
            self._request("DELETE", resource_path(api_version, kind, namespace, name),
                          {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"})
        except ApiError as error:
            if error.status != 404:
                raise

    def patch(self, api_version: str, kind: str, namespace: str | None, name: str,
              patch: Mapping[str, Any], subresource: str | None = None) -> dict[str, Any]:
        path = resource_path(api_version, kind, namespace, name, subresource)
        return self._request("PATCH", path, dict(patch), content_type=MERGE_PATCH)
