"""The MLproject's entry point: MLflow parameters -> Hydra overrides (empty ones dropped) -> the app."""

import shlex
import sys

from mlautotune import cli
from mlautotune.cli import hydra_quote
from mlautotune.errors import UserError
from mlautotune.inputs.config import MLPROJECT_KEYS

KEYS = MLPROJECT_KEYS


def overrides(argv: list) -> list:
    """The Hydra command line: the `overrides` parameter's words first (Hydra's flags, such as `-m`
    for a multirun, must come before the key=value overrides), then one override per MLflow parameter."""
    first, out = [], []
    for arg in argv:
        name, _, value = arg.partition("=")
        if name == "overrides":
            try:
                first += shlex.split(value)
            except ValueError as e:
                cli.fail(UserError(f"The MLproject parameter overrides={value!r} cannot be split into settings ({e}).", "Close the quote, e.g. -P overrides=\"script_args='--epochs 1'\"."))
        elif name in KEYS and value != "":
            out.append(f"{KEYS[name]}={hydra_quote(value) if name in ('script_args', 'config', 'script', 'hostfile', 'results_dir') else value}")
        elif name not in KEYS:
            cli.fail(UserError(f"{name!r} is not a parameter of the MLproject.", f"Use one of {', '.join(KEYS)}, overrides (mlflow run . -P config=ds.json -P overrides='key=value ...')."))
    return first + out


def main() -> None:
    sys.argv = [sys.argv[0], *overrides(sys.argv[1:])]
    cli.main()


if __name__ == "__main__":
    main()
