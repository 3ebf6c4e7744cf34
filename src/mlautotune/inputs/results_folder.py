"""The results folder of a session: whose it is (session.json), the lock held while a process tunes
there, and the archive of a previous session's files when the user starts afresh (overwrite=true).

The tool's own entries are known by name (MANIFEST, and experiment folders holding the cmd.txt or
exp.json the tool writes before each launch): only those are ever archived. A folder that holds
anything else is refused as a results folder, and so are the working folder, the script's folder
and the tracking store's folder, so a user's file is never moved."""

import os
import re
import socket
from datetime import datetime
from pathlib import Path
from typing import Optional

from mlautotune.errors import UserError
from mlautotune.files import inside, read_json, safe_name

SESSION_FILE = "session.json"
LOCK_FILE = ".session.lock"
KEEP_ON_ARCHIVE = (LOCK_FILE, "optuna.db", "previous_sessions")
# Every top-level name the tool writes in a results folder (besides experiment folders).
MANIFEST = {SESSION_FILE, LOCK_FILE, "optuna.db", "optuna.db-journal", "optuna.db-wal", "optuna.db-shm", "launches.log", "config.yaml",
            "summary.txt", "ds_config_optimal.json", "cmd_optimal.txt", "trials.csv", "plots", "exps", "previous_sessions"}
EXPERIMENT_FOLDER = re.compile(r"z[0-3]_gas[0-9]+_tmbspg[0-9]+[A-Za-z0-9._-]*|final_training")


def tool_wrote(entry: Path) -> bool:
    """True for an entry of a results folder that the tool writes (by name; experiment folders by name and content)."""
    if entry.name in MANIFEST or entry.name.startswith((".write-test-", f".{SESSION_FILE}.")):
        return True
    return entry.is_dir() and not entry.is_symlink() and EXPERIMENT_FOLDER.fullmatch(entry.name) is not None and \
        any((entry / n).exists() for n in ("cmd.txt", "exp.json", "result.json"))


def check_results_folder(results_dir: Path, overwrite: bool, others: dict) -> None:
    """Refuse a results folder that is one of the user's own folders (`others`: what -> folder, e.g. the
    working folder), or that holds files the tool did not write (unless it resumes its own session there)."""
    here = results_dir.resolve()
    for what, folder in others.items():
        if folder is not None and Path(folder).resolve() == here:
            raise UserError(f"autotuning.results_dir {str(results_dir)!r} is {what}. A results folder is the tool's own: starting afresh "
                            "(overwrite=true) archives what is in it, and a session's files would mix with yours.",
                            "Set autotuning.results_dir to a folder of its own, e.g. autotuning.results_dir=autotuning_results.")
    if not results_dir.is_dir() or (not overwrite and (results_dir / SESSION_FILE).exists()):
        return
    foreign = sorted(e.name for e in results_dir.iterdir() if not tool_wrote(e))
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise UserError(f"The results folder {str(results_dir)!r} holds files that mlautotune did not write ({shown}); "
                        + ("overwrite=true would archive the folder's contents." if overwrite else "it is not a tuning session's folder."),
                        "Set autotuning.results_dir to a new or empty folder (or to a previous session's results folder), or move those files out.")


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
        if entry.name not in KEEP_ON_ARCHIVE and not entry.name.startswith(".write-test") and tool_wrote(entry):
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
