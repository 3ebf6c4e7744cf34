"""The configuration schema (structured configs in Hydra's ConfigStore), ds_config loading and validation.

Precedence of the `autotuning` settings: conf/ defaults < the user's ds_config `autotuning`
section < command-line overrides.
"""

import errno
import json
import logging
import math
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import hjson
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mlautotune.errors import UserError


PACKAGE_DIR = Path(__file__).parent.parent
BUNDLED_CONFIG = PACKAGE_DIR / "examples" / "ds_config.json"
BUNDLED_SCRIPT = PACKAGE_DIR / "workloads" / "gpt.py"

# MLproject parameter -> Hydra key
MLPROJECT_KEYS = {
    "config": "config",
    "script": "script",
    "script_args": "script_args",
    "mode": "mode",
    "num_gpus": "launcher.num_gpus",
    "num_nodes": "launcher.num_nodes",
    "hostfile": "launcher.hostfile",
    "tuner_type": "autotuning.tuner_type",
    "results_dir": "autotuning.results_dir",
}


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
    # DeepSpeed's bounds on the search (deepspeed/autotuning/constants.py, same defaults).
    min_train_batch_size: int = 1
    min_train_micro_batch_size_per_gpu: int = 1
    max_train_micro_batch_size_per_gpu: int = 1024
    # DeepSpeed keys accepted with a warning: mlautotune profiles the model and writes metrics.json itself.
    metric_path: Optional[str] = None
    model_info: Optional[Dict[str, Any]] = None
    model_info_path: Optional[str] = None
    # mlautotune's own additions.
    memory_limit_per_rank: Optional[str] = None  # "6GiB", "500MB" or bytes; None -> device memory (GPU) / host RAM share (CPU)
    experiment_timeout: float = 900.0  # seconds per experiment; the whole process group is killed after it
    final_training_timeout: Optional[float] = None  # seconds for mode=run's final training; None: no cap
    # The full run's length, for the estimate of its wall time and GPU-hours (docs/results.md); at most one.
    planned_steps: Optional[int] = None  # optimizer steps at the ds_config's batch size
    planned_samples: Optional[int] = None
    planned_tokens: Optional[int] = None  # needs the sequence length (--seq_len, --block_size, ... in script_args)


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
class Resources:
    num_gpus: Optional[int] = None
    num_nodes: Optional[int] = None
    hostfile: Optional[str] = None
    include: Optional[str] = None
    exclude: Optional[str] = None
    master_port: Optional[int] = None  # None: a free port from the OS for each experiment
    launcher: str = "pdsh"
    launcher_args: List[str] = field(default_factory=list)


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
    sampler: Dict[str, Any] = field(default_factory=dict)  # any Optuna sampler by Hydra _target_ (empty: tuner_type's); overrides tuner_type
    stop_probability: float = 0.05  # the search ends when P(another configuration beats the best by more than 1%) is under this (docs/search.md)
    heartbeat_seconds: int = 30  # workers: a running trial's heartbeat; after 4 missed beats another worker runs it again
    warm_start: bool = True  # start from earlier sessions of the same model in the study storage, else the MLflow store (search/earlier.py); false: a cold start


@dataclass
class MeasureConf:
    """How each experiment's throughput is measured (the probe's adaptive window)."""

    adaptive: bool = True  # false: exactly start_profile_step..end_profile_step, as before (for benchmarks)
    target_interval: float = 0.02  # stop once the median step time is known to +-2% (95% confidence)
    budget_s: float = 4.5  # ... or once this many seconds were measured, warm-up included (CPU: ~35 steps of the bundled workload)
    max_warmup_steps: int = 10  # leading steps skipped at most while the step time settles
    warmup_tolerance: float = 0.10  # a leading step slower than 1.1x the median of the rest is warm-up
    confidence: float = 0.95
    max_cpu_wait: float = 0.10  # a rank's training thread waiting for a CPU longer than this share of the window: disturbed (Linux)
    check_every: int = 2  # optimizer steps between the ranks' collective stop checks
    pin_cpu_ranks: bool = True  # CPU ranks: each on its own share of the cores (a worker only when started on its own cores)
    synchronize: bool = True  # the accelerator is synchronised at each step's end in the window; false only to show what that changes (benchmarks/gpu_check.py)


