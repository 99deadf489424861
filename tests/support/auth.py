"""The internal key the test session's processes share (set in tests/conftest.py), as headers."""

from __future__ import annotations

import os

from pdserve.engine.internal_auth import ENV_KEY, HEADER


def internal_key() -> str:
    return os.environ[ENV_KEY]


def internal_headers() -> dict[str, str]:
    """What the router sends an engine: needed for any request that carries kv_transfer_params."""
    return {HEADER: internal_key()}
