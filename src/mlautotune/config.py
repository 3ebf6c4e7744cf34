"""The configuration schema (structured configs in Hydra's ConfigStore), ds_config loading and validation.

Precedence of the `autotuning` settings: conf/ defaults < the user's ds_config `autotuning`
section < command-line overrides.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore


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


@dataclass
class LauncherConf:
    """Resources, passed to the DeepSpeed launcher exactly as its own flags."""

    num_gpus: Optional[int] = None
    num_nodes: Optional[int] = None
    hostfile: Optional[str] = None
    include: Optional[str] = None
    exclude: Optional[str] = None
    master_port: int = 29500  # experiments use free ports from here on
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