@dataclass
class MLAutotuneConf:
    command: str = "tune"  # tune | plan | experiment | sync | worker | report (the first word on the command line)
    config: Optional[str] = None  # ds_config path; None -> the bundled example
    script: Optional[str] = None  # training script; None -> the bundled workload
    script_args: str = ""  # the script's arguments, one string, split like a POSIX shell would (never run by one)
    mode: str = "tune"  # tune | run
    autotuning: AutotuningConf = field(default_factory=AutotuningConf)
    launcher: LauncherConf = field(default_factory=LauncherConf)
    tracking: TrackingConf = field(default_factory=TrackingConf)
    search: SearchConf = field(default_factory=SearchConf)
    measure: MeasureConf = field(default_factory=MeasureConf)
    space: Dict[str, Any] = field(default_factory=dict)  # zero0..zero3: per-stage default spaces from conf/space


def register_configs() -> None:
    ConfigStore.instance().store(name="mlautotune_schema", node=MLAutotuneConf)


# ---- loading and validating the user's inputs --------------------------------------------------

log = logging.getLogger("mlautotune")
METRICS = ("throughput", "latency", "FLOPS")
TUNERS = ("model_based", "gridsearch", "random")
ENABLE_HINT = 'Add "autotuning": {"enabled": true} to the ds_config (see the DeepSpeed autotuning README).'


MIN_TIMEOUT_S = 10  # a DeepSpeed launch alone takes seconds; a shorter timeout fails every experiment
MIN_STEP_S = 0.001  # no training step is faster: an end_profile_step beyond timeout / this is never reached
MAX_CONFIG_BYTES = 16 * 2**20  # a ds_config is a few KiB; a larger file is not one
MAX_CONFIG_DEPTH = 32
BOMS = ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"), (b"\xff\xfe", "UTF-16"), (b"\xfe\xff", "UTF-16"))


def load_ds_config(path: Path) -> dict:
    """Read a ds_config as DeepSpeed does (hjson: comments and trailing commas are fine; duplicate keys are an error)."""
    path = Path(path)
    where = f"The DeepSpeed config {str(path)!r}"
    text = _decode(_read_bytes(path, where), where)
    if not text.strip():
        raise UserError(f"{where} is empty.", 'A ds_config is a JSON object like {"train_micro_batch_size_per_gpu": 1, "autotuning": {"enabled": true}}.')
    try:
        data = hjson.loads(text, object_pairs_hook=_no_duplicate_keys)
    except hjson.HjsonDecodeError as e:
        raise UserError(f"{where} does not parse: {e.msg} at line {e.lineno}, column {e.colno}.", "Fix the JSON there (comments and trailing commas are accepted).")
    except OverflowError:
        raise UserError(f"{where} holds a number too large for a float (like 1e999).", "Write the number within the float range (at most about 1.8e308); sizes in bytes are plain integers such as 500000000.")
    except RecursionError:
        raise UserError(f"{where} is nested too deeply to read.", f"A ds_config nests a few levels (at most {MAX_CONFIG_DEPTH}); check that the file is the one you meant.")
    if not isinstance(data, dict):
        raise UserError(f"{where} is not a JSON object.", "A ds_config is an object like {\"train_micro_batch_size_per_gpu\": 1, \"autotuning\": {\"enabled\": true}}.")
    _check_depth(data, where)
    return _normalise_keys(data, str(path))


def _read_bytes(path: Path, where: str) -> bytes:
    try:
        st = path.stat()
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(f"{where} is a symbolic link that loops back on itself.", "Point config= at the ds_config file itself.")
        raise UserError(f"{where} does not exist.", "Pass config=<path to your ds_config.json>, or leave config unset to use the bundled example.")
    if stat.S_ISDIR(st.st_mode):
        raise UserError(f"{where} is a directory, not a file.", "Pass config=<path to the ds_config.json file inside it>.")
    if st.st_size > MAX_CONFIG_BYTES:
        raise UserError(f"{where} is {st.st_size / 2**20:.0f} MiB; a ds_config is a few KiB (limit {MAX_CONFIG_BYTES // 2**20} MiB).", "Check that config= points at the ds_config and not at a data or checkpoint file.")
    try:
        with open(path, "rb") as f:
            return f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise UserError(f"{where} cannot be read ({e.strerror}).", "Check the file's permissions, or pass another config=.")


