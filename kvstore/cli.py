"""`pdserve kvstore`: run the KV store service until SIGTERM or SIGINT.

The operator renders `pdserve kvstore --host 0.0.0.0 --port 5700 --capacity <bytes>`; people may
write `--capacity 4Gi` or `--capacity-gib 4`. This module never imports torch (only the
engine's torch-free logging setup), so the store starts in a fraction of a second and stays small.
"""

from __future__ import annotations

import argparse
import logging
import re
import signal
from decimal import Decimal, InvalidOperation

from pdserve.kvstore.protocol import DEFAULT_MAX_FRAME_BYTES, DEFAULT_MAX_KEYS, MAX_FRAME_BYTES_LIMIT, Limits

log = logging.getLogger("pdserve.kvstore")

DEFAULT_CAPACITY_BYTES = 2**30
_SUFFIXES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_QUANTITY = re.compile(r"^(?P<number>\d+(?:\.\d*)?|\.\d+)"
                       r"(?:(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)|[eE](?P<exp>[+-]?\d+))?$")


def parse_quantity(text: str) -> int:
    """Bytes from a Kubernetes quantity (`4Gi`, `512Mi`, `1.5G`, `1e9`, `1000000`)."""
    match = _QUANTITY.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count or Kubernetes quantity (e.g. 4Gi, 512Mi)")
    try:
        number = Decimal(match["number"])
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if match["exp"] is not None:
        value = number.scaleb(int(match["exp"]))
    else:
        value = number * _SUFFIXES[match["suffix"] or ""]
    value = int(value)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"capacity must be more than zero bytes, got {text!r}")
    return value


def _gib(text: str) -> int:
    try:
        value = int(Decimal(text) * 2**30)
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"capacity must be more than zero bytes, got {text!r} GiB")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _frame_bytes(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_FRAME_BYTES_LIMIT:
        # Every connected key holder may make the store allocate this much per frame in flight.
        raise argparse.ArgumentTypeError(f"must be at most {MAX_FRAME_BYTES_LIMIT} bytes, got {value}")
    return value


def _port(text: str, lowest: int = 1) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not lowest <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be {lowest}-65535, got {value}")
    return value


def _http_port(text: str) -> int:
    return _port(text, lowest=0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    p.add_argument("--port", type=_port, default=5700, help="ZMQ port for put/get/contains (default: 5700)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--capacity", type=parse_quantity, default=None,
                      help="most value bytes held before least recently used blocks are evicted: bytes or a "
                           "Kubernetes quantity such as 4Gi (default: 1Gi)")
    size.add_argument("--capacity-gib", type=_gib, default=None, dest="capacity_gib",
                      help="the same in GiB (e.g. 4 or 0.5)")
    p.add_argument("--http-port", type=_http_port, default=None,
                   help="port for GET /health and /metrics (default: --port + 1; 0 turns HTTP off)")
    p.add_argument("--max-frame-bytes", type=_frame_bytes, default=DEFAULT_MAX_FRAME_BYTES,
                   help=f"largest value accepted in one frame (default: {DEFAULT_MAX_FRAME_BYTES}, "
                        f"at most {MAX_FRAME_BYTES_LIMIT})")
    p.add_argument("--max-keys", type=_positive_int, default=DEFAULT_MAX_KEYS,
                   help=f"most keys in one request (default: {DEFAULT_MAX_KEYS})")
    p.add_argument("--internal-key-file", default=None, metavar="PATH",
                   help="file holding the deployment's internal key (else $PDSERVE_INTERNAL_KEY or "
                        "$PDSERVE_INTERNAL_KEY_FILE); only its holders can use the store. Without any, the "
                        "socket is plain and a warning says so")


def run(args: argparse.Namespace) -> int:
    from pdserve.kvstore.service import KVStoreService, ServiceConfig, ServiceError

    from pdserve.engine import internal_auth  # torch-free, like this command
    from pdserve.engine.logging_config import configure_logging

    configure_logging()
    try:
        key = (internal_auth.use_key_file(args.internal_key_file) if args.internal_key_file
               else internal_auth.load_internal_key())
    except internal_auth.InternalKeyError as exc:
        log.error("%s", exc)
        return 2
    if args.http_port == args.port or (args.http_port is None and args.port == 65535):
        log.error("the HTTP port must differ from --port %d and be at most 65535: set --http-port", args.port)
        return 2
    capacity = args.capacity or args.capacity_gib or DEFAULT_CAPACITY_BYTES
    config = ServiceConfig(host=args.host, port=args.port, capacity_bytes=capacity, http_port=args.http_port,
                           limits=Limits(max_frame_bytes=args.max_frame_bytes, max_keys=args.max_keys),
                           internal_key=key)
    try:
        service = KVStoreService(config)
    except ServiceError as exc:
        log.error("%s", exc)
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: service.stop())
    service.serve_forever()
    return 0
