"""Where the engines are: Kubernetes EndpointSlices of the prefill and decode Services.

Each Service's slices (label `kubernetes.io/service-name=<service>`, also checked here since not
every API server applies label selectors) are listed, then watched; the list is redone every
`relist_interval` seconds (restarting the watch), so an event the watch missed cannot strand
traffic for longer than that. Only ready endpoints count (`conditions.ready` true or absent).

The API is spoken with httpx directly (async, cancellable); the `kubernetes` package only
supplies the connection settings: in-cluster service-account config in a pod, else kubeconfig.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

from pdserve.router.endpoints import Pools, error_text

log = logging.getLogger("pdserve.router")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
DEFAULT_RELIST_S = 30.0


def slice_urls(endpoint_slice: dict[str, Any], service: str, port: int) -> list[str] | None:
    """URLs of the ready endpoints of one EndpointSlice, or None if it belongs to another Service."""
    labels = (endpoint_slice.get("metadata") or {}).get("labels") or {}
    if labels.get(SERVICE_NAME_LABEL) != service:
        return None
    urls = []
    for endpoint in endpoint_slice.get("endpoints") or []:
        ready = (endpoint.get("conditions") or {}).get("ready")
        addresses = endpoint.get("addresses") or []
        if ready is False or not addresses:
            continue
        address = str(addresses[0])  # the addresses of one endpoint are interchangeable
        host = f"[{address}]" if ":" in address else address
        urls.append(f"http://{host}:{port}")
    return urls


@dataclass
class KubeConnection:
    server: str
    headers: Callable[[], dict[str, str]]
    verify: ssl.SSLContext | bool = True  # an SSLContext with the cluster's CA (and client cert)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.server.rstrip("/"), verify=self.verify,
                                 timeout=httpx.Timeout(10.0, connect=5.0))


def kube_connection(kubeconfig: str | None = None) -> KubeConnection:
    """Connection settings: the pod's service account in a cluster, else kubeconfig ($KUBECONFIG)."""
    from kubernetes import client as kclient
    from kubernetes import config as kconfig

    configuration = kclient.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not kubeconfig:
        kconfig.load_incluster_config(client_configuration=configuration)
    else:
        kconfig.load_kube_config(config_file=kubeconfig or os.environ.get("KUBECONFIG"),
                                 client_configuration=configuration)

    def headers() -> dict[str, str]:
        # Calls the refresh hook, so a rotated service-account token is picked up.
        token = configuration.get_api_key_with_prefix("authorization")
        return {"Authorization": token} if token else {}

    context = ssl.create_default_context(cafile=configuration.ssl_ca_cert or None)
    if not configuration.verify_ssl:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, configuration.key_file)
    return KubeConnection(configuration.host, headers, context)


def default_namespace() -> str:
    path = SERVICE_ACCOUNT_DIR / "namespace"
    try:
        return path.read_text().strip() or "default"
    except OSError:
        return "default"


class ServiceWatcher:
    """Keeps one pool equal to the ready endpoints of one Service."""

    def __init__(self, connection: KubeConnection, namespace: str, service: str, port: int,
                 on_urls: Callable[[list[str]], None], relist_interval: float = DEFAULT_RELIST_S) -> None:
        self.connection = connection
        self.namespace = namespace
        self.service = service
        self.port = port
        self.on_urls = on_urls
        self.relist_interval = relist_interval
        self.slices: dict[str, list[str]] = {}
        self.path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        self.params = {"labelSelector": f"{SERVICE_NAME_LABEL}={service}"}

    def _publish(self) -> None:
        self.on_urls(sorted({url for urls in self.slices.values() for url in urls}))

    def _take(self, endpoint_slice: dict[str, Any], deleted: bool = False) -> bool:
        name = (endpoint_slice.get("metadata") or {}).get("name")
        if not name:
            return False
        urls = slice_urls(endpoint_slice, self.service, self.port)
        if urls is None:
            return False
        if deleted:
            self.slices.pop(name, None)
        else:
            self.slices[name] = urls
        return True

    async def relist(self, client: httpx.AsyncClient) -> str | None:
        response = await client.get(self.path, params=self.params, headers=self.connection.headers())
        response.raise_for_status()
        body = response.json()
        self.slices = {}
        for item in body.get("items") or []:
            self._take(item)
        self._publish()
        return (body.get("metadata") or {}).get("resourceVersion")

    async def watch(self, client: httpx.AsyncClient, resource_version: str | None) -> None:
        params = dict(self.params, watch="true", allowWatchBookmarks="true",
                      timeoutSeconds=str(int(self.relist_interval) + 5))
        if resource_version:
            params["resourceVersion"] = resource_version
        timeout = httpx.Timeout(10.0, read=None)
        async with client.stream("GET", self.path, params=params, headers=self.connection.headers(),
                                 timeout=timeout) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind = event.get("type")
                if kind == "ERROR":  # e.g. 410 Gone: the resourceVersion is too old; list again
                    log.info("watch of %s ended: %s", self.service, event.get("object"))
                    return
                if kind in ("ADDED", "MODIFIED", "DELETED") and self._take(event.get("object") or {},
                                                                             deleted=kind == "DELETED"):
                    self._publish()

    async def run(self) -> None:
        """List, watch until the next re-list is due, and again, until cancelled."""
        failures = 0
        async with self.connection.client() as client:
            while True:
                try:
                    version = await self.relist(client)
                    failures = 0
                    try:
                        async with asyncio.timeout(self.relist_interval):
                            await self.watch(client, version)
                    except TimeoutError:
                        pass  # time to list again
                except (httpx.HTTPError, ValueError) as exc:
                    failures += 1
                    delay = min(10.0, 0.5 * 2 ** min(failures, 5))
                    log.warning("EndpointSlices of %s/%s: %s; again in %.1f s", self.namespace, self.service,
                                error_text(exc), delay)
                    await asyncio.sleep(delay)


def kubernetes_discovery(connection: KubeConnection, namespace: str, prefill_service: str | None,
                         decode_service: str | None, port: int,
                         relist_interval: float = DEFAULT_RELIST_S) -> Callable[[Pools], Any]:
    """A pool task for the router: one watcher per Service, feeding the matching pool."""

    async def run(pools: Pools) -> None:
        watchers = []
        if prefill_service:
            watchers.append(ServiceWatcher(connection, namespace, prefill_service, port, pools.prefill.replace,
                                           relist_interval))
        if decode_service:
            watchers.append(ServiceWatcher(connection, namespace, decode_service, port, pools.decode.replace,
                                           relist_interval))
        log.info("discovering engines from EndpointSlices in namespace %s: %s", namespace,
                 ", ".join(w.service for w in watchers))
        await asyncio.gather(*(w.run() for w in watchers))

    return run
