"""Builds the configured connector. The engine imports this and kvstore.base, never a connector."""

from __future__ import annotations

from typing import Any

from pdserve.kvstore.base import KVConnectorBase, KVConnectorRole
from pdserve.kvstore.config import parse_kv_transfer_config


def create_connector(config: Any, role: KVConnectorRole, rank: int = 0) -> KVConnectorBase | None:
    """None when the engine has no --kv-transfer-config."""
    kv = parse_kv_transfer_config(config.kv_transfer)
    if kv is None:
        return None
    if kv.connector == "p2p":
        from pdserve.kvstore.p2p import P2PConnector

        return P2PConnector(config, role, kv, rank)
    from pdserve.kvstore.storage_connector import StorageConnector

    return StorageConnector(config, role, kv, rank)
