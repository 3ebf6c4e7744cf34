"""Checks of a session's inputs: each raises a UserError that names the problem and the fix (no traceback,
nothing written). Nothing here starts an experiment or opens a store for writing."""

import os
import shlex
import tempfile
from pathlib import Path
from typing import List, Optional

from mlautotune.errors import UserError
from mlautotune.inputs.config import Resources
from mlautotune.redact import redact_text


def given_path(value: Optional[str], key: str, what: str, bundled: Path) -> Path:
    """None -> the bundled file; an empty value is a mistake (it would silently tune the bundled example)."""
    if value is None:
        return bundled
    if not str(value).strip():
        raise UserError(f"{key}= is given but empty.", f"Pass {key}=<path to {what}>, or leave {key} out entirely to use the bundled example.")
    return Path(value).expanduser()


def is_hf_trainer(script: Path, script_args: List[str]) -> bool:
    """A Hugging Face Trainer script: it takes --deepspeed and uses transformers' Trainer."""
    from mlautotune.inputs.scriptargs import get_flag

    if get_flag(script_args, "--deepspeed") is None:
        return False
    try:
        text = script.read_text(errors="replace")
    except OSError:
        return False
    return "transformers" in text and "Trainer" in text


def check_mp_size(mp: int, ws: int) -> None:
    if mp > ws or ws % mp:
        raise UserError(f"autotuning.mp_size={mp} " + (f"is larger than the {ws} ranks of this launch." if mp > ws else f"does not divide the {ws} ranks of this launch."), f"Use an mp_size that divides {ws} (1 without model parallelism), or launch more ranks (launcher.num_gpus/num_nodes).")


STORAGE_FIX = "Use a URL like sqlite:///path/optuna.db or postgresql://user:password@host:5432/db, or leave search.storage unset for sqlite in results_dir."
DRIVERS = {"mysql": "mysqlclient", "postgresql": "psycopg2-binary"}  # the packages of SQLAlchemy's default drivers


def check_storage(storage: str, create: bool = False) -> None:
    """search.storage must be a database URL Optuna can open and keep: its driver installed, a sqlite
    file in a folder that can be written, a server that answers (`create`: the session will write there)."""
    from sqlalchemy.engine import make_url

    shown = redact_text(storage)
    try:
        url = make_url(storage)
        dialect = url.get_dialect()
    except Exception as e:
        raise UserError(f"search.storage={shown!r} is not a database URL Optuna can use ({redact_text(str(e).splitlines()[0])}).", STORAGE_FIX)
    backend = url.get_backend_name()
    if backend == "sqlite" and (not url.database or url.database == ":memory:"):
        raise UserError(f"search.storage={shown!r} is an in-memory sqlite database: the study would be lost with the process, and an interrupted session could not resume.",
                        "Give a file, e.g. search.storage=sqlite:///optuna.db, or leave search.storage unset for sqlite in results_dir.")
    try:
        dialect.import_dbapi()
    except ImportError as e:
        driver = url.get_driver_name()
        install = f"pip install {DRIVERS[backend]}" if backend in DRIVERS and "+" not in url.drivername else f"install the Python package of the {driver} driver"
        raise UserError(f"search.storage={shown!r} needs the {backend} driver {driver!r}, which is not installed ({e}).",
                        f"Install it ({install}), name an installed driver in the URL (e.g. postgresql+psycopg://), or leave search.storage unset for sqlite in results_dir.")
    if backend == "sqlite":
        folder = Path(url.database).expanduser().absolute().parent
        if not nearest_existing(folder).is_dir():
            raise UserError(f"search.storage={shown!r} points into {str(folder)!r}, which is not a folder.", "Point the sqlite URL at a file in an existing folder.")
        if create:
            _check_sqlite_writable(Path(url.database).expanduser().absolute(), shown)
        return
    if create:
        _check_server(url, shown)


def _check_sqlite_writable(db: Path, shown: str) -> None:
    base = nearest_existing(db.parent)
    try:
        with tempfile.TemporaryFile(dir=base):
            pass
        if db.exists():
            with open(db, "ab"):
                pass
    except OSError as e:
        raise UserError(f"search.storage={shown!r}: the study's sqlite file cannot be written in {str(base)!r} ({e.strerror}); sqlite also needs to write its journal beside the file.",
                        "Point search.storage at a file in a folder you can write to, or leave it unset for sqlite in results_dir.")