def _decode(raw: bytes, where: str) -> str:
    for bom, name in BOMS:
        if raw.startswith(bom):
            raise UserError(f"{where} is {name} text; DeepSpeed reads a ds_config as UTF-8.", f"Save it as UTF-8, e.g. iconv -f {name} -t UTF-8 ds.json > ds_utf8.json.")
    if b"\x00" in raw:
        raise UserError(f"{where} is a binary file (it contains NUL bytes), not JSON text.", "Pass config=<path to your ds_config.json>.")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise UserError(f"{where} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start} does not decode).", "Save it as UTF-8 (DeepSpeed reads a ds_config as UTF-8).")


def _no_duplicate_keys(pairs):
    """hjson's object_pairs_hook: DeepSpeed refuses a key given twice (dict_raise_error_on_duplicate_keys)."""
    out = {}
    for k, v in pairs:
        if k in out:
            raise UserError(f"The ds_config gives the key {k!r} twice in one object; DeepSpeed refuses that.", f"Keep one {k!r} and delete the other.")
        out[k] = _finite(v, k)
    return out


def _finite(value, key):
    if type(value).__name__ == "Decimal":
        value = float(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"The ds_config's {key!r} is {value}, which is not a finite number.", f"Give {key} a finite number.")
    return value


def _check_depth(data, where: str) -> None:
    level, depth = [data], 0
    while level:
        depth += 1
        if depth > MAX_CONFIG_DEPTH:
            raise UserError(f"{where} is nested more than {MAX_CONFIG_DEPTH} levels deep.", "A ds_config nests a few levels; check that the file is the one you meant.")
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x) if isinstance(v, (dict, list))]


def _normalise_keys(d: dict, where: str) -> dict:
    out = {}
    for k, v in d.items():
        key = k.strip() if isinstance(k, str) else k
        if key != k:
            log.warning("ds_config %s: key %r has stray whitespace; read as %r", where, k, key)
        if key in out:
            raise UserError(f"The ds_config gives the key {key!r} twice in one object (once with stray whitespace); DeepSpeed refuses that.", f"Keep one {key!r} and delete the other.")
        out[key] = _normalise_keys(v, where) if isinstance(v, dict) else v
    return out


def settings(cfg: DictConfig, ds_config: dict, cli_overrides: list) -> DictConfig:
    """conf defaults < the ds_config's `autotuning` section < command-line overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    section = ds_config.get("autotuning")
    if section is None:
        raise UserError("Autotuning is not enabled in the ds_config: it has no \"autotuning\" section.", ENABLE_HINT)
    if not isinstance(section, dict):
        raise UserError(f"The ds_config's \"autotuning\" is {section!r}, not an object.", ENABLE_HINT)
    enabled = section.get("enabled")
    if isinstance(enabled, str):
        raise UserError(f"autotuning.enabled is the string {enabled!r}, not the JSON boolean true.", 'Write "enabled": true without quotes.')
    if enabled is not True:
        raise UserError("Autotuning is not enabled in the ds_config" + (" (\"enabled\" is missing)." if enabled is None else f" (\"enabled\": {json.dumps(enabled)})."), ENABLE_HINT)
    section = dict(section)
    if "arg_mappings" not in section and isinstance(ds_config.get("arg_mappings"), dict):
        section["arg_mappings"] = ds_config["arg_mappings"]  # the README's own example puts it at the top level
    if isinstance(section.get("arg_mappings"), dict):
        section["arg_mappings"] = {k.strip(): v for k, v in section["arg_mappings"].items()}
    known = set(AutotuningConf.__dataclass_fields__)
    for key in section:
        if key not in known:
            raise UserError(f"The ds_config's autotuning section has an unknown key {key!r}.", f"Known keys: {', '.join(sorted(known))}.")
        check_type(f"autotuning.{key}", section[key], AutotuningConf.__dataclass_fields__[key].type, "The ds_config's")
    final = cfg.copy()
    free_form = {k: section.pop(k) for k in ("arg_mappings", "model_info") if section.get(k) is not None}  # dicts of any keys
    try:
        final.autotuning = OmegaConf.merge(final.autotuning, section)
        for k, v in free_form.items():
            final.autotuning[k] = v
    except OmegaConfBaseException as e:
        raise UserError(f"The ds_config's autotuning section has a value of the wrong type: {str(e).splitlines()[0]}.", "Use the types of the documented defaults (numbers, true/false, strings).")
    keys = [o.key_or_group for o in OverridesParser.create().parse_overrides(list(cli_overrides))]
    for key in keys:
        if key.startswith("autotuning."):
            OmegaConf.update(final, key, OmegaConf.select(cfg, key), merge=False)
    if isinstance(final.autotuning.metric, str):
        final.autotuning.metric = canonical_metric(final.autotuning.metric)
    return final


KINDS = {bool: "true or false (a JSON boolean)", int: "a whole number", float: "a number", str: "a string", dict: "an object {...}"}


def expected_kind(annotation) -> tuple:
    """(Python type, may be null) of a dataclass field's annotation: bool, int, float, str or dict."""
    import typing

    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = typing.get_origin(annotation)
    if base is typing.Union:
        return expected_kind(args[0])[0], True
    return (dict if base is dict or annotation is dict else annotation), False


