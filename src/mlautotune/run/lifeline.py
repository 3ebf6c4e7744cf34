"""A TCP lifeline from every rank to the tuner, so ranks on other hosts end with their experiment.

Local ranks live in the experiment's process group, which the tuner kills. Ranks that the DeepSpeed
launcher started on other nodes (pdsh, OpenMPI, Slurm) are out of reach of that kill, and a
collective may wait a long time before it notices a dead peer. So each rank holds one connection
to the tuner: when the tuner closes it (the experiment ended) or the tuner process dies (the OS
closes its sockets), the rank sees end-of-file and kills its own process group.
"""

import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

CONNECT_TIMEOUT_S = 10.0


class Lifeline:
    """The tuner's side: one listening socket per tuner process, connections grouped by experiment."""

    def __init__(self):
        self._server = socket.create_server(("", 0), backlog=64)
        self._lock = threading.Lock()
        self._conns: Dict[str, List[socket.socket]] = {}
        self._cut: set = set()  # experiments already over: a rank that connects late is cut at once
        threading.Thread(target=self._accept, name="mlautotune-lifeline", daemon=True).start()

    @property
    def address(self) -> Tuple[str, int]:
        return socket.gethostname(), self._server.getsockname()[1]

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._register, args=(conn,), daemon=True).start()

    def _register(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(CONNECT_TIMEOUT_S)
            name = conn.recv(1024).decode(errors="replace").strip()
            conn.settimeout(None)
        except OSError:
            conn.close()
            return
        with self._lock:
            if name not in self._cut:
                self._conns.setdefault(name, []).append(conn)
                return
        conn.close()

    def connected(self, name: str) -> int:
        with self._lock:
            return len(self._conns.get(name, []))

    def cut(self, name: str) -> None:
        """The experiment `name` is over: every rank still holding on ends itself."""
        with self._lock:
            self._cut.add(name)
            conns = self._conns.pop(name, [])
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


_lifeline: Optional[Lifeline] = None
_lifeline_lock = threading.Lock()


def tuner_lifeline() -> Lifeline:
    """This process's lifeline, started on first use."""
    global _lifeline
    with _lifeline_lock:
        if _lifeline is None:
            _lifeline = Lifeline()
        return _lifeline


def hold(address, name: str, on_cut: Optional[Callable[[], None]] = None) -> bool:
    """The rank's side: connect to the tuner and, in a daemon thread, wait for the line to be cut.
    Returns False if the tuner cannot be reached (the rank then relies on its process group)."""
    host = "127.0.0.1" if address[0] == socket.gethostname() else address[0]
    try:
        conn = socket.create_connection((host, int(address[1])), timeout=CONNECT_TIMEOUT_S)
        conn.sendall(name.encode() + b"\n")
        conn.settimeout(None)
    except OSError as e:
        print(f"mlautotune probe: cannot reach the tuner's lifeline at {address[0]}:{address[1]} ({e})", file=sys.stderr)
        return False

    def wait() -> None:
        try:
            while conn.recv(1024):
                pass
        except OSError:
            pass
        (on_cut or end_own_group)()

    threading.Thread(target=wait, name="mlautotune-lifeline", daemon=True).start()
    return True


def group_members(pgid: int) -> list:
    """The live (not zombie) processes of process group `pgid`."""
    import psutil

    members = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == pgid:
                members.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def end_own_group(why: str = "the tuner ended this experiment (or is gone)") -> None:
    """End this rank's experiment on this host, and every rank's shared-memory buffer here with it (a
    rank killed by another cannot remove its own). The buffers are removed before the other processes
    of the group are killed (this process may itself be ended meanwhile: a peer's death fails its
    collective), and again once they are gone (one may have created its buffer in between)."""
    import psutil

    print(f"mlautotune probe: {why}; ending this rank's processes", file=sys.stderr, flush=True)
    port = os.environ.get("MASTER_PORT")
    if port:
        release_shared_memory(port)
    def others() -> list:
        return [p for p in group_members(os.getpgrp()) if p.pid != os.getpid()]

    for p in others():
        try:
            p.kill()
        except psutil.Error:
            pass
    deadline = time.monotonic() + 2.0
    while others() and time.monotonic() < deadline:
        time.sleep(0.01)  # killed, not yet gone (a zombie counts as gone)
    if port:
        release_shared_memory(port)
    os.killpg(os.getpgrp(), signal.SIGKILL)


SHM_DIR = Path("/dev/shm")


def release_shared_memory(port, rank="*") -> None:
    """Remove the shared-memory all-reduce buffers of the experiment on master port `port`, on this host.

    DeepSpeed's CPU all-reduce (the shm comm op) creates one 66 MiB buffer per rank, named
    deepspeed_allreduce_buffer_<uid>_<master addr>_<master port>_<rank>, and never unlinks it: a
    session of 100 two-rank experiments would leave 13 GiB in /dev/shm, which is RAM. Each rank removes
    its own as it ends (on every node), and the tuner removes what is left on its host once the
    experiment is over (the port is the experiment's until then). GPU runs have no such buffers."""
    for path in SHM_DIR.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_{rank}"):
        try:
            path.unlink()
        except OSError:
            pass


def release_own_shared_memory() -> None:
    """A rank's side, as it ends: its own buffer (the other ranks' mappings stay valid; only a new open would fail)."""
    if os.environ.get("MASTER_PORT") and os.environ.get("RANK"):
        release_shared_memory(os.environ["MASTER_PORT"], os.environ["RANK"])


EXPERIMENT_MARK = "MLAUTOTUNE_EXPERIMENT"  # in the environment of every process an experiment starts


def end_strays(mark: str) -> list:
    """Kill the processes on this host that carry the experiment's mark in their environment: what the
    script forked and detached (setsid, a double fork) left its process group, so the group's kill
    missed it. Returns a line naming each (pid and command), for the experiment's log."""
    import psutil

    strays = []
    for p in psutil.process_iter(["pid", "uids"]):
        try:
            if p.pid == os.getpid() or p.info["uids"].real != os.getuid() or p.environ().get(EXPERIMENT_MARK) != mark:
                continue
            strays.append(f"pid {p.pid} ({' '.join(p.cmdline())[:200]})")
            p.kill()
        except (psutil.Error, AttributeError):
            continue
    return strays