def _check_server(url, shown: str) -> None:
    """Connect once, with a short timeout, so that a server that is down gets one paragraph, not a traceback."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import SQLAlchemyError

    where = f"{url.host or 'localhost'}:{url.port or 'default port'}"
    try:
        engine = create_engine(url, connect_args={"connect_timeout": CONNECT_TIMEOUT_S} if url.get_backend_name() in ("postgresql", "mysql") else {})
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        finally:
            engine.dispose()
    except SQLAlchemyError as e:
        reason = redact_text(" ".join(str(getattr(e, "orig", None) or e).split())[:300])
        raise UserError(f"The Optuna storage's {url.get_backend_name()} server at {where} (search.storage={shown!r}) cannot be reached: {reason}.",
                        "Check that the database server runs and that host, port, user and password are right, or leave search.storage unset for sqlite in results_dir.")


CONNECT_TIMEOUT_S = 5


def store_folder(uri: Optional[str]) -> Optional[Path]:
    """The local folder a store lives in: a sqlite file's folder, a file store's own folder; None for a server."""
    from urllib.parse import unquote, urlparse

    if not uri:
        return None
    if uri.startswith("sqlite:///"):
        path = unquote(uri[len("sqlite:///"):]) or None
        return Path(path).expanduser().absolute().parent if path and path != ":memory:" else None
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return Path(unquote(parsed.path)).absolute()
    return Path(uri).expanduser().absolute() if parsed.scheme == "" else None


def check_script(script: Path) -> Path:
    path = script.absolute()
    if path.is_dir():
        raise UserError(f"The training script {str(path)!r} is a directory.", "Pass script=<path to your training script .py>.")
    if not path.is_file():
        raise UserError(f"The training script {str(path)!r} does not exist.", "Pass script=<path to your training script .py>, or leave script unset to tune the bundled example.")
    if path.suffix != ".py":
        raise UserError(f"The training script {str(path)!r} is not a Python file (.py).", "mlautotune launches Python training scripts through the DeepSpeed launcher; pass script=<your_script.py>.")
    return path


def split_args(text: str) -> List[str]:
    try:
        return shlex.split(text or "")
    except ValueError as e:
        raise UserError(f"script_args cannot be split into arguments ({e}): {text!r}.", "Close the quote, e.g. script_args='--name \"my run\" --steps 20'.")


def _accelerator():
    from deepspeed.accelerator import get_accelerator

    return get_accelerator()


def check_resources(r: Resources) -> None:
    from deepspeed.launcher.runner import DLTS_HOSTFILE

    from mlautotune.inputs.hosts import check_selection, read_hostfile

    for key in ("include", "exclude"):
        if getattr(r, key):
            check_selection(str(getattr(r, key)), key)
    if r.hostfile is None and os.path.isfile(DLTS_HOSTFILE):
        read_hostfile(Path(DLTS_HOSTFILE))  # DeepSpeed's launcher reads it when no hostfile is given
    if r.hostfile is not None:
        path = Path(r.hostfile).expanduser()
        if not path.is_file():
            raise UserError(f"The hostfile {str(path)!r} does not exist.", "Pass launcher.hostfile=<path> to a file of lines like 'worker-1 slots=8', or leave it unset on one node.")
        pool = read_hostfile(path)
        most = max(pool.values())
        if r.num_gpus is not None and r.num_gpus > most:
            raise UserError(f"launcher.num_gpus={r.num_gpus} is more than the hosts offer (at most {most} slots per host in {path}).", f"Use launcher.num_gpus<={most}, or add slots to the hostfile.")
        if r.num_nodes is not None and r.num_nodes > len(pool):
            raise UserError(f"launcher.num_nodes={r.num_nodes} is more than the {len(pool)} hosts in {path}.", f"Use launcher.num_nodes<={len(pool)}.")
    elif r.num_gpus is not None and _accelerator().device_name() != "cpu":
        have = _accelerator().device_count()
        if r.num_gpus > have:
            raise UserError(f"launcher.num_gpus={r.num_gpus} is more than this machine's {have} devices.", f"Use launcher.num_gpus<={have}, or pass a hostfile for more nodes.")
    if r.num_gpus is not None and r.num_gpus < 1:
        raise UserError(f"launcher.num_gpus={r.num_gpus} must be at least 1.", "Pass launcher.num_gpus=<devices per node>.")


def nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(d: Path, create: bool = True) -> None:
    if not create:  # plan: the folder, or the nearest folder above it, must be writable; nothing is made
        base = nearest_existing(d)
        try:
            with tempfile.TemporaryFile(dir=base):
                return
        except OSError as e:
            raise UserError(f"The directory {str(d)!r} cannot be written ({str(base)!r}: {e.strerror}).", "Set autotuning.results_dir (or exps_dir) to a folder you can write to.")
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise UserError(f"The directory {str(d)!r} cannot be written ({e.strerror}).", "Set autotuning.results_dir (or exps_dir) to a folder you can write to.")


def check_tracking_uri(uri: Optional[str], create: bool = True) -> None:
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return
    from urllib.parse import urlparse

    from mlflow.tracking._tracking_service.utils import _get_store

    scheme = urlparse(uri).scheme
    if (scheme in ("", "file") or len(scheme) == 1) and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("true", "1"):
        raise UserError(f"The MLflow tracking URI {redact_text(uri)!r} is a file store (a folder), which MLflow 3 refuses when the first run is logged.",
                        f"Use a database instead, e.g. tracking.tracking_uri=sqlite:///{Path(uri.removeprefix('file://') or 'mlruns').name or 'mlruns'}.db "
                        "(`mlflow migrate-filestore` moves an existing folder's runs), or set MLFLOW_ALLOW_FILE_STORE=true to keep the folder.")
    if uri in ("sqlite://", "sqlite:///") or (uri.startswith("sqlite:") and uri.endswith(":memory:")):
        raise UserError(f"The MLflow tracking URI {uri!r} is an in-memory database: every run would be lost when the session ends.",
                        "Give a file, e.g. tracking.tracking_uri=sqlite:///mlflow.db.")
    if not create and scheme in ("", "file", "sqlite"):
        return  # opening these would create the store; plan writes nothing

    try:
        _get_store(uri)
    except Exception as e:
        raise UserError(f"The MLflow tracking URI {redact_text(uri)!r} cannot be used: {redact_text(str(e).splitlines()[0])}", "Use a URI like http://127.0.0.1:5000 or sqlite:///mlflow.db, via tracking.tracking_uri or MLFLOW_TRACKING_URI.")
