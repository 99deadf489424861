"""Names for what our processes leave in shared folders: zmq ipc:// socket files in the temp
folder and shared-memory segments in /dev/shm.

Each owner removes its own at shutdown, but one killed outright (SIGKILL, the OOM killer, a whole
process group killed at once) cannot, and its files stayed for good: about thirty sockets and ten
16 MB segments per `make test`, a set per crashed `pdserve up`. So each name carries its owner's pid
and pid namespace, and the first name a process asks for removes the ones whose owner is gone:
only this user's, of this pid namespace (where a pid names the same process), whose pid no longer
runs. A file whose owner still runs is never touched.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import tempfile
import threading
import uuid

log = logging.getLogger(__name__)

SHM_FOLDER = "/dev/shm"  # where Linux keeps POSIX shared memory by name
# pdserve-<kind>-<pid namespace>-<pid>-<12 hex>[.sock]
_NAME = re.compile(r"pdserve-[a-z]+-(\d+)-(\d+)-[0-9a-f]{12}(?:\.sock)?")
_swept = False
_sweep_lock = threading.Lock()


def pid_namespace() -> str:
    """This process's pid namespace as a number ("0" where /proc does not say)."""
    try:
        link = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return "0"
    digits = re.search(r"\d+", link)
    return digits.group(0) if digits else "0"


def owned_name(kind: str, suffix: str = "") -> str:
    """A fresh name for a socket file or segment this process creates (kind: a lowercase word)."""
    sweep_stale()
    return f"pdserve-{kind}-{pid_namespace()}-{os.getpid()}-{uuid.uuid4().hex[:12]}{suffix}"


def socket_path(kind: str) -> str:
    """A fresh socket file path in the temp folder for an endpoint this process binds."""
    return os.path.join(tempfile.gettempdir(), owned_name(kind, ".sock"))


def segment_name(kind: str) -> str:
    """A fresh name for a shared-memory segment this process creates. Where segments are not files
    in /dev/shm (macOS, whose names stop at 31 characters), a short random one that no sweep finds."""
    if os.path.isdir(SHM_FOLDER):
        return owned_name(kind)
    return f"pdsq_{uuid.uuid4().hex[:16]}"


def remove_socket(address: str) -> None:
    """Delete the file an ipc:// address (or a bare socket path) left: closing a socket does not.
    Nothing for a tcp:// address or a file already gone."""
    if address.startswith("tcp://"):
        return
    try:
        os.unlink(address.removeprefix("ipc://"))
    except OSError:
        pass


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def stale_files(folder: str, sockets: bool) -> list[str]:
    """Our files in `folder` (sockets, or else regular files) whose owner no longer runs."""
    namespace, uid, me = pid_namespace(), os.getuid(), os.getpid()
    found = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return found
    for entry in entries:
        match = _NAME.fullmatch(entry.name)
        if match is None or match.group(1) != namespace:
            continue
        pid = int(match.group(2))
        if pid == me or _running(pid):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        kind_ok = stat.S_ISSOCK(st.st_mode) if sockets else stat.S_ISREG(st.st_mode)
        if kind_ok and st.st_uid == uid:
            found.append(entry.path)
    return found


def sweep_stale(force: bool = False) -> int:
    """Remove the stale sockets and segments, once per process (again with force); how many went."""
    global _swept
    with _sweep_lock:
        if _swept and not force:
            return 0
        _swept = True
    removed = 0
    for path in stale_files(tempfile.gettempdir(), sockets=True) + stale_files(SHM_FOLDER, sockets=False):
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    if removed:
        log.debug("removed %d socket files and segments of killed processes", removed)
    return removed
