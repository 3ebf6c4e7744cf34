"""Atomic file writes: a crash never leaves a half-written result that looks complete."""

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write through a temporary file renamed into place. The file gets the mode the user's umask
    gives new files (0644 under the usual 022), as any other program's output would: a team's shared
    results folder stays readable to the team."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, 0o666 & ~_umask())
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0o22)  # reading the umask means setting it: set it back at once
    os.umask(mask)
    return mask


def atomic_write_json(path: str | os.PathLike, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    with open(path) as f:
        return json.load(f)


def safe_name(name: str) -> str:
    """A name reduced to `[A-Za-z0-9._-]`, never empty, never `.` or `..`."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "", str(name))
    return cleaned if cleaned.strip(".") else f"_{cleaned}"


def inside(base: str | os.PathLike, name: str) -> Path:
    """base/name, checked to lie under base (a hostile name cannot climb out of it)."""
    root = Path(base).resolve()
    path = (root / name).resolve()
    if path == root or root not in path.parents:
        raise ValueError(f"{name!r} would leave {root}")
    return path
