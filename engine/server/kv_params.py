"""`kv_transfer_params` checked at the HTTP edge, before the engine ever sees them.

Only the router (holding the internal key) may send these, but a key can leak and a router can be
wrong: every field is type- and range-checked here, a problem is a 400 naming the field, and what
passes is a fresh dict of known keys only. The connector checks again (it must never raise inside
the scheduler), and the prefill engine checks that the decode side asks for its own prompt's KV;
this layer just makes sure nothing malformed gets that far.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any, Callable

from pdserve.engine.server.errors import APIError

MAX_TP_SIZE = 64
MAX_ID_CHARS = 256
MAX_BLOCK_ID = 2**31 - 1
MAX_LEASE_S = 86400
TRANSPORTS = ("tcp", "nixl")
# The store connectors' params say which connector made them and nothing else: their blocks are
# found by the decode engine's own prefix hashes, so they are bound to its prompt by construction.
CONNECTORS = ("p2p", "kvstore", "shared-storage")
_HOSTNAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
# What a decode engine needs to pull from a prefill engine (`remote_port` or `remote_ports`).
PULL_KEYS = ("remote_engine_id", "remote_request_id", "remote_block_ids", "remote_host", "remote_tp_size",
             "prompt_digest")


def _fail(field: str, message: str) -> APIError:
    return APIError(400, f"kv_transfer_params.{field}: {message}", param=f"kv_transfer_params.{field}",
                    code="invalid_kv_transfer_params")


def _bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(field, "must be true or false")
    return value


def _int(field: str, value: Any, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise _fail(field, f"must be an integer in [{low}, {high}]")
    return value


def _text(field: str, value: Any) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS or not value.isprintable():
        raise _fail(field, f"must be a printable string of 1 to {MAX_ID_CHARS} characters")
    return value


def _host(field: str, value: Any) -> str:
    if isinstance(value, str):
        try:
            ipaddress.ip_address(value)
            return value
        except ValueError:
            if _HOSTNAME.match(value):
                return value
    raise _fail(field, "must be an IP address or a host name")


def _port(field: str, value: Any) -> int:
    return _int(field, value, 1, 65535)


def _tp_size(field: str, value: Any) -> int:
    size = _int(field, value, 1, MAX_TP_SIZE)
    if size & (size - 1):
        raise _fail(field, f"must be a power of two up to {MAX_TP_SIZE}")
    return size


def _int_list(field: str, value: Any, limit: int, check: Callable[[str, Any], int]) -> list[int]:
    if not isinstance(value, list) or len(value) > limit:
        raise _fail(field, f"must be a list of at most {limit} integers")
    return [check(f"{field}[{i}]", item) for i, item in enumerate(value)]


def _transport(field: str, value: Any) -> str:
    if value not in TRANSPORTS:
        raise _fail(field, f"must be one of {', '.join(TRANSPORTS)}")
    return value


def _connector(field: str, value: Any) -> str:
    if value not in CONNECTORS:
        raise _fail(field, f"must be one of {', '.join(CONNECTORS)}")
    return value


def _digest(field: str, value: Any) -> str:
    if not isinstance(value, str) or not _DIGEST.match(value):
        raise _fail(field, "must be 64 lowercase hex digits (the prefill engine's SHA-256 of the prompt)")
    return value


def _lease(field: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= MAX_LEASE_S:
        raise _fail(field, f"must be a number of seconds in (0, {MAX_LEASE_S:g}]")
    return float(value)


def validate_kv_transfer_params(raw: Any, max_blocks: int) -> dict[str, Any]:
    """The params, checked and copied; raises APIError(400) naming the first bad field.
    `max_blocks`: the most blocks one request can hold (max_model_len / block_size, rounded up)."""
    if not isinstance(raw, dict):
        raise APIError(400, "kv_transfer_params must be a JSON object", param="kv_transfer_params",
                       code="invalid_kv_transfer_params")
    checks: dict[str, Callable[[str, Any], Any]] = {
        "do_remote_decode": _bool,
        "do_remote_prefill": _bool,
        "remote_engine_id": _text,
        "remote_request_id": _text,
        "remote_block_ids": lambda f, v: _int_list(f, v, max_blocks, lambda g, b: _int(g, b, 0, MAX_BLOCK_ID)),
        "remote_host": _host,
        "remote_port": _port,
        "remote_ports": lambda f, v: _int_list(f, v, MAX_TP_SIZE, _port),
        "remote_tp_size": _tp_size,
        "transport": _transport,
        "prompt_digest": _digest,
        "kv_connector": _connector,
        "kv_lease_duration": _lease,  # how long the prefill keeps the blocks without a renewal
    }
    unknown = sorted(set(raw) - set(checks))
    if unknown:
        raise _fail(unknown[0], "is not a known field")
    params = {key: checks[key](key, value) for key, value in raw.items()}
    if params.get("do_remote_decode") and params.get("do_remote_prefill"):
        raise _fail("do_remote_prefill", "cannot be true together with do_remote_decode")
    if params.get("do_remote_prefill") and params.get("kv_connector", "p2p") == "p2p":
        for key in PULL_KEYS:
            if key not in params:
                raise _fail(key, "is required with do_remote_prefill")
        if "remote_port" not in params and "remote_ports" not in params:
            raise _fail("remote_port", "is required with do_remote_prefill (or remote_ports)")
        ports = params.get("remote_ports")
        if ports is not None and len(ports) != params["remote_tp_size"]:
            raise _fail("remote_ports", f"must hold one port per prefill rank ({params['remote_tp_size']})")
    return params


def check_blocks_fit_prompt(params: dict[str, Any], prompt_len: int, block_size: int) -> None:
    """A pull names the prefill's blocks of this very prompt: as many as the prompt fills (the
    prefill may hold one more for the token it sampled). Raises APIError(400)."""
    if not params.get("do_remote_prefill") or "remote_block_ids" not in params:
        return
    count = len(params["remote_block_ids"])
    least = -(-max(prompt_len - 1, 0) // block_size)
    most = -(-(prompt_len + 1) // block_size)
    if not least <= count <= most:
        raise _fail("remote_block_ids", f"holds {count} blocks; a prompt of {prompt_len} tokens in blocks of "
                                        f"{block_size} needs {least}" + (f" to {most}" if most != least else ""))


@dataclass(frozen=True)
class KVRelease:
    """A router's word that nobody will pull a prefill's held KV (POST /v1/kv/release)."""

    engine_id: str  # names the data-parallel rank that holds it
    request_id: str
    prompt_digest: str


def validate_kv_release(raw_params: Any, max_blocks: int) -> KVRelease:
    """The `kv_transfer_params` of a release (what the prefill answered), checked like any params;
    raises APIError(400) naming the first bad or missing field."""
    if raw_params is None:
        raise APIError(400, "kv_transfer_params is required (the params the prefill engine answered with)",
                       param="kv_transfer_params", code="invalid_kv_transfer_params")
    params = validate_kv_transfer_params(raw_params, max_blocks)
    for key in ("remote_engine_id", "remote_request_id", "prompt_digest"):
        if key not in params:
            raise _fail(key, "is required to release held KV")
    return KVRelease(params["remote_engine_id"], params["remote_request_id"], params["prompt_digest"])
