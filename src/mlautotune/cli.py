"""The command line: `mlautotune [tune|plan|experiment|sync] key=value ...` (a Hydra application)."""

import re
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from mlautotune.inputs.config import COMMANDS, register_configs, validate_command
from mlautotune.errors import UserError

HELP = """\
usage: mlautotune [COMMAND] [key=value ...]
       mlautotune-deepspeed [DeepSpeed launcher flags] train.py --deepspeed ds.json [script args]

Find the fastest DeepSpeed configuration (ZeRO stage, micro-batch, ZeRO knobs) for an unchanged
training script. Every experiment is a real DeepSpeed launcher run, tracked in MLflow.

commands:
  tune          tune (the default); mode=run then trains with the optimum
  plan          print the settings and the first experiments; runs and writes nothing
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
  search.<key>=...            seed, storage, session, sampler, remeasure, explore, heartbeat_seconds

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
        run(cfg)
    except UserError as e:
        fail(e)
    except Exception as e:
        if type(e).__name__ != "SessionFailed":
            raise
        print(f"mlautotune: {e}", file=sys.stderr)
        sys.exit(1)


def hydra_quote(text: str) -> str:
    """A Hydra override value that is exactly `text` (a single-quoted string, quotes and backslashes escaped)."""
    # Hydra: inside quotes, only backslashes before a quote (or before the closing quote) are escapes.
    return "'" + re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""), text) + "'"


def fail(e: UserError) -> None:
    print(f"mlautotune: error: {e.message}", file=sys.stderr)
    sys.exit(e.exit_code)


def main(argv=None) -> None:
    """Entry point. A first word that names a command becomes the `command=` override."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(HELP, end="")
        return
    if argv and argv[0] in COMMANDS:
        argv = [f"command={argv[0]}", *argv[1:]]
    elif argv and not argv[0].startswith("-") and "=" not in argv[0]:
        fail(UserError(f"{argv[0]!r} is not a command.", f"Use one of {', '.join(COMMANDS)}, or key=value settings only (tune is the default); see mlautotune --help."))
    # search.sampler is an open dict (the sampler's _target_ and arguments): let its keys be added.
    argv = [f"++{a}" if a.startswith(("search.sampler=", "search.sampler.")) else a for a in argv]
    register_configs()
    # MLflow's HTTP retries and timeouts: see tracking.Tracker (it retries each call itself, with backoff).
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if not {"-m", "--multirun"} & set(argv):
        check_overrides(argv)
        if _cfg_job(argv):
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


def check_overrides(argv) -> None:
    """Compose the config once with the key=value overrides, so that one Hydra refuses (a misspelt key,
    a value of the wrong type) gets one paragraph and exit status 2, like every other bad input."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    overrides = [a for a in argv if "=" in a and not a.startswith("-") and not a.lstrip("+~").startswith(("hydra.", "hydra/"))]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            compose(config_name="config", overrides=overrides)
    except HydraException as e:
        text = str(e) + (f": {e.__cause__}" if e.__cause__ else "")
        lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith(("full_key", "object_type", "reference_type", "To append"))]
        unknown = re.match(r"Could not override '([^']+)'\.?$", lines[0]) if len(lines) == 1 else None
        if unknown:
            lines = [f"'{unknown.group(1)}' is not a setting of mlautotune (a misspelt key?)"]
        fail(UserError(" ".join(lines).rstrip(".") + ".", "Check the key against `mlautotune --cfg job` (every key with its type), and the value's type."))
