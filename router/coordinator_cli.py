"""`pdserve coordinator`: collect the engines' load, publish it to routers, serve /stats."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

import zmq


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (all three ports)")
    p.add_argument("--stats-port", type=int, default=5557, help="zmq PULL port the engines report to")
    p.add_argument("--publish-port", type=int, default=5558, help="zmq PUB port routers subscribe to")
    p.add_argument("--http-port", type=int, default=8080, help="HTTP port for /stats, /blocks, /health, /metrics")
    p.add_argument("--publish-interval", type=_positive, default=0.1, help="seconds between publishes")
    p.add_argument("--stale-after", type=_positive, default=3.0,
                   help="seconds without a report before an engine is marked stale")
    p.add_argument("--forget-after", type=_positive, default=60.0,
                   help="seconds an engine stays listed as stale before it is dropped")
    p.add_argument("--internal-key-file", default=None, metavar="PATH",
                   help="file holding the deployment's internal key (else $PDSERVE_INTERNAL_KEY or "
                        "$PDSERVE_INTERNAL_KEY_FILE); only its holders may report, subscribe or read /blocks. "
                        "Without any, the sockets are plain and a warning says so")
    p.add_argument("--log-level", default=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"))


def run(args: argparse.Namespace) -> int:
    from pdserve.engine import internal_auth
    from pdserve.engine.logging_config import configure_logging
    from pdserve.router.coordinator import Coordinator, CoordinatorSettings

    configure_logging(args.log_level)
    try:
        key = (internal_auth.use_key_file(args.internal_key_file) if args.internal_key_file
               else internal_auth.load_internal_key())
    except internal_auth.InternalKeyError as exc:
        print(f"pdserve coordinator: {exc}", file=sys.stderr)
        return 2
    settings = CoordinatorSettings(host=args.host, stats_port=args.stats_port, publish_port=args.publish_port,
                                   http_port=args.http_port, publish_interval=args.publish_interval,
                                   stale_after=args.stale_after, forget_after=args.forget_after,
                                   internal_key=key)

    def ready() -> None:
        print(f"pdserve coordinator: ready (reports on :{settings.stats_port}, publishing on "
              f":{settings.publish_port}, http://{settings.host}:{settings.http_port}/stats)", flush=True)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await Coordinator(settings).run(stop, on_ready=ready)

    try:
        asyncio.run(main())
    except (OSError, zmq.ZMQError) as exc:
        print(f"pdserve coordinator: {exc}", file=sys.stderr)
        return 1
    return 0
