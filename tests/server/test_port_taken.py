"""A port that `pdserve serve` cannot listen on stops it with the port's name, and it never says it is ready."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from pdserve.engine.server.rank_ports import RankPortError, bind_all, listen_all
from support.server import free_port


def test_a_taken_port_is_refused_before_the_model_loads(model_dir):
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        proc = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--model", model_dir("llama"), "--host",
                               "127.0.0.1", "--port", str(port), "--dtype", "float32"],
                              capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONSAFEPATH="1"))
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert f"cannot listen on 127.0.0.1:{port} (--port)" in proc.stderr, proc.stderr
    # Refused before the weights load (they log "loaded ..."), and never announced as serving.
    assert "ready on" not in proc.stdout and "loaded " not in proc.stderr, (proc.stdout, proc.stderr)


def test_a_port_another_socket_listens_on_after_the_bind_is_named_and_nothing_stays_open():
    # Two sockets with SO_REUSEADDR may both bind a port while neither listens, so a port taken
    # while a model loads passes the bind and fails only at listen(): that is where serve checks it.
    port = free_port()
    sockets = bind_all("127.0.0.1", {port: "--port"})
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", port))
        other.listen()
        with pytest.raises(RankPortError, match=f"cannot listen on 127.0.0.1:{port}"):
            listen_all(sockets, 16)
    assert all(s.fileno() == -1 for s in sockets)  # closed, not left bound
    # Free again: ours listens and accepts.
    ours = listen_all(bind_all("127.0.0.1", {port: "--port"}), 16)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        for s in ours:
            s.close()