def check_type(key: str, value, annotation, where: str = "The") -> None:
    """A value from the ds_config of the type its key takes, read as DeepSpeed reads it: no string for a
    number or a boolean (OmegaConf would turn "900" into 900 and "no" into false, DeepSpeed reads "false" as true)."""
    kind, nullable = expected_kind(annotation)
    if value is None and nullable:
        return
    if key == "autotuning.memory_limit_per_rank" and isinstance(value, int) and not isinstance(value, bool):
        return  # bytes
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str),
          dict: lambda v: isinstance(v, dict)}[kind](value)
    if not ok:
        quoted = " (in quotes: DeepSpeed reads a string, and any non-empty string is true)" if isinstance(value, str) and kind is bool else \
                 " (in quotes)" if isinstance(value, str) and kind in (int, float) else ""
        raise UserError(f"{where} {key} is {json.dumps(value)}{quoted}, not {KINDS[kind]}.",
                        f"Give {key.rsplit('.', 1)[-1]} {KINDS[kind]}{' or null' if nullable else ''}, e.g. {json.dumps(EXAMPLES[kind])} without quotes."
                        if kind in (bool, int, float) else f"Give {key.rsplit('.', 1)[-1]} {KINDS[kind]}{' or null' if nullable else ''}.")


EXAMPLES = {bool: True, int: 20, float: 900.0}


def canonical_metric(name: str) -> str:
    """Metric names are case-insensitive, in the file and on the command line (DeepSpeed writes "flops")."""
    return next((m for m in METRICS if m.lower() == name.strip().lower()), name)


FLAG = re.compile(r"--?[A-Za-z0-9][A-Za-z0-9_.-]*")
COMMANDS = ("tune", "plan", "experiment", "sync", "worker", "report")


