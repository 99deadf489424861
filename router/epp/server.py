"""The picker's servers, on one event loop: gRPC (ext_proc and grpc.health.v1) and a small HTTP
server for /health and Prometheus /metrics.

gRPC health, by service name (the GIE protocol's names):
  ""  and "liveness"                                   SERVING while the process runs;
  "readiness" and "envoy.service.ext_proc.v3.ExternalProcessor"
                                                       SERVING while at least one pool endpoint
                                                       is ready, else NOT_SERVING.
A liveness probe on "" never restarts the picker because the engines are down; a readiness probe
takes it out of its Service while it could only answer 503.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from fastapi import FastAPI
from fastapi.responses import Response
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CONTENT_TYPE_LATEST

from pdserve.router.epp.metrics import EppMetrics
from pdserve.router.epp.processor import Processor
from pdserve.router.epp.state import PoolState

log = logging.getLogger("pdserve.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
ALWAYS_SERVING = ("", "liveness")
READY_SERVICES = ("readiness", EXT_PROC_SERVICE)
# gRPC refuses a message over its limit itself (the gateway then answers 503, not 413). The
# picker's own limit is checked on the body it collects, so gRPC's must not be the tighter one:
# room for the largest body the picker accepts, plus the size of the chunk a gateway may send in
# one message (bounded by its own buffer, Envoy's default 1 MiB; 16 MiB leaves room for larger
# settings), plus the message's other fields.
MESSAGE_HEADROOM = 17 << 20


def http_app(state: PoolState, metrics: EppMetrics, model: str) -> FastAPI:
    app = FastAPI(title="pdserve epp", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def healthz() -> dict[str, Any]:
        # The picker itself is up even with no ready endpoint: requests then get 503 from it.
        pools = {p.name: {"endpoints": len(p), "healthy": len(p.healthy())} for p in state.pools}
        body: dict[str, Any] = {"status": "ok", "model": model, "pools": pools, "ready": state.ready() > 0}
        if state.feed is not None:
            body["coordinator"] = "alive" if state.feed.alive() else "silent"
        return body

    @app.get("/metrics")
    async def prometheus() -> Response:
        state.update_gauges()
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def watch_readiness(state: PoolState, servicer: health.aio.HealthServicer) -> None:
    serving = None
    while True:
        now = state.ready() > 0
        if now != serving:
            status = health_pb2.HealthCheckResponse.SERVING if now else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in READY_SERVICES:
                await servicer.set(name, status)
            log.info("readiness: %s (%d ready endpoints)", "SERVING" if now else "NOT_SERVING", state.ready())
            serving = now
        await asyncio.sleep(0.25)


async def serve(processor: Processor, state: PoolState, metrics: EppMetrics, host: str, grpc_port: int,
                metrics_port: int, max_body_bytes: int, model: str) -> None:
    import uvicorn

    from pdserve.engine.server.cli import GracefulServer

    await state.start()
    limit = max_body_bytes + MESSAGE_HEADROOM
    # No SO_REUSEPORT (gRPC's default): a second picker on a taken port must fail, not silently
    # share the gateway's streams with a stale one.
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                      ("grpc.max_send_message_length", limit), ("grpc.so_reuseport", 0)])
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ALWAYS_SERVING:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    for name in READY_SERVICES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    address = f"[{host}]:{grpc_port}" if ":" in host else f"{host}:{grpc_port}"
    bound = server.add_insecure_port(address)
    await server.start()
    readiness = asyncio.ensure_future(watch_readiness(state, health_servicer))
    config = uvicorn.Config(http_app(state, metrics, model), host=host, port=metrics_port, log_level="warning",
                            access_log=False, lifespan="off")
    http = GracefulServer(config)
    print(f"pdserve epp: ext_proc on {host}:{bound}, /health and /metrics on http://{host}:{metrics_port} "
          f"(model {model})", flush=True)
    try:
        await http.serve()  # until SIGTERM/SIGINT
    finally:
        readiness.cancel()
        await server.stop(grace=5.0)
        if processor.prefill_leg is not None:
            await processor.prefill_leg.releaser.drain()  # on the state's client: before it closes
        await state.stop()
