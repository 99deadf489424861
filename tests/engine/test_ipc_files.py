"""What a killed process leaves behind (socket files, shared-memory segments) goes at the next start.

Real processes: a child makes the tensor-parallel message queue (a segment in /dev/shm and a zmq
socket file) and its whole process group is SIGKILLed, as when a pod or `pdserve up` is killed; a
second process then starts and must remove those files, and nothing of a process still running.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from pdserve.engine import ipc_files

MAKE_QUEUE = """
import json, signal, sys, time
from pdserve.engine.executor.shm_queue import ShmMessageQueue
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # as our servers do: exit through the finalizers
q = ShmMessageQueue.create(1)
h = q.handle()
print(json.dumps({"socket": h.zmq_address[len("ipc://"):], "segment": h.shm_name}), flush=True)
time.sleep(600)
"""

NEXT_START = "from pdserve.engine import ipc_files; ipc_files.socket_path('input')"


def start_queue_owner() -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, "-c", MAKE_QUEUE], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    line = proc.stdout.readline()
    assert line, "the queue owner printed nothing"
    return proc, json.loads(line)


def files_of(names: dict) -> list[str]:
    return [names["socket"], os.path.join(ipc_files.SHM_FOLDER, names["segment"])]


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.skipif(not os.path.isdir(ipc_files.SHM_FOLDER), reason="segments are files in /dev/shm on Linux only")
def test_a_killed_process_group_s_queue_files_go_at_the_next_start_and_a_live_one_s_stay():
    killed, killed_names = start_queue_owner()
    live, live_names = start_queue_owner()
    try:
        os.killpg(killed.pid, signal.SIGKILL)  # its resource tracker too: nothing of it cleans up
        killed.wait(timeout=10)
        time.sleep(0.2)
        for path in files_of(killed_names) + files_of(live_names):
            assert os.path.exists(path), path
        subprocess.run([sys.executable, "-c", NEXT_START], check=True, timeout=60)
        for path in files_of(killed_names):
            assert not os.path.exists(path), f"{path} of a killed process was left"
        for path in files_of(live_names):
            assert os.path.exists(path), f"{path} of a running process was removed"
    finally:
        for proc in (killed, live):
            if proc.poll() is None:
                proc.terminate()  # SIGTERM: the queue's finalizer removes its files at exit
                proc.wait(timeout=30)
    for path in files_of(live_names):
        assert not os.path.exists(path), f"{path} outlived its owner's clean exit"


def bound_socket(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    return s


@pytest.fixture
def short_dir():
    """A folder short enough for socket paths (sockaddr_un holds 108 bytes; pytest's tmp_path is long)."""
    path = tempfile.mkdtemp(prefix="ipc-", dir="/tmp")
    yield pathlib.Path(path)
    shutil.rmtree(path, ignore_errors=True)


def test_only_this_user_s_sockets_of_dead_processes_in_this_pid_namespace_are_stale(short_dir):
    tmp_path = short_dir
    ns, gone = ipc_files.pid_namespace(), dead_pid()
    stale = str(tmp_path / f"pdserve-input-{ns}-{gone}-0123456789ab.sock")
    kept = {
        "mine": str(tmp_path / f"pdserve-input-{ns}-{os.getpid()}-0123456789ab.sock"),
        "live parent": str(tmp_path / f"pdserve-output-{ns}-{os.getppid()}-0123456789ab.sock"),
        "other namespace": str(tmp_path / f"pdserve-input-{int(ns) + 1}-{gone}-0123456789ab.sock"),
        "not ours": str(tmp_path / f"other-input-{ns}-{gone}-0123456789ab.sock"),
    }
    sockets = [bound_socket(p) for p in [stale, *kept.values()]]
    regular = tmp_path / f"pdserve-queue-{ns}-{gone}-ba9876543210"
    regular.write_bytes(b"x")
    try:
        assert ipc_files.stale_files(str(tmp_path), sockets=True) == [stale]
        assert ipc_files.stale_files(str(tmp_path), sockets=False) == [str(regular)]
    finally:
        for s in sockets:
            s.close()


def test_names_carry_their_owner(monkeypatch, tmp_path):
    monkeypatch.setattr(ipc_files.tempfile, "gettempdir", lambda: str(tmp_path))
    path = ipc_files.socket_path("input")
    name = os.path.basename(path)
    assert os.path.dirname(path) == str(tmp_path)
    assert name.startswith(f"pdserve-input-{ipc_files.pid_namespace()}-{os.getpid()}-") and name.endswith(".sock")
    assert ipc_files.socket_path("input") != path
    assert len(name) < 60  # with the usual temp folder, well inside sockaddr_un's 108 bytes


def test_remove_socket_takes_an_ipc_address_or_a_path_and_leaves_tcp_alone(short_dir):
    by_address, by_path = str(short_dir / "a.sock"), str(short_dir / "b.sock")
    sockets = [bound_socket(by_address), bound_socket(by_path)]
    try:
        ipc_files.remove_socket(f"ipc://{by_address}")
        ipc_files.remove_socket(by_path)
        assert not os.path.exists(by_address) and not os.path.exists(by_path)
        ipc_files.remove_socket(by_path)  # already gone: no error
        ipc_files.remove_socket("tcp://127.0.0.1:5555")
    finally:
        for s in sockets:
            s.close()
