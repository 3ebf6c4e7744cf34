"""A tuning session: the validated inputs, its identity, where it writes, and how it builds experiments."""

import hashlib
import json
import os
import shlex
import socket
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Optional

import optuna
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from mlautotune import config as configlib
from mlautotune.errors import UserError
from mlautotune.experiment import Experiment, Resources, Result, run_experiment, world_size
from mlautotune.files import atomic_write_json, inside, read_json, safe_name
from mlautotune.measure import thread_env, usable_cores
from mlautotune.ops import accelerator_name
from mlautotune.redact import remember_secrets
from mlautotune.search import SearchSettings
from mlautotune.space import TuningPlan, build_plan, experiment_config, experiment_name

PACKAGE_DIR = Path(__file__).parent
BUNDLED_CONFIG = PACKAGE_DIR / "examples" / "ds_config.json"
BUNDLED_SCRIPT = PACKAGE_DIR / "workloads" / "gpt.py"
SESSION_FILE = "session.json"
# Settings that do not change what a session measures: changing them resumes the same session.
NOT_IDENTITY = ("results_dir", "exps_dir", "overwrite", "tuner_num_trials", "tuner_early_stopping", "experiment_timeout", "final_training_timeout")


@dataclass
class Session:
    cfg: DictConfig  # the final settings (conf < ds_config autotuning < command line)
    ds_config_path: Path
    ds_config: Dict[str, Any]  # the user's ds_config as loaded (keys normalised)
    plan: TuningPlan
    script: Path
    script_args: List[str]
    resources: Resources
    world_size: int
    results_dir: Path
    exps_dir: Path
    name: str
    storage: str
    memory_limit_bytes: int
    device: str
    lock: Optional["SessionLock"] = None  # held while this process works on results_dir
    worker: bool = False  # one of several workers on the session (`mlautotune worker`)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    @property
    def at(self) -> DictConfig:
        return self.cfg.autotuning

    def search_settings(self) -> SearchSettings:
        node = self.cfg.search.sampler or self.cfg.tuners[self.at.tuner_type]  # conf/tuner/<tuner_type>.yaml
        sampler = OmegaConf.to_container(node, resolve=True)
        return SearchSettings(
            metric=self.at.metric,
            tuner_type=self.at.tuner_type,
            seed=self.cfg.search.seed,
            early_stopping=self.at.tuner_early_stopping,
            num_trials=self.at.tuner_num_trials,
            num_tuning_micro_batch_sizes=self.at.num_tuning_micro_batch_sizes,
            remeasure=self.cfg.search.remeasure,
            memory_limit_bytes=self.memory_limit_bytes,
            world_size=self.world_size,
            device=self.device,
            sampler_target=sampler,
            alone=not self.worker,
        )

    @property
    def pin_cpu_ranks(self) -> bool:
        """CPU ranks get cores of their own; several workers on one machine would all take the first
        ones, so a worker pins only when it was started on a part of the machine (taskset, a cpuset)."""
        return bool(self.cfg.measure.pin_cpu_ranks) and (not self.worker or usable_cores() < (os.cpu_count() or 1))

    def make_experiment(self, params: Dict[str, Any]) -> Experiment:
        stage, mbs, gas = params["stage"], params["micro_batch"], params["gas"]
        knobs = {k: v for k, v in params.items() if k not in ("stage", "micro_batch", "gas")}
        return Experiment(
            name=experiment_name(stage, gas, mbs, knobs),
            ds_config=experiment_config(self.plan, stage, mbs, knobs),
            script=str(self.script),
            script_args=list(self.script_args),
            resources=self.resources,
            params=dict(params),
            arg_mappings=dict(self.plan.arg_mappings),
            start_profile_step=self.at.start_profile_step,
            end_profile_step=self.at.end_profile_step,
            memory_limit_bytes=self.memory_limit_bytes,
            timeout_s=self.at.experiment_timeout,
            env=thread_env(self.device, local_ranks(self.resources, self.world_size), list(self.resources.launcher_args), pin=self.pin_cpu_ranks),
            measure=OmegaConf.to_container(self.cfg.measure, resolve=True),
        )

    def run(self, exp: Experiment) -> Result:
        """Launch one experiment; its description also goes to exps_dir, as DeepSpeed's tuner does."""
        atomic_write_json(inside(self.exps_dir, f"{exp.name}.json"), {"name": exp.name, "params": exp.params, "ds_config": exp.ds_config})
        with open(self.results_dir / "launches.log", "a") as f:
            f.write(f"{datetime.now().isoformat(timespec='seconds')} {exp.name}\n")
        return run_experiment(exp, self.results_dir)

    def shared_storage(self) -> optuna.storages.BaseStorage:
        """The storage as workers open it: with heartbeats every search.heartbeat_seconds, so the trial
        of a worker that died is failed after 4 missed beats and run again by another."""
        from sqlalchemy.exc import OperationalError

        from mlautotune.cluster import storage
        from mlautotune.redact import redact_text

        beat = self.cfg.search.heartbeat_seconds
        try:
            return storage(self.storage, beat, 4 * beat)
        except OperationalError as e:
            reason = redact_text(str(e.orig or e).strip().splitlines()[0])
            raise UserError(f"The shared study's database search.storage={redact_text(self.storage)} cannot be reached: {reason}.",
                            "Check that the database server runs (`bash scripts/services.sh status DIR`) and that the URL, with its password, is the one in DIR/env.sh.")

    def open_study(self, store: Optional[optuna.storages.BaseStorage] = None) -> optuna.Study:
        direction = "minimize" if self.at.metric == "latency" else "maximize"
        try:
            return optuna.create_study(storage=store or self.storage, study_name=self.name, direction=direction, load_if_exists=True)
        except ValueError as e:
            raise UserError(f"The Optuna study {self.name!r} in {self.storage} cannot be used: {e}.", "Pick another search.session name or storage.")

    def write_record(self, **fields: Any) -> None:
        path = self.results_dir / SESSION_FILE
        record = read_json(path) if path.exists() else {}
        record.update(fields)
        record.update(session=self.name, storage=self.storage, metric=self.at.metric)
        record.setdefault("tracking", {"uri": self.cfg.tracking.tracking_uri, "experiment_name": self.cfg.tracking.experiment_name})
        atomic_write_json(path, record)


