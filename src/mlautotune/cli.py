"""The command line: `mlautotune [tune|plan|experiment|sync] key=value ...` (a Hydra application)."""

import re
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from mlautotune.inputs.config import COMMANDS, register_configs, validate_command
from mlautotune.errors import UserError

HELP = """\
usage: mlautotune [COMMAND] [key=value ...]
       mlautotune-deepspeed [DeepSpeed launcher flags] train.py --deepspeed ds.json [script args]

Find the fastest DeepSpeed configuration (ZeRO stage, micro-batch, ZeRO knobs) for an unchanged
training script. Every experiment is a real DeepSpeed launcher run, tracked in MLflow.

commands:
  tune          tune (the default); mode=run then trains with the optimum
  plan          print the settings, first experiments, warm start; runs and writes nothing
  experiment    run one experiment (the plan's first) and print its metrics
  sync          fill MLflow from a results_dir after a tracking outage
  worker        join a session shared by several workers (search.storage, search.session)
  report        write a workers' session's report again (summary, optimum, plots, parent run)

main keys (key=value, Hydra overrides):
  config=ds.json              your ds_config with "autotuning": {"enabled": true, ...}
  script=train.py             your training script (default: the bundled GPT workload)
  script_args='--epochs 1'    the script's arguments, one string
  mode=tune|run               run: train with the optimum after tuning
  launcher.num_gpus=N         also launcher.num_nodes, hostfile, include, exclude, master_port
  autotuning.<key>=...        any key of the ds_config's autotuning section: tuner_type,
                              tuner_num_trials, metric, fast, results_dir, memory_limit_per_rank ...
  tracking.tracking_uri=URI   MLflow; also tracking.enabled, tracking.experiment_name
  search.<key>=...            seed, storage, session, sampler, stop_probability, heartbeat_seconds,
                              warm_start

example:
  mlautotune config=ds.json script=train.py script_args='--epochs 1' launcher.num_gpus=8 \\
      autotuning.tuner_num_trials=20

more:
  mlautotune --cfg job [key=value ...]   the effective settings, every key (conf < ds_config < command line)
  mlautotune -m autotuning.tuner_type=model_based,random   a Hydra multirun
  mlautotune --info / --hydra-help       Hydra's own information
  README.md (Configuration) and docs/bad-inputs.md
"""


CONF_DIR = Path(__file__).parent / "conf"


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def app(cfg: DictConfig) -> None:
    try:
        validate_command(cfg.command)
        if cfg.command == "plan":
            from mlautotune.commands import plan_command as run
        elif cfg.command == "experiment":
            from mlautotune.commands import experiment_command as run
        elif cfg.command == "sync":
            from mlautotune.commands import sync_command as run
        elif cfg.command == "worker":
            from mlautotune.worker import worker_command as run
        elif cfg.command == "report":
            from mlautotune.worker import report_command as run
        else:
            from mlautotune.commands import tune_command as run
        redact_multirun_record()
        run(cfg)
    except UserError as e:
        fail(e)
    except OmegaConfBaseException as e:  # e.g. ${name} in a value, read as an interpolation
        fail(UserError(f"A setting cannot be read: {str(e).splitlines()[0]}.", "A value's ${...} is an OmegaConf interpolation: write it as \\${...} to keep it as text."))
    except Exception as e:  # never to Hydra, whose "Error executing job with overrides" line would print passwords
        from mlautotune.redact import redact_text

        if type(e).__name__ != "SessionFailed":
            import traceback

            print(redact_text("".join(traceback.format_exception(e))).rstrip(), file=sys.stderr)
        print(f"mlautotune: {redact_text(str(e))}", file=sys.stderr)
        sys.exit(1)


def redact_log_records() -> None:
    """Every log record of this process (Hydra's "#0 : key=value" job lines, MLflow's, ours) with
    URL passwords and known secrets masked."""
    import logging

    from mlautotune.redact import redact_text

    make = logging.getLogRecordFactory()
    if getattr(make, "redacts", False):
        return

    def redacted(*args, **kwargs):
        record = make(*args, **kwargs)
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a record whose arguments do not format is left to logging
            return record
        masked = redact_text(text)
        if masked != text:
            record.msg, record.args = masked, None
        return record

    redacted.redacts = True
    logging.setLogRecordFactory(redacted)


