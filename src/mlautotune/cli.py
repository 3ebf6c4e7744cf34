"""The command line: `mlautotune [tune|plan|experiment|sync] key=value ...` (a Hydra application)."""

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from mlautotune.config import register_configs
from mlautotune.errors import UserError

COMMANDS = ("tune", "plan", "experiment", "sync")


@hydra.main(version_base="1.3", config_path=str(Path(__file__).parent / "conf"), config_name="config")
def app(cfg: DictConfig) -> None:
    try:
        if cfg.command == "plan":
            from mlautotune.commands import plan_command as run
        elif cfg.command == "experiment":
            from mlautotune.commands import experiment_command as run
        elif cfg.command == "sync":
            from mlautotune.commands import sync_command as run
        else:
            from mlautotune.commands import tune_command as run
        run(cfg)
    except UserError as e:
        print(f"mlautotune: error: {e.message}", file=sys.stderr)
        sys.exit(e.exit_code)
    except Exception as e:
        if type(e).__name__ != "SessionFailed":
            raise
        print(f"mlautotune: {e}", file=sys.stderr)
        sys.exit(1)


def main() -> None:
    """Entry point. A first word that names a command becomes the `command=` override."""
    register_configs()
    # MLflow's HTTP retries and timeouts: see tracking.Tracker (it retries each call itself, with backoff).
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if len(sys.argv) > 1 and sys.argv[1] in COMMANDS:
        sys.argv = [sys.argv[0], f"command={sys.argv[1]}", *sys.argv[2:]]
    app()
