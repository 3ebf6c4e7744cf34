#!/usr/bin/env bash
# Creates .venv and installs mlautotune with its test extras. torch is pinned to the CPU build
# for development and CI (an unpinned torch would pull several GB of CUDA packages).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH="torch==2.13.0"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# pip is skipped when this .venv was set up from this very pyproject.toml and torch pin (a stamp in
# .venv) and imports everything: a fresh clone has no .venv and installs all of it.
stamp=".venv/.mlautotune-setup"
want="$TORCH $PWD $(sha256sum pyproject.toml | cut -d' ' -f1)"
imports() { .venv/bin/python -c "import mlautotune, torch, deepspeed, mlflow, optuna, hydra, xgboost" 2>/dev/null; }
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ] && imports; then
  echo "mlautotune: .venv already holds this pyproject.toml's packages; pip install skipped"
else
  rm -f "$stamp"
  .venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -m pip install -q "$TORCH" -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
  imports
  echo "$want" > "$stamp"
fi
# DeepSpeed compiles its ops on first use (about 100 s on CPU): do it now, once per machine, not inside an experiment.
# With .venv/bin first on PATH, as after `. .venv/bin/activate`: the ninja that builds them is the one the
# experiments' ranks run (the system's, if there is one, would rebuild them in the first experiment).
PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -m mlautotune.run.ops 2>&1 | grep -v "real_accelerator.py" || true
# PostgreSQL for the shared-session tests (tests/test_workers.py starts it through scripts/services.sh).
bash scripts/services.sh install || echo "mlautotune: warning: without PostgreSQL, tests/test_workers.py fails (shared sessions need it, see README)"
echo "mlautotune: environment ready in .venv"
