"""The configuration schema (structured configs in Hydra's ConfigStore), ds_config loading and validation.

Precedence of the `autotuning` settings: conf/ defaults < the user's ds_config `autotuning`
section < command-line overrides.
"""

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import hjson
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mlautotune.errors import UserError


@dataclass
class AutotuningConf:
    """Every key of DeepSpeed's documented `autotuning` section, with its documented default."""

    enabled: bool = False
    results_dir: Optional[str] = None  # None -> "autotuning_results" in the working directory
    exps_dir: Optional[str] = None  # None -> "autotuning_exps" in the working directory
    overwrite: bool = False
    metric: str = "throughput"  # throughput | latency | FLOPS
    start_profile_step: int = 3
    end_profile_step: int = 5
    fast: bool = True
    max_train_batch_size: Optional[int] = None
    mp_size: int = 1
    num_tuning_micro_batch_sizes: int = 3
    tuner_type: str = "model_based"  # model_based | gridsearch | random
    tuner_early_stopping: int = 5
    tuner_num_trials: int = 50
    arg_mappings: Optional[Dict[str, str]] = None
    # mlautotune's own additions.
    memory_limit_per_rank: Optional[str] = None  # "6GiB", "500MB" or bytes; None -> device memory (GPU) / host RAM share (CPU)
    experiment_timeout: float = 900.0  # seconds per experiment; the whole process group is killed after it
    final_training_timeout: Optional[float] = None  # seconds for mode=run's final training; None: no cap


@dataclass
class LauncherConf:
    """Resources, passed to the DeepSpeed launcher exactly as its own flags."""

    num_gpus: Optional[int] = None
    num_nodes: Optional[int] = None
    hostfile: Optional[str] = None
    include: Optional[str] = None
    exclude: Optional[str] = None
    master_port: Optional[int] = None  # None: each experiment gets a free port from the OS (retried on a clash)
    launcher: str = "pdsh"  # pdsh | openmpi | mvapich | slurm | mpich | impi (multi-node only)
    launcher_args: List[str] = field(default_factory=list)  # e.g. ["--no_ssh", "--bind_cores_to_rank"]


@dataclass
class TrackingConf:
    enabled: bool = True
    tracking_uri: Optional[str] = None  # None -> MLFLOW_TRACKING_URI, else MLflow's default
    experiment_name: str = "mlautotune"


@dataclass
class SearchConf:
    seed: int = 0
    storage: Optional[str] = None  # Optuna storage URL; None -> sqlite in results_dir
    session: Optional[str] = None  # session name; None -> derived from script, args, ds_config and settings
    sampler: Optional[Dict[str, Any]] = None  # any Optuna sampler by Hydra _target_; overrides tuner_type
    remeasure: int = 2  # extra measurements of near-tied leaders before the optimum is declared


@dataclass
class MLAutotuneConf:
    command: str = "tune"  # tune | plan | experiment | sync (the first word on the command line)
    config: Optional[str] = None  # ds_config path; None -> the bundled example
    script: Optional[str] = None  # training script; None -> the bundled workload
    script_args: str = ""  # the script's arguments, one string, split like a POSIX shell would (never run by one)
    mode: str = "tune"  # tune | run
    autotuning: AutotuningConf = field(default_factory=AutotuningConf)
    launcher: LauncherConf = field(default_factory=LauncherConf)
    tracking: TrackingConf = field(default_factory=TrackingConf)
    search: SearchConf = field(default_factory=SearchConf)
    space: Dict[str, Any] = field(default_factory=dict)  # zero0..zero3: per-stage default spaces from conf/space
    tuners: Dict[str, Any] = field(default_factory=dict)  # model_based | gridsearch | random, from conf/tuner


def register_configs() -> None:
    ConfigStore.instance().store(name="mlautotune_schema", node=MLAutotuneConf)


# ---- loading and validating the user's inputs --------------------------------------------------

log = logging.getLogger("mlautotune")
METRICS = ("throughput", "latency", "FLOPS")
TUNERS = ("model_based", "gridsearch", "random")
ENABLE_HINT = 'Add "autotuning": {"enabled": true} to the ds_config (see the DeepSpeed autotuning README).'