def validate(cfg: DictConfig) -> None:
    """Every setting in its range; a mistake raises UserError naming the key and the fix."""
    at = cfg.autotuning
    if at.metric not in METRICS:
        raise UserError(f"autotuning.metric={at.metric!r} is not a known metric.", f"Use one of {', '.join(METRICS)} (any case).")
    if at.tuner_type not in TUNERS:
        raise UserError(f"autotuning.tuner_type={at.tuner_type!r} is not a known tuner.", f"Use one of {', '.join(TUNERS)}, or search.sampler with a _target_ for another Optuna sampler.")
    if at.start_profile_step < 1:
        raise UserError(f"autotuning.start_profile_step={at.start_profile_step} must be at least 1.", "Use start_profile_step >= 1 (default 3).")
    if at.end_profile_step < at.start_profile_step:
        raise UserError(f"autotuning.end_profile_step={at.end_profile_step} is smaller than start_profile_step={at.start_profile_step}.", "Make end_profile_step >= start_profile_step (defaults 3 and 5).")
    for key in ("tuner_num_trials", "tuner_early_stopping", "num_tuning_micro_batch_sizes", "mp_size", "min_train_batch_size", "min_train_micro_batch_size_per_gpu", "max_train_micro_batch_size_per_gpu"):
        if at[key] < 1:
            raise UserError(f"autotuning.{key}={at[key]} must be at least 1.", f"Set autotuning.{key} to a positive integer (DeepSpeed's default: {getattr(AutotuningConf, key)}).")
    if at.max_train_batch_size is not None and at.max_train_batch_size < 1:
        raise UserError(f"autotuning.max_train_batch_size={at.max_train_batch_size} must be at least 1.", "Give a positive integer, or null for no cap.")
    if at.min_train_micro_batch_size_per_gpu > at.max_train_micro_batch_size_per_gpu:
        raise UserError(f"autotuning.min_train_micro_batch_size_per_gpu={at.min_train_micro_batch_size_per_gpu} is larger than max_train_micro_batch_size_per_gpu={at.max_train_micro_batch_size_per_gpu}.", "Make the minimum at most the maximum (defaults 1 and 1024).")
    for key, flag in (at.arg_mappings or {}).items():
        if not str(key).strip():
            raise UserError(f"arg_mappings has an empty key (mapped to {flag!r}).", 'Each key is the ds_config key the flag carries, e.g. "train_micro_batch_size_per_gpu": "--batch_size".')
        if not isinstance(flag, str) or not flag.startswith("--"):
            raise UserError(f"arg_mappings maps {key!r} to {flag!r}, which is not a command-line flag.", f'Write the flag with its dashes, e.g. "{key}": "--per_device_train_batch_size".')
        if not FLAG.fullmatch(flag.strip()):
            raise UserError(f"arg_mappings maps {key!r} to {flag!r}, which is not a single command-line flag (only letters, digits, _ . - after the dashes; no spaces or ;).", f'Give one flag of the script, e.g. "{key}": "--per_device_train_batch_size".')
    if cfg.mode not in ("tune", "run"):
        raise UserError(f"mode={cfg.mode!r} is not a mode.", "Use mode=tune (find the optimum) or mode=run (then train with it).")
    if not math.isfinite(at.experiment_timeout) or at.experiment_timeout <= 0:
        raise UserError(f"autotuning.experiment_timeout={at.experiment_timeout} is not a positive number of seconds.", "Give seconds, e.g. 900.")
    if at.experiment_timeout < MIN_TIMEOUT_S:
        raise UserError(f"autotuning.experiment_timeout={at.experiment_timeout:g} s is shorter than a DeepSpeed launch takes (at least {MIN_TIMEOUT_S} s), so every experiment would time out.",
                        f"Give at least {MIN_TIMEOUT_S} seconds, e.g. 900 (the default).")
    if at.final_training_timeout is not None and (not math.isfinite(at.final_training_timeout) or at.final_training_timeout < MIN_TIMEOUT_S):
        raise UserError(f"autotuning.final_training_timeout={at.final_training_timeout:g} is not a number of seconds of at least {MIN_TIMEOUT_S}.",
                        "Give the seconds mode=run's final training may take, or null for no cap (the default).")
    if at.end_profile_step > at.experiment_timeout / MIN_STEP_S:
        raise UserError(f"autotuning.end_profile_step={at.end_profile_step} steps cannot end within autotuning.experiment_timeout={at.experiment_timeout:g} s "
                        f"(that would take steps of under {MIN_STEP_S * 1000:g} ms), so every experiment would time out.",
                        "Lower end_profile_step (default 5; the probe measures adaptively from start_profile_step on), or raise experiment_timeout.")
    if not cfg.tracking.experiment_name or not str(cfg.tracking.experiment_name).strip():
        raise UserError("tracking.experiment_name is empty; MLflow refuses an experiment without a name.",
                        "Give a name, e.g. tracking.experiment_name=mlautotune (the default), or tracking.enabled=false to tune without MLflow.")
    if at.results_dir == "" or at.exps_dir == "":
        raise UserError("autotuning.results_dir or exps_dir is empty.", "Give a folder, or leave the key out for the default (autotuning_results, autotuning_exps).")
    if at.memory_limit_per_rank is not None:
        parse_bytes(at.memory_limit_per_rank)
    validate_planned(at)
    validate_launcher(cfg.launcher)
    validate_sampler(cfg.search.sampler)
    if cfg.search.heartbeat_seconds < 1:
        raise UserError(f"search.heartbeat_seconds={cfg.search.heartbeat_seconds} must be at least 1.", "Give the seconds between a worker's heartbeats (default 30; a trial is run again after 4 missed beats).")
    if not 0 < cfg.search.stop_probability < 1:
        raise UserError(f"search.stop_probability={cfg.search.stop_probability:g} is outside 0..1.",
                        "Give the probability under which the search stops, e.g. 0.05 (the default): lower runs longer.")
    m = cfg.measure
    if m.target_interval <= 0 or m.budget_s < 0 or m.max_warmup_steps < 0 or m.check_every < 1 or not 0 < m.confidence < 1:
        raise UserError(f"The measure settings are out of range: {dict(m)}.", "Use measure.target_interval > 0, budget_s >= 0, max_warmup_steps >= 0, check_every >= 1 and 0 < confidence < 1 (defaults 0.02, 4.5, 10, 2, 0.95).")

