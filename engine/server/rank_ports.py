"""Per-rank ports: `pdserve serve --data-parallel-size N --rank-port-base B` also listens on B+r.

An inference gateway (the Gateway API Inference Extension's InferencePool, with one targetPort per
rank) sees a data-parallel pod as N endpoints, and its picker names the one it chose as an
address, host:port. The port is then the only thing that can carry the choice: a request arriving
on B+r runs on data-parallel rank r, with no header and no key.

That is safe without a key for the same reason `X-PDServe-DP-Rank` from a client is harmless
(engine/server/dp_rank.py): a placement asks for nothing the pod would not do anyway. Everything
else is the one app behind every port: API key, body limit, the internal-key rule for
kv_transfer_params and the request limits apply on a rank port exactly as on the main port.

On a rank port `X-PDServe-DP-Rank` is ignored, even with the internal key, and the port wins.
Only pdserve's own router pins by header, and it sends to the main port; a request on a rank port
came through a gateway, whose upstream address the picker chose and no client can forge, while its
headers may be the client's own, passed through next to an internal key the picker added for the
decode leg. Refusing the conflict (400) would let any client break its own routed request for
nothing; trusting the header would let it override the picker.

/health and /metrics answer on every port. On a rank port they speak for that rank: /health is
503 when that rank's core is unresponsive (the other ranks' ports keep serving), and /metrics
keeps only that rank's series (`engine` label), since a picker scraping B+r takes the first
`vllm:num_requests_waiting` it finds as the endpoint's own.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

MAX_PORT = 65535


@dataclass(frozen=True)
class RankPorts:
    base: int
    size: int  # the data-parallel size: ranks 0..size-1 listen on base..base+size-1

    @property
    def ports(self) -> range:
        return range(self.base, self.base + self.size)

    def rank_of(self, scope: Mapping[str, Any]) -> int | None:
        """The rank whose port the connection arrived on, or None (the main port). The ASGI server
        fills `server` from the listening socket's own address, never from anything the client sent."""
        server = scope.get("server")
        if not server or len(server) < 2 or not isinstance(server[1], int):
            return None
        rank = server[1] - self.base
        return rank if 0 <= rank < self.size else None

    def describe(self) -> str:
        return f"{self.base}-{self.base + self.size - 1} (data-parallel ranks 0-{self.size - 1})"


def check_rank_ports(base: int, data_parallel_size: int, main_port: int,
                     other_ports: Mapping[str, int] | None = None) -> str | None:
    """What is wrong with `--rank-port-base base`, or None. `other_ports` names further fixed ports
    of this server (flag -> port; 0 means chosen by the OS and cannot clash)."""
    if data_parallel_size < 2:
        return ("--rank-port-base needs --data-parallel-size 2 or more: with a single rank every request "
                "already runs on rank 0, so use the main --port")
    last = base + data_parallel_size - 1
    if base < 1 or last > MAX_PORT:
        return (f"--rank-port-base {base} with --data-parallel-size {data_parallel_size} needs ports {base}-{last}; "
                f"ports are 1-{MAX_PORT}")
    for flag, port in {"--port": main_port, **(other_ports or {})}.items():
        if port and base <= port <= last:
            return (f"--rank-port-base {base} with --data-parallel-size {data_parallel_size} takes ports "
                    f"{base}-{last}, which include {flag} {port}; pick a base outside it")
    return None


class RankPortError(OSError):
    pass


def _listener(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As uvicorn binds: a restarted server must not wait out TIME_WAIT of its last connections.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        return sock
    except BaseException:
        sock.close()
        raise


def bind_all(host: str, ports: Mapping[int, str]) -> list[socket.socket]:
    """Bound sockets for every port (port -> what it is, for the error), or RankPortError naming the
    one that failed, with none left open."""
    bound: list[socket.socket] = []
    with _closed_on_failure(bound):
        for port, what in ports.items():
            try:
                bound.append(_listener(host, port))
            except OSError as exc:
                raise RankPortError(f"cannot listen on {host}:{port} ({what}): {exc.strerror or exc}") from None
    return bound


def listen_all(sockets: list[socket.socket], backlog: int) -> list[socket.socket]:
    """`sockets` listening, or RankPortError naming the first that could not, with none left open.

    A bind can succeed while another process holds the port: two sockets with SO_REUSEADDR may
    both bind one port so long as neither listens. The second listen() is the one that fails."""
    with _closed_on_failure(sockets):
        for sock in sockets:
            try:
                sock.listen(backlog)
            except OSError as exc:
                host, port = sock.getsockname()[:2]
                raise RankPortError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sockets


@contextlib.contextmanager
def _closed_on_failure(sockets: list[socket.socket]) -> Iterator[None]:
    """Close every socket in `sockets` (as it stands then) if the block raises."""
    try:
        yield
    except BaseException:
        for sock in sockets:
            sock.close()
        raise


def probe(host: str, ports: Mapping[int, str]) -> None:
    """Fail now, before a model loads for minutes, when a port is already taken (RankPortError)."""
    for sock in bind_all(host, ports):
        sock.close()


def server_ports(main_port: int, rank_ports: RankPorts) -> dict[int, str]:
    return {main_port: "--port", **{p: f"data-parallel rank {r}" for r, p in enumerate(rank_ports.ports)}}