def redact_multirun_record() -> None:
    """Hydra's multirun.yaml holds the overrides as given: a password in a URL is masked there."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from mlautotune.files import atomic_write_text
    from mlautotune.redact import redact_text

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return
    record = Path(HydraConfig.get().sweep.dir) / "multirun.yaml"
    try:
        text = record.read_text()
    except OSError:
        return
    if redact_text(text) != text:
        atomic_write_text(record, redact_text(text))


def hydra_quote(text: str) -> str:
    """A Hydra override value that is exactly `text` (a single-quoted string, quotes and backslashes escaped)."""
    # Hydra: inside quotes, only backslashes before a quote (or before the closing quote) are escapes.
    text = text.replace("${", "\\${")  # not an OmegaConf interpolation: `${IFS}` in a value stays as it is
    return "'" + re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), text) + "'"


def fail(e: UserError) -> None:
    from mlautotune.redact import redact_text

    print(f"mlautotune: error: {redact_text(e.message)}", file=sys.stderr)
    sys.exit(e.exit_code)


def main(argv=None) -> None:
    """Entry point. A first word that names a command becomes the `command=` override."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(HELP, end="")
        return
    if argv and argv[0] in COMMANDS:
        argv = [f"command={argv[0]}", *argv[1:]]
    multirun = bool({"-m", "--multirun"} & set(argv))
    command = next((a.partition("=")[2] for a in argv if a.startswith("command=")), "tune")
    if multirun and command != "tune":
        fail(UserError(f"{command} does not take -m/--multirun: a multirun is a sweep of tuning sessions.",
                       f"Drop -m to {command} one setting, or sweep `mlautotune -m key=a,b` (tune)."))
    elif argv and not argv[0].startswith("-") and "=" not in argv[0]:
        fail(UserError(f"{argv[0]!r} is not a command.", f"Use one of {', '.join(COMMANDS)}, or key=value settings only (tune is the default); see mlautotune --help."))
    # search.sampler is an open dict (the sampler's _target_ and arguments): let its keys be added.
    argv = [f"++{a}" if a.startswith(("search.sampler=", "search.sampler.")) else a for a in argv]
    register_configs()
    redact_log_records()
    # MLflow's HTTP retries and timeouts: see tracking.Tracker (it retries each call itself, with backoff).
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    check_overrides(argv, multirun)
    if not multirun and _cfg_job(argv):
        return print_effective_settings([a for a in argv if a not in ("--cfg", "-c", "job", "--cfg=job")])
    sys.argv = [sys.argv[0], *argv]
    app()


def _cfg_job(argv) -> bool:
    """`--cfg job` (Hydra's print of the composed config), without Hydra's other printing options."""
    asked = "--cfg=job" in argv or any(a in ("--cfg", "-c") and argv[i + 1 : i + 2] == ["job"] for i, a in enumerate(argv))
    return asked and not {"--package", "-p", "--resolve", "--cfg=hydra", "--cfg=all"} & set(argv)