def load_ds_config(path: Path) -> dict:
    """Read a ds_config as DeepSpeed does (hjson: comments and trailing commas are fine)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"The DeepSpeed config {str(path)!r} does not exist.", "Pass config=<path to your ds_config.json>, or leave config unset to use the bundled example.")
    try:
        data = hjson.loads(path.read_text())
    except hjson.HjsonDecodeError as e:
        raise UserError(f"The DeepSpeed config {str(path)!r} does not parse: {e.msg} at line {e.lineno}, column {e.colno}.", "Fix the JSON there (comments and trailing commas are accepted).")
    if not isinstance(data, dict):
        raise UserError(f"The DeepSpeed config {str(path)!r} is not a JSON object.", "A ds_config is an object like {\"train_micro_batch_size_per_gpu\": 1, \"autotuning\": {\"enabled\": true}}.")
    return _normalise_keys(_plain(data), str(path))


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return float(value) if type(value).__name__ == "Decimal" else value


def _normalise_keys(d: dict, where: str) -> dict:
    out = {}
    for k, v in d.items():
        key = k.strip() if isinstance(k, str) else k
        if key != k:
            log.warning("ds_config %s: key %r has stray whitespace; read as %r", where, k, key)
        out[key] = _normalise_keys(v, where) if isinstance(v, dict) else v
    return out


def settings(cfg: DictConfig, ds_config: dict, cli_overrides: list) -> DictConfig:
    """conf defaults < the ds_config's `autotuning` section < command-line overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    section = ds_config.get("autotuning")
    if not isinstance(section, dict) or section.get("enabled") is not True:
        raise UserError("Autotuning is not enabled in the ds_config.", ENABLE_HINT)
    section = dict(section)
    if "arg_mappings" not in section and isinstance(ds_config.get("arg_mappings"), dict):
        section["arg_mappings"] = ds_config["arg_mappings"]  # the README's own example puts it at the top level
    if isinstance(section.get("arg_mappings"), dict):
        section["arg_mappings"] = {k.strip(): v for k, v in section["arg_mappings"].items()}
    if isinstance(section.get("metric"), str) and section["metric"].lower() == "flops":
        section["metric"] = "FLOPS"
    known = set(AutotuningConf.__dataclass_fields__)
    for key in section:
        if key not in known:
            raise UserError(f"The ds_config's autotuning section has an unknown key {key!r}.", f"Known keys: {', '.join(sorted(known))}.")
    final = cfg.copy()
    mappings = section.pop("arg_mappings", None)
    try:
        final.autotuning = OmegaConf.merge(final.autotuning, section)
        if mappings is not None:
            final.autotuning.arg_mappings = mappings
    except OmegaConfBaseException as e:
        raise UserError(f"The ds_config's autotuning section has a value of the wrong type: {str(e).splitlines()[0]}.", "Use the types of the documented defaults (numbers, true/false, strings).")
    keys = [o.key_or_group for o in OverridesParser.create().parse_overrides(list(cli_overrides))]
    for key in keys:
        if key.startswith("autotuning."):
            OmegaConf.update(final, key, OmegaConf.select(cfg, key), merge=False)
    return final


def validate(cfg: DictConfig) -> None:
    at = cfg.autotuning
    if at.metric not in METRICS:
        raise UserError(f"autotuning.metric={at.metric!r} is not a known metric.", f"Use one of {', '.join(METRICS)}.")
    if at.tuner_type not in TUNERS:
        raise UserError(f"autotuning.tuner_type={at.tuner_type!r} is not a known tuner.", f"Use one of {', '.join(TUNERS)}, or search.sampler with a _target_ for another Optuna sampler.")
    if at.start_profile_step < 1:
        raise UserError(f"autotuning.start_profile_step={at.start_profile_step} must be at least 1.", "Use start_profile_step >= 1 (default 3).")
    if at.end_profile_step < at.start_profile_step:
        raise UserError(f"autotuning.end_profile_step={at.end_profile_step} is smaller than start_profile_step={at.start_profile_step}.", "Make end_profile_step >= start_profile_step (defaults 3 and 5).")
    if at.tuner_num_trials < 1 or at.tuner_early_stopping < 1 or at.num_tuning_micro_batch_sizes < 1:
        raise UserError("autotuning.tuner_num_trials, tuner_early_stopping and num_tuning_micro_batch_sizes must be at least 1.", "Set them to positive integers.")
    for key, flag in (at.arg_mappings or {}).items():
        if not isinstance(flag, str) or not flag.startswith("--"):
            raise UserError(f"arg_mappings maps {key!r} to {flag!r}, which is not a command-line flag.", f'Write the flag with its dashes, e.g. "{key}": "--per_device_train_batch_size".')
    if cfg.mode not in ("tune", "run"):
        raise UserError(f"mode={cfg.mode!r} is not a mode.", "Use mode=tune (find the optimum) or mode=run (then train with it).")
    if at.experiment_timeout <= 0:
        raise UserError(f"autotuning.experiment_timeout={at.experiment_timeout} must be positive.", "Give seconds, e.g. 900.")


UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in UNITS:
        raise UserError(f"autotuning.memory_limit_per_rank={value!r} is not a size.", "Write it like 6GiB, 500MB or a number of bytes.")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])
