"""`--kv-transfer-config`: vLLM's JSON shape, checked once at start-up with clear errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# connector -> {extra key: (type, default)}; anything else in kv_connector_extra_config is an error.
EXTRA_KEYS: dict[str, dict[str, tuple[type | tuple[type, ...], Any]]] = {
    "p2p": {
        "transport": (str, "auto"),  # auto | nixl | tcp
        # Seconds a finished prefill's blocks wait for their decode engine without a renewal
        # (decode engines renew while the request waits); `abort_timeout_s` is its older name.
        "kv_lease_duration": ((int, float), None),
        "abort_timeout_s": ((int, float), 30.0),
        "side_channel_port": (int, 0),  # rank r listens on port + r; 0 picks free ports
        "side_channel_host": (str, ""),  # where we listen and decode engines reach us; default: the advertised host
        "pull_timeout_s": ((int, float), 10.0),
    },
    "kvstore": {
        "kvstore_url": (str, None),  # tcp://host:port
        "timeout_s": ((int, float), 2.0),
    },
    "shared-storage": {
        "path": (str, None),
        # Most bytes of block files kept under `path`; the oldest files (by mtime) go first.
        "capacity_bytes": (int, 8 * 2**30),
    },
}
REQUIRED = {"kvstore": "kvstore_url", "shared-storage": "path"}
TRANSPORTS = ("auto", "nixl", "tcp")


class KVTransferConfigError(ValueError):
    pass


@dataclass(frozen=True)
class KVTransferConfig:
    connector: str
    role: str
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("kv_consumer", "kv_both")


def parse_kv_transfer_config(raw: dict[str, Any] | None) -> KVTransferConfig | None:
    """None when no connector is configured; raises KVTransferConfigError naming the problem."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise KVTransferConfigError(f"--kv-transfer-config must be a JSON object, got {type(raw).__name__}")
    unknown = set(raw) - {"kv_connector", "kv_role", "kv_connector_extra_config"}
    if unknown:
        raise KVTransferConfigError(f"--kv-transfer-config: unknown keys {sorted(unknown)}; expected kv_connector, "
                                    f"kv_role, kv_connector_extra_config")
    connector = raw.get("kv_connector")
    if connector not in EXTRA_KEYS:
        raise KVTransferConfigError(f"--kv-transfer-config: unknown kv_connector {connector!r}; "
                                    f"choose one of {', '.join(EXTRA_KEYS)}")
    role = raw.get("kv_role", "kv_both")
    if role not in KV_ROLES:
        raise KVTransferConfigError(f"--kv-transfer-config: kv_role must be one of {', '.join(KV_ROLES)}; got {role!r}")
    given = raw.get("kv_connector_extra_config") or {}
    if not isinstance(given, dict):
        raise KVTransferConfigError("--kv-transfer-config: kv_connector_extra_config must be a JSON object")
    allowed = EXTRA_KEYS[connector]
    unknown = set(given) - set(allowed)
    if unknown:
        raise KVTransferConfigError(f"--kv-transfer-config: unknown kv_connector_extra_config keys {sorted(unknown)} "
                                    f"for the {connector} connector; allowed: {', '.join(allowed)}")
    extra: dict[str, Any] = {}
    for key, (kind, default) in allowed.items():
        value = given.get(key, default)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise KVTransferConfigError(f"--kv-transfer-config: {key} must be a {_type_name(kind)}, got {value!r}")
        extra[key] = value
    required = REQUIRED.get(connector)
    if required and not extra.get(required):
        raise KVTransferConfigError(f"--kv-transfer-config: the {connector} connector needs "
                                    f"kv_connector_extra_config.{required}")
    if connector == "p2p":
        if extra["transport"] not in TRANSPORTS:
            raise KVTransferConfigError(f"--kv-transfer-config: transport must be one of {', '.join(TRANSPORTS)}; "
                                        f"got {extra['transport']!r}")
        lease, alias = given.get("kv_lease_duration"), given.get("abort_timeout_s")
        if lease is not None and alias is not None and lease != alias:
            raise KVTransferConfigError("--kv-transfer-config: kv_lease_duration and its older name abort_timeout_s "
                                        "disagree; give kv_lease_duration only")
        extra["kv_lease_duration"] = extra["abort_timeout_s"] = lease if lease is not None else extra["abort_timeout_s"]
        if extra["kv_lease_duration"] <= 0 or extra["pull_timeout_s"] <= 0:
            raise KVTransferConfigError("--kv-transfer-config: kv_lease_duration (abort_timeout_s) and "
                                        "pull_timeout_s must be positive")
        if not 0 <= extra["side_channel_port"] < 65536:
            raise KVTransferConfigError("--kv-transfer-config: side_channel_port must be in [0, 65535]")
    if connector == "kvstore" and not str(extra["kvstore_url"]).startswith("tcp://"):
        raise KVTransferConfigError(f"--kv-transfer-config: kvstore_url must look like tcp://host:port, "
                                    f"got {extra['kvstore_url']!r}")
    return KVTransferConfig(connector, role, extra)


def _type_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = ({"str": "string", "int": "number", "float": "number"}.get(k.__name__, k.__name__) for k in kinds)
    return " or ".join(dict.fromkeys(names))
