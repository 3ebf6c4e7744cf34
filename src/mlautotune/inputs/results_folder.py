"""The results folder of a session: whose it is (session.json), the lock held while a process tunes
there, and the archive of a previous session's files when the user starts afresh (overwrite=true)."""

import os
import socket
from datetime import datetime
from pathlib import Path
from typing import Optional

from mlautotune.errors import UserError
from mlautotune.files import inside, read_json, safe_name

SESSION_FILE = "session.json"
LOCK_FILE = ".session.lock"
KEEP_ON_ARCHIVE = (LOCK_FILE, "optuna.db", "previous_sessions")


class SessionLock:
    """An exclusive lock (fcntl.flock) on results_dir for as long as this process tunes there.
    The lock file names the holder (pid, host, session). The kernel drops the lock when the
    process dies, so a killed session never blocks its resume.

    Workers of one session (`mlautotune worker`) on the same folder share the lock (`shared`): they
    exclude a `tune` there, not each other."""

    def __init__(self, results_dir: Path, session: str, shared: bool = False):
        self.path = results_dir / LOCK_FILE
        self.session = session
        self.shared = shared
        self._fd: Optional[int] = None

    def acquire(self) -> "SessionLock":
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise UserError(
                f"The results folder {str(self.path.parent)!r} is in use by {holder}. Two sessions in one folder would mark "
                "each other's experiments interrupted and overwrite each other's files.",
                "Wait for that session to end (or stop it), or set autotuning.results_dir to another folder.",
            )
        os.ftruncate(fd, 0)  # a worker names itself: any of the workers is a fair answer to "who holds it"
        os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()} (session {self.session}, since {datetime.now():%Y-%m-%d %H:%M:%S})\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def archive_previous_session(results_dir: Path) -> None:
    """overwrite=true: the previous session's files move to previous_sessions/<its name>/, so the
    new session's experiment folders are its own (nothing is deleted)."""
    record = results_dir / SESSION_FILE
    if not record.exists():
        return
    try:
        old = safe_name(str(read_json(record).get("session") or "unknown"))
    except (OSError, ValueError):
        old = "unknown"
    target = inside(results_dir / "previous_sessions", old)
    if target.exists():
        target = target.with_name(f"{old}-{datetime.now():%Y%m%d-%H%M%S}")
    target.mkdir(parents=True)
    for entry in results_dir.iterdir():
        if entry.name not in KEEP_ON_ARCHIVE and not entry.name.startswith(".write-test"):
            entry.rename(target / entry.name)


def check_owner(results_dir: Path, name: str, overwrite: bool) -> None:
    path = results_dir / SESSION_FILE
    if overwrite or not path.exists():
        return
    owner = read_json(path).get("session")
    if owner and owner != name:
        raise UserError(
            f"The results directory {str(results_dir)!r} holds another tuning session ({owner}) whose settings differ from this one's ({name}).",
            "Set autotuning.results_dir to a new folder to keep both, or autotuning.overwrite=true to start afresh there.",
        )