PLANNED_KEYS = ("planned_steps", "planned_samples", "planned_tokens")


def validate_planned(at: Any) -> None:
    """The full run's length: mlautotune's own keys in the autotuning section (DeepSpeed never sees
    them: no experiment's ds_config has an autotuning section). Each a positive integer, one at most."""
    given = [k for k in PLANNED_KEYS if at.get(k) is not None]
    for key in given:
        value = at[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"autotuning.{key}={value!r} is not a positive whole number.",
                            f"Give the full run's {key.removeprefix('planned_')} as a positive integer, e.g. 20000, or leave {key} out (no full-run estimate then).")
    if len(given) > 1:
        raise UserError(f"autotuning.{given[0]} and autotuning.{given[1]} are both given; the full run's length is one of them.",
                        "Keep one: planned_steps (optimizer steps at the ds_config's batch size), planned_samples, or planned_tokens.")


def validate_command(command: str) -> None:
    if command not in COMMANDS:
        raise UserError(f"command={command!r} is not a command.", f"Use one of {', '.join(COMMANDS)} (lower case), e.g. `mlautotune plan config=ds.json`.")


def validate_sampler(sampler: Any) -> None:
    """search.sampler: an Optuna sampler class named by `_target_` (Hydra's instantiate convention)."""
    if not sampler:
        return
    target = sampler.get("_target_")
    hint = "Write it as 'search.sampler={_target_: optuna.samplers.TPESampler}' (any optuna.samplers.BaseSampler subclass), or leave it unset to use autotuning.tuner_type."
    if not isinstance(target, str) or not target:
        raise UserError(f"search.sampler has no _target_ naming a sampler class (got {dict(sampler)!r}).", hint)
    from hydra.utils import get_class
    import optuna

    try:
        cls = get_class(target)
    except Exception as e:
        raise UserError(f"search.sampler._target_={target!r} cannot be imported ({str(e).splitlines()[0]}).", hint)
    if not issubclass(cls, optuna.samplers.BaseSampler):
        raise UserError(f"search.sampler._target_={target!r} is not an Optuna sampler.", hint)


def validate_launcher(launcher: Any) -> None:
    for key in ("num_gpus", "num_nodes"):
        if launcher[key] is not None and launcher[key] < 1:
            raise UserError(f"launcher.{key}={launcher[key]} must be at least 1.", f"Pass launcher.{key}=<a positive integer>, or leave it unset to use what the machine has.")
    if launcher.master_port is not None and not 1 <= launcher.master_port <= 65535:
        raise UserError(f"launcher.master_port={launcher.master_port} is not a TCP port.", "Use a port in 1..65535, or leave it unset: each experiment then takes a free port from the OS.")


UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in UNITS:
        raise UserError(f"autotuning.memory_limit_per_rank={value!r} is not a size.", "Write it like 6GiB, 500MB or a number of bytes.")
    size = float(m.group(1)) * UNITS[m.group(2).lower()]
    if not math.isfinite(size) or size > 2**60:
        raise UserError(f"autotuning.memory_limit_per_rank={value!r} is larger than any machine's memory.", "Write the limit per rank, like 6GiB, or leave it unset for the device memory.")
    if size < 2**20:
        raise UserError(f"autotuning.memory_limit_per_rank={value!r} is less than 1 MiB, so every experiment would be out of memory.", "Write the limit per rank, like 6GiB, or leave it unset for the device memory.")
    return int(size)
