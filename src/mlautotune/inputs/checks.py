"""Checks of a session's inputs: each raises a UserError that names the problem and the fix (no traceback,
nothing written). Nothing here starts an experiment or opens a store for writing."""

import os
import shlex
import tempfile
from pathlib import Path
from typing import List, Optional

from mlautotune.errors import UserError
from mlautotune.inputs.config import Resources


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


def check_storage(storage: str) -> None:
    """search.storage must be a database URL Optuna can open (checked without connecting)."""
    from sqlalchemy.engine import make_url

    try:
        url = make_url(storage)
        url.get_dialect()
    except Exception as e:
        raise UserError(f"search.storage={storage!r} is not a database URL Optuna can use ({str(e).splitlines()[0]}).", "Use a URL like sqlite:///path/optuna.db or postgresql://user@host/db, or leave search.storage unset for sqlite in results_dir.")
    if url.get_backend_name() == "sqlite" and url.database:
        folder = Path(url.database).expanduser().absolute().parent
        if not nearest_existing(folder).is_dir():
            raise UserError(f"search.storage={storage!r} points into {str(folder)!r}, which is not a folder.", "Point the sqlite URL at a file in an existing folder.")


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
    if r.hostfile is not None:
        path = Path(r.hostfile).expanduser()
        if not path.is_file():
            raise UserError(f"The hostfile {str(path)!r} does not exist.", "Pass launcher.hostfile=<path> to a file of lines like 'worker-1 slots=8', or leave it unset on one node.")
        from deepspeed.launcher.runner import fetch_hostfile

        try:
            pool = fetch_hostfile(str(path))
        except ValueError as e:
            raise UserError(f"The hostfile {str(path)!r} is malformed: {e}.", "Each line must read '<hostname> slots=<number of GPUs>'.")
        if not pool:
            raise UserError(f"The hostfile {str(path)!r} lists no hosts.", "Each line must read '<hostname> slots=<number of GPUs>'.")
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

    if not create and urlparse(uri).scheme in ("", "file", "sqlite"):
        return  # opening these would create the store; plan writes nothing

    try:
        _get_store(uri)
    except Exception as e:
        raise UserError(f"The MLflow tracking URI {uri!r} cannot be used: {str(e).splitlines()[0]}", "Use a URI like http://127.0.0.1:5000, sqlite:///mlflow.db or a folder path, via tracking.tracking_uri or MLFLOW_TRACKING_URI.")
