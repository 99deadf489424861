"""What ties a prompt's KV to that prompt: a digest of its token ids.

KV computed for one prompt is correct only for that prompt. The prefill engine puts the digest of
the prompt it computed into the kv_transfer_params it answers with and keeps it with the held
blocks; the decode engine computes the digest of its own request's prompt, refuses params that
name another one, and sends its digest with every read, lease and done, so the prefill engine
serves a prompt's blocks only to a reader of that very prompt. Params that travel with the wrong
prompt can then never fill (and so never poison the prefix cache of) another prompt's blocks.

Pure and torch-free: both sides, and the HTTP edge, compute it the same way.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from array import array
from typing import Sequence

# Bound to its use: the same token ids hashed for another purpose never give this digest.
_DOMAIN = b"pdserve-kv-prompt-digest/v1\0"
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")


def prompt_digest(token_ids: Sequence[int]) -> str:
    """Hex SHA-256 of the prompt's token ids (as signed 64-bit integers, machine order: every
    engine of one deployment runs on the same architecture)."""
    return hashlib.sha256(_DOMAIN + array("q", token_ids).tobytes()).hexdigest()


def is_digest(value: object) -> bool:
    """Whether `value` looks like a prompt_digest (64 lowercase hex digits)."""
    return isinstance(value, str) and _HEX_DIGEST.fullmatch(value) is not None


def digests_match(held: str, given: object) -> bool:
    """Constant-time comparison of a held digest with a peer's; False for anything not a digest."""
    return is_digest(given) and hmac.compare_digest(held, given)  # type: ignore[arg-type]
