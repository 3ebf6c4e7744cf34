#!/usr/bin/env bash
# Sets up the environment and runs the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"  # as after activating it: the same ninja that built DeepSpeed's ops in setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=20 "$@"