def print_effective_settings(argv) -> None:
    """`--cfg job`: the settings a session runs with, every key: conf/ < the ds_config's autotuning
    section < the command line (Hydra alone composes conf/ and the command line, not the ds_config)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from mlautotune.inputs import config as configlib
    from mlautotune.inputs.checks import given_path

    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=overrides)
        ds_path = given_path(cfg.config, "config", "your ds_config.json", configlib.BUNDLED_CONFIG)
        final = configlib.settings(cfg, configlib.load_ds_config(ds_path), overrides)
    except UserError as e:
        fail(e)
    print(f"# the effective settings: conf/ < {ds_path}'s autotuning section < the command line")
    print(OmegaConf.to_yaml(final), end="")


def check_overrides(argv, multirun: bool = False) -> None:
    """Compose the config once with the key=value overrides (in a multirun, once per swept value), so
    that what Hydra refuses (a misspelt key, a value of the wrong type, a launcher plugin that is not
    installed) gets one paragraph and exit status 2, like every other bad input; `+key`/`~key` (keys
    added to or deleted from the schema) and an output folder that cannot be made are refused too."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    given = [a for a in argv if "=" in a and not a.startswith("-")]
    try:
        parsed = OverridesParser.create().parse_overrides(given)
    except HydraException as e:
        fail(hydra_error(e))
    for o in parsed:
        key = o.get_key_element()
        if key.startswith(("+", "~")) and not o.key_or_group.startswith("search.sampler"):
            fail(UserError(f"{o.input_line!r} {'adds' if key.startswith('+') else 'deletes'} the key {o.key_or_group!r}, which mlautotune does not have or cannot do without: "
                           "the settings are a fixed schema, and an added key would be silently ignored.",
                           f"Set an existing key without the {key[0]} (e.g. autotuning.tuner_num_trials=20); `mlautotune --cfg job` lists every key with its type."))
    variants = [given]
    if multirun:  # each swept value once, the other sweeps at their first value
        first = {i: next(iter(o.sweep_string_iterator()), "") for i, o in enumerate(parsed) if o.is_sweep_override()}
        plain = [o.input_line if i not in first else f"{o.get_key_element()}={_value(first[i])}" for i, o in enumerate(parsed)]
        variants = [plain] + [plain[:i] + [f"{o.get_key_element()}={_value(v)}"] + plain[i + 1:]
                              for i, o in enumerate(parsed) if i in first for v in list(o.sweep_string_iterator())[1:]]
    for overrides in variants:
        try:
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
        except HydraException as e:
            fail(hydra_error(e))
        check_output_dir(str(cfg.hydra.sweep.dir if multirun else cfg.hydra.run.dir), "hydra.sweep.dir" if multirun else "hydra.run.dir")


def _value(text: str) -> str:
    return text if re.fullmatch(r"[\w.:/@+-]*", text) else hydra_quote(text)


def hydra_error(e: Exception) -> UserError:
    text = str(e) + (f": {e.__cause__}" if e.__cause__ else "")
    missing = re.search(r"Could not find '(hydra/[^/']+)/([^']+)'", text)
    if missing:
        group, option = missing.groups()
        options = re.findall(r"^\t(\S+)$", text, flags=re.M)
        return UserError(f"{group}={option} is not an installed Hydra option (available: {', '.join(options) or 'none'}).",
                         f"Install the plugin that provides it (e.g. pip install hydra-{option}-launcher), or leave {group} unset.")
    wrong = re.search(r"Error merging override ([^=\s]+)=(.*?): Value '(.*)' (?:of type '\w+' could not be converted to|is not a valid) (\w+)", text)
    if wrong:
        key, _, value, kind = wrong.groups()
        kind = {"Integer": "a whole number", "Float": "a number", "Boolean": "true or false", "bool": "true or false", "String": "a string"}.get(kind, kind)
        return UserError(f"{key}={value!r} is not {kind}: {key} takes {kind}.", f"Give {key} {kind} (`mlautotune --cfg job` lists every key with its type).")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith(("full_key", "object_type", "reference_type", "To append", "Config search path", "provider="))]
    unknown = re.match(r"Could not override '([^']+)'\.?$", lines[0]) if len(lines) == 1 else None
    if unknown:
        lines = [f"'{unknown.group(1)}' is not a setting of mlautotune (a misspelt key?)"]
    return UserError(" ".join(lines).rstrip(".") + ".", "Check the key against `mlautotune --cfg job` (every key with its type), and the value's type.")


def check_output_dir(path: str, key: str) -> None:
    """Hydra makes its output folder before the app runs: one that cannot be made is refused first."""
    import tempfile

    from mlautotune.inputs.checks import nearest_existing

    base = nearest_existing(Path(path).expanduser().absolute())
    try:
        if not base.is_dir():
            raise NotADirectoryError(20, "not a directory")
        with tempfile.TemporaryFile(dir=base):
            pass
    except OSError as e:
        fail(UserError(f"{key}={path!r} cannot be made: {str(base)!r} is {'not a folder' if not base.is_dir() else 'not writable'} ({e.strerror}).",
                       f"Set {key} to a folder that can be created, or leave it unset."))
