"""A tuning session: the validated inputs, its identity, where it writes, and how it builds experiments."""

import hashlib
import json
import os
import socket
import sys
import warnings
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Optional

import optuna
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from mlautotune.inputs import config as configlib
from mlautotune.inputs.config import BUNDLED_CONFIG, BUNDLED_SCRIPT
from mlautotune.inputs.ds_values import check_ds_values
from mlautotune.errors import UserError
from mlautotune.run.experiment import Experiment, Resources, Result, run_experiment, world_size
from mlautotune.files import atomic_write_json, inside, read_json, safe_name
from mlautotune.inputs.checks import (check_mp_size, check_resources, check_script, check_storage, check_tracking_uri, check_writable, given_path,
                               is_hf_trainer, split_args, store_folder)
from mlautotune.run.measure import thread_env, usable_cores
from mlautotune.run.ops import accelerator_name
from mlautotune.redact import redact_text, remember_secrets
from mlautotune.inputs.results_folder import SESSION_FILE, SessionLock, archive_previous_session, check_owner, check_results_folder
from mlautotune.search import SearchSettings
from mlautotune.inputs.space import TuningPlan, build_plan, experiment_config, experiment_name

# Settings that do not change what a session measures: changing them resumes the same session.
NOT_IDENTITY = ("results_dir", "exps_dir", "overwrite", "tuner_num_trials", "tuner_early_stopping", "experiment_timeout", "final_training_timeout",
                "planned_steps", "planned_samples", "planned_tokens")


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
        sampler = OmegaConf.to_container(self.cfg.search.sampler, resolve=True) if self.cfg.search.sampler else None
        return SearchSettings(
            metric=self.at.metric,
            tuner_type=self.at.tuner_type,
            seed=self.cfg.search.seed,
            num_trials=self.at.tuner_num_trials,
            stop_probability=self.cfg.search.stop_probability,
            memory_limit_bytes=self.memory_limit_bytes,
            world_size=self.world_size,
            device=self.device,
            local_ranks=local_ranks(self.resources, self.world_size),
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

        from mlautotune.search.cluster import storage
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
            study = optuna.create_study(storage=store or self.storage, study_name=self.name, direction=direction, load_if_exists=True)
        except ValueError as e:
            raise UserError(f"The Optuna study {self.name!r} in {self.storage} cannot be used: {e}.", "Pick another search.session name or storage.")
        if study.metric_names != [self.at.metric]:  # optuna-dashboard names the objective after it
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.set_metric_names([self.at.metric])
        return study

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
    ds_path = given_path(cfg.config, "config", "your ds_config.json", BUNDLED_CONFIG)
    ds_config = configlib.load_ds_config(ds_path)
    check_ds_values(ds_config)
    final = configlib.settings(cfg, ds_config, overrides)
    remember_secrets(final.search.storage or "", final.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", ""))
    configlib.validate(final)
    script = check_script(given_path(final.script, "script", "your training script .py", BUNDLED_SCRIPT))
    script_args = split_args(final.script_args)
    resources = Resources(**OmegaConf.to_container(final.launcher, resolve=True))
    check_resources(resources)
    ws = world_size(resources)
    check_mp_size(final.autotuning.mp_size, ws)
    plan = build_plan(ds_config, final.autotuning, final.space, script_args, ws, hf_trainer=is_hf_trainer(script, script_args))
    results_dir = _results_dir(final)
    exps_dir = Path(final.autotuning.exps_dir or "autotuning_exps").absolute()
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        exps_dir = results_dir / "exps"
    storage = final.search.storage or f"sqlite:///{results_dir / 'optuna.db'}"
    tracking_uri = final.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    check_results_folder(results_dir, bool(final.autotuning.overwrite), {
        "the working folder": Path.cwd(), "the training script's folder": script.parent,
        "the MLflow tracking store's folder": store_folder(tracking_uri), "the Optuna storage's folder": store_folder(final.search.storage)})
    for d in (results_dir, exps_dir):
        check_writable(d, create=not dry_run)
    device = accelerator_name()
    limit = configlib.parse_bytes(final.autotuning.memory_limit_per_rank) if final.autotuning.memory_limit_per_rank else default_memory_limit(device, resources, ws)
    name = final.search.session or identity(final, ds_config, script, script_args, world_size=ws if worker else None)
    if final.autotuning.overwrite:
        name = f"{name}-{datetime.now():%Y%m%d-%H%M%S}"
    check_storage(storage, create=not dry_run)
    check_tracking_uri(final.tracking.tracking_uri, create=not dry_run)
    remember_secrets(script_args, storage, final.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", ""), ds_config,
                     {k: v for k, v in os.environ.items() if len(v) >= 8})  # secret-named variables that the script may print
    held = SessionLock(results_dir, name, shared=worker).acquire() if lock else None
    previous = owner(results_dir)
    changed = previous is not None and previous != name and not worker  # other settings: that session is archived, this one starts
    if changed:
        plan.notices.append(f"{results_dir} held the session {previous}, whose settings differ from this one's: "
                            + ("it would be moved to previous_sessions/ there and this session would start." if dry_run else
                               f"its files are moved to {results_dir / 'previous_sessions'}/ and this session starts."))
    try:
        check_owner(results_dir, name, final.autotuning.overwrite or changed)
        if lock and (final.autotuning.overwrite or changed):
            archive_previous_session(results_dir)
    except BaseException:
        held and held.release()
        raise
    return Session(final, ds_path, ds_config, plan, script, script_args, resources, ws, results_dir, exps_dir, name, storage, limit, device, held, worker)


def owner(results_dir: Path) -> Optional[str]:
    """The session whose files results_dir holds, if any."""
    try:
        return read_json(results_dir / SESSION_FILE).get("session") or None
    except (OSError, ValueError, AttributeError):
        return None


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


def _results_dir(cfg: DictConfig) -> Path:
    base = Path(cfg.autotuning.results_dir or "autotuning_results").expanduser().absolute()
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        job = HydraConfig.get().job
        name = job.override_dirname or f"job{job.num}"
        return base / (name if redact_text(name) == name else safe_name(redact_text(name)))  # no password in a folder's name
    return base


def default_memory_limit(device: str, resources: Resources, ws: int) -> int:
    from mlautotune.search.memory import default_limit

    return default_limit(device, local_ranks(resources, ws))


def local_ranks(resources: Resources, ws: int) -> int:
    """Ranks per node (nodes assumed alike)."""
    return resources.num_gpus or max(1, ws // (resources.num_nodes or 1))


def session_hardware(session: Session) -> Dict[str, Any]:
    """What a warm start compares with an earlier session's: the accelerator, its memory (null on the
    CPU), the world size and the memory limit per rank."""
    memory = None
    if session.device != "cpu":
        from deepspeed.accelerator import get_accelerator

        memory = get_accelerator().total_memory()
    return {"accelerator": session.device, "device_memory_bytes": memory, "world_size": session.world_size,
            "memory_limit_per_rank": session.memory_limit_bytes}


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
