"""The MLproject's entry point: MLflow parameters -> Hydra overrides (empty ones dropped) -> the app."""

import os
import shlex
import sys

from mlautotune import cli
from mlautotune.cli import hydra_quote
from mlautotune.errors import UserError
from mlautotune.inputs.config import MLPROJECT_KEYS

KEYS = MLPROJECT_KEYS


def overrides(argv: list) -> list:
    out = []
    for arg in argv:
        name, _, value = arg.partition("=")
        if name == "overrides":
            try:
                out += shlex.split(value)
            except ValueError as e:
                cli.fail(UserError(f"The MLproject parameter overrides={value!r} cannot be split into settings ({e}).", "Close the quote, e.g. -P overrides=\"script_args='--epochs 1'\"."))
        elif name in KEYS and value != "":
            out.append(f"{KEYS[name]}={hydra_quote(value) if name in ('script_args', 'config', 'script', 'hostfile', 'results_dir') else value}")
        elif name not in KEYS:
            cli.fail(UserError(f"{name!r} is not a parameter of the MLproject.", f"Use one of {', '.join(KEYS)}, overrides (mlflow run . -P config=ds.json -P overrides='key=value ...')."))
    return out


def main() -> None:
    # The params `mlflow run` logged on the run it created, so the session does not log them twice.
    given = [a.partition("=")[0] for a in sys.argv[1:] if a.partition("=")[2] != ""]
    os.environ["MLAUTOTUNE_MLPROJECT_PARAMS"] = ",".join(n for n in given if n in KEYS)
    sys.argv = [sys.argv[0], *overrides(sys.argv[1:])]
    cli.main()


if __name__ == "__main__":
    main()
