"""The internal credential: one shared secret held by every pdserve process of one deployment.

Where it comes from: `PDSERVE_INTERNAL_KEY` (the key itself), else `PDSERVE_INTERNAL_KEY_FILE` (a
file holding it, e.g. a mounted Kubernetes Secret). `--internal-key-file` on any pdserve command
sets the second for the process and so for every child it starts. `pdserve up` generates one key
per run; the operator creates one Secret per InferenceService.

What it protects, and how (each a well-kept primitive, nothing home-made):
- HTTP: the router sends it in `X-PDServe-Internal-Key`; engines act on `kv_transfer_params`
  only from requests that carry it (compared in constant time).
- The p2p KV side channel (plain TCP): a mutual HMAC-SHA256 challenge-response before the
  server reads more than a few bytes; data then flows unencrypted (it is KV, moved at memory speed).
- ZMQ sockets (KV store, coordinator reports and feed): CURVE, with both key pairs derived from the
  key (HMAC-SHA256 as the derivation), and a ZAP handler that admits only the derived client key.
  A peer without the key never completes the handshake, so no message of it is ever delivered.

Torch-free: the router, coordinator and KV store import it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
from typing import Any, Mapping

log = logging.getLogger("pdserve.auth")

ENV_KEY = "PDSERVE_INTERNAL_KEY"
ENV_KEY_FILE = "PDSERVE_INTERNAL_KEY_FILE"
HEADER = "X-PDServe-Internal-Key"
# A key shorter than this is refused: it would be guessable, and it is only ever typed by a machine.
MIN_KEY_BYTES = 16
NONCE_BYTES = 32
PROOF_BYTES = hashlib.sha256().digest_size


class InternalKeyError(ValueError):
    """The configured key cannot be used; the message says why and where it came from."""


def generate_key() -> str:
    """A new key: 256 random bits, URL-safe text (fits an env var, a header and a Secret)."""
    return secrets.token_urlsafe(32)


def load_internal_key(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The deployment's key, or None when none is configured. Raises InternalKeyError for a key
    that is set but unusable (an unreadable file, too short): never silently run without one."""
    environ = os.environ if environ is None else environ
    value = environ.get(ENV_KEY)
    where = f"${ENV_KEY}"
    if not value:
        path = environ.get(ENV_KEY_FILE)
        if not path:
            return None
        where = f"the internal key file {path}"
        try:
            with open(path, encoding="utf-8") as handle:
                value = handle.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise InternalKeyError(f"cannot read {where}: {exc}") from None
    key = value.strip().encode()
    if len(key) < MIN_KEY_BYTES:
        raise InternalKeyError(f"{where} holds {len(key)} bytes; an internal key needs at least {MIN_KEY_BYTES} "
                               f"(generate one with: python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return key


def use_key_file(path: str) -> bytes:
    """`--internal-key-file`: check the file now (a clear start-up error) and export it to children."""
    os.environ.pop(ENV_KEY, None)  # the file given on the command line wins over an inherited key
    os.environ[ENV_KEY_FILE] = os.path.abspath(path)
    key = load_internal_key()
    assert key is not None
    return key


def header_matches(given: str | None, key: bytes | None) -> bool:
    """Whether a request's X-PDServe-Internal-Key is the key; constant time, False without a key."""
    if key is None or given is None:
        return False
    return hmac.compare_digest(given.strip().encode("latin-1", errors="replace"), key)


# -- challenge-response (the p2p side channel) ----------------------------------------------------

def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def proof(key: bytes | None, role: str, nonce: bytes) -> bytes:
    """HMAC-SHA256 of the peer's nonce under the key, bound to the prover's role ("client" or
    "server") so that one side's answer can never be replayed as the other's. With no key
    (`--insecure-kv-transfer`) both sides use the empty key: the same protocol, no protection."""
    return hmac.new(key or b"", b"pdserve-kv-side-channel/" + role.encode() + b"\0" + nonce, hashlib.sha256).digest()


def proof_matches(key: bytes | None, role: str, nonce: bytes, given: Any) -> bool:
    if not isinstance(given, (bytes, bytearray)) or len(given) != PROOF_BYTES:
        return False
    return hmac.compare_digest(proof(key, role, nonce), bytes(given))


# -- ZMQ CURVE ------------------------------------------------------------------------------------

def curve_keypair(key: bytes, role: str) -> tuple[bytes, bytes]:
    """(public, secret), Z85-encoded, of the CURVE pair for `role` ("server" or "client"), derived
    from the internal key: every holder of the key derives the same pairs, nobody else can."""
    import zmq
    from zmq.utils import z85

    seed = hmac.new(key, b"pdserve-curve/" + role.encode(), hashlib.sha256).digest()
    secret = z85.encode(seed)  # Curve25519 takes any 32 bytes as a secret key
    return zmq.curve_public(secret), secret


class _AllowOne:
    """ZAP credentials provider: only the client key derived from the internal key gets in."""

    def __init__(self, public: bytes) -> None:
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        ok = hmac.compare_digest(key, self.public)
        if not ok:
            log.warning("refused a ZMQ peer that does not hold the internal key")
        return ok


_authenticators: dict[int, Any] = {}
_auth_lock = threading.Lock()
ZAP_DOMAIN = "pdserve"


def _ensure_authenticator(context: Any, client_public: bytes) -> None:
    """One ZAP handler thread per ZMQ context, started on its first secured server socket."""
    from zmq.auth.thread import ThreadAuthenticator

    with _auth_lock:
        if id(context) in _authenticators:
            return
        auth = ThreadAuthenticator(context, log=logging.getLogger("pdserve.auth.zap"))
        auth.start()
        auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_AllowOne(client_public))
        _authenticators[id(context)] = auth


def stop_authenticator(context: Any) -> None:
    """Stop a context's ZAP thread (before `context.term()`)."""
    with _auth_lock:
        auth = _authenticators.pop(id(context), None)
    if auth is not None:
        auth.stop()


def secure_server(socket: Any, key: bytes | None) -> None:
    """Make a bound ZMQ socket a CURVE server admitting only key holders; call before bind().
    Without a key the socket stays plain (insecure mode, logged by the caller)."""
    if key is None:
        return
    import zmq

    public, secret = curve_keypair(key, "server")
    client_public, _ = curve_keypair(key, "client")
    _ensure_authenticator(socket.context, client_public)
    socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_server = True


def secure_client(socket: Any, key: bytes | None) -> None:
    """Make a connecting ZMQ socket a CURVE client of a `secure_server`; call before connect()."""
    if key is None:
        return
    server_public, _ = curve_keypair(key, "server")
    public, secret = curve_keypair(key, "client")
    socket.curve_serverkey = server_public
    socket.curve_publickey = public
    socket.curve_secretkey = secret