def open_session(cfg: DictConfig, dry_run: bool = False, lock: bool = False, worker: bool = False) -> Session:
    """Validate every input and build the session. Any user mistake raises UserError.

    dry_run (plan): the same checks, but nothing is created: no folders, no MLflow store, no study.
    lock: the results folder is locked for this process (another session there is refused).
    worker: one of several workers: the lock is shared with the other workers on this folder, and the
    session's name does not depend on which devices or hosts this worker launches on (only how many).
    """
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    ds_path = _given_path(cfg.config, "config", "your ds_config.json", BUNDLED_CONFIG)
    ds_config = configlib.load_ds_config(ds_path)
    final = configlib.settings(cfg, ds_config, overrides)
    configlib.validate(final)
    script = _check_script(_given_path(final.script, "script", "your training script .py", BUNDLED_SCRIPT))
    script_args = _split_args(final.script_args)
    resources = Resources(**OmegaConf.to_container(final.launcher, resolve=True))
    _check_resources(resources)
    ws = world_size(resources)
    _check_mp_size(final.autotuning.mp_size, ws)
    plan = build_plan(ds_config, final.autotuning, final.space, script_args, ws, hf_trainer=is_hf_trainer(script, script_args))
    results_dir = _results_dir(final)
    exps_dir = Path(final.autotuning.exps_dir or "autotuning_exps").absolute()
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        exps_dir = results_dir / "exps"
    for d in (results_dir, exps_dir):
        _check_writable(d, create=not dry_run)
    device = accelerator_name()
    limit = configlib.parse_bytes(final.autotuning.memory_limit_per_rank) if final.autotuning.memory_limit_per_rank else default_memory_limit(device, resources, ws)
    name = final.search.session or identity(final, ds_config, script, script_args, world_size=ws if worker else None)
    if final.autotuning.overwrite:
        name = f"{name}-{datetime.now():%Y%m%d-%H%M%S}"
    storage = final.search.storage or f"sqlite:///{results_dir / 'optuna.db'}"
    _check_storage(storage)
    _check_tracking_uri(final.tracking.tracking_uri, create=not dry_run)
    remember_secrets(script_args, storage, final.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", ""), ds_config)
    held = SessionLock(results_dir, name, shared=worker).acquire() if lock else None
    try:
        _check_results_dir_owner(results_dir, name, final.autotuning.overwrite)
        if lock and final.autotuning.overwrite:
            archive_previous_session(results_dir)
    except BaseException:
        held and held.release()
        raise
    return Session(final, ds_path, ds_config, plan, script, script_args, resources, ws, results_dir, exps_dir, name, storage, limit, device, held, worker)


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


def _given_path(value: Optional[str], key: str, what: str, bundled: Path) -> Path:
    """None -> the bundled file; an empty value is a mistake (it would silently tune the bundled example)."""
    if value is None:
        return bundled
    if not str(value).strip():
        raise UserError(f"{key}= is given but empty.", f"Pass {key}=<path to {what}>, or leave {key} out entirely to use the bundled example.")
    return Path(value).expanduser()


def is_hf_trainer(script: Path, script_args: List[str]) -> bool:
    """A Hugging Face Trainer script: it takes --deepspeed and uses transformers' Trainer."""
    from mlautotune.scriptargs import get_flag

    if get_flag(script_args, "--deepspeed") is None:
        return False
    try:
        text = script.read_text(errors="replace")
    except OSError:
        return False
    return "transformers" in text and "Trainer" in text


def _check_mp_size(mp: int, ws: int) -> None:
    if mp > ws or ws % mp:
        raise UserError(f"autotuning.mp_size={mp} " + (f"is larger than the {ws} ranks of this launch." if mp > ws else f"does not divide the {ws} ranks of this launch."), f"Use an mp_size that divides {ws} (1 without model parallelism), or launch more ranks (launcher.num_gpus/num_nodes).")


def _check_storage(storage: str) -> None:
    """search.storage must be a database URL Optuna can open (checked without connecting)."""
    from sqlalchemy.engine import make_url

    try:
        url = make_url(storage)
        url.get_dialect()
    except Exception as e:
        raise UserError(f"search.storage={storage!r} is not a database URL Optuna can use ({str(e).splitlines()[0]}).", "Use a URL like sqlite:///path/optuna.db or postgresql://user@host/db, or leave search.storage unset for sqlite in results_dir.")
    if url.get_backend_name() == "sqlite" and url.database:
        folder = Path(url.database).expanduser().absolute().parent
        if not _nearest_existing(folder).is_dir():
            raise UserError(f"search.storage={storage!r} points into {str(folder)!r}, which is not a folder.", "Point the sqlite URL at a file in an existing folder.")


def identity(cfg: DictConfig, ds_config: Dict[str, Any], script: Path, script_args: List[str], world_size: Optional[int] = None) -> str:
    """A stable session name from what determines the measurements (not from budgets or paths).
    Workers give their world size instead of their launcher settings: each has its own devices or hosts."""
    at = {k: v for k, v in OmegaConf.to_container(cfg.autotuning, resolve=True).items() if k not in NOT_IDENTITY}
    user = {k: v for k, v in ds_config.items() if k != "autotuning"}
    blob = json.dumps(
        {
            "script": str(script),
            "args": script_args,
            "ds_config": user,
            "autotuning": at,
            "space": OmegaConf.to_container(cfg.space, resolve=True),
            "launcher": OmegaConf.to_container(cfg.launcher, resolve=True) if world_size is None else {"world_size": world_size},
            "seed": cfg.search.seed,
            "sampler": OmegaConf.to_container(cfg.search.sampler, resolve=True) if cfg.search.sampler else None,
        },
        sort_keys=True,
        default=str,
    )
    return f"{script.stem}-{cfg.autotuning.tuner_type}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


def _check_script(script: Path) -> Path:
    path = script.absolute()
    if path.is_dir():
        raise UserError(f"The training script {str(path)!r} is a directory.", "Pass script=<path to your training script .py>.")
    if not path.is_file():
        raise UserError(f"The training script {str(path)!r} does not exist.", "Pass script=<path to your training script .py>, or leave script unset to tune the bundled example.")
    if path.suffix != ".py":
        raise UserError(f"The training script {str(path)!r} is not a Python file (.py).", "mlautotune launches Python training scripts through the DeepSpeed launcher; pass script=<your_script.py>.")
    return path


def _split_args(text: str) -> List[str]:
    try:
        return shlex.split(text or "")
    except ValueError as e:
        raise UserError(f"script_args cannot be split into arguments ({e}): {text!r}.", "Close the quote, e.g. script_args='--name \"my run\" --steps 20'.")


def _check_resources(r: Resources) -> None:
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
    elif accelerator_name() != "cpu" and r.num_gpus is not None:
        from deepspeed.accelerator import get_accelerator

        have = get_accelerator().device_count()
        if r.num_gpus > have:
            raise UserError(f"launcher.num_gpus={r.num_gpus} is more than this machine's {have} devices.", f"Use launcher.num_gpus<={have}, or pass a hostfile for more nodes.")
    if r.num_gpus is not None and r.num_gpus < 1:
        raise UserError(f"launcher.num_gpus={r.num_gpus} must be at least 1.", "Pass launcher.num_gpus=<devices per node>.")


def _results_dir(cfg: DictConfig) -> Path:
    base = Path(cfg.autotuning.results_dir or "autotuning_results").expanduser().absolute()
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        job = HydraConfig.get().job
        return base / (job.override_dirname or f"job{job.num}")
    return base


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_writable(d: Path, create: bool = True) -> None:
    if not create:  # plan: the folder, or the nearest folder above it, must be writable; nothing is made
        base = _nearest_existing(d)
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


def _check_results_dir_owner(results_dir: Path, name: str, overwrite: bool) -> None:
    path = results_dir / SESSION_FILE
    if overwrite or not path.exists():
        return
    owner = read_json(path).get("session")
    if owner and owner != name:
        raise UserError(
            f"The results directory {str(results_dir)!r} holds another tuning session ({owner}) whose settings differ from this one's ({name}).",
            "Set autotuning.results_dir to a new folder to keep both, or autotuning.overwrite=true to start afresh there.",
        )


def _check_tracking_uri(uri: Optional[str], create: bool = True) -> None:
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


def default_memory_limit(device: str, resources: Resources, ws: int) -> int:
    from mlautotune.memory import default_limit

    return default_limit(device, local_ranks(resources, ws))


def local_ranks(resources: Resources, ws: int) -> int:
    """Ranks per node (nodes assumed alike)."""
    return resources.num_gpus or max(1, ws // (resources.num_nodes or 1))


def hardware_params(session: Session) -> Dict[str, Any]:
    import psutil
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    params = {
        "hardware.accelerator": session.device,
        "hardware.device_count": acc.device_count(),
        "hardware.world_size": session.world_size,
        "hardware.host": socket.gethostname(),
        "hardware.host_memory_bytes": psutil.virtual_memory().total,
        "hardware.cpu_count": os.cpu_count(),
        "hardware.memory_limit_per_rank_bytes": session.memory_limit_bytes,
        "python": sys.version.split()[0],
    }
    if session.device != "cpu":
        params["hardware.device_memory_bytes"] = acc.total_memory()
    return params
