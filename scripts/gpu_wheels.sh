#!/usr/bin/env bash
# Makes .whl/: the wheels the GPU machine lacks for mlautotune, for its Python 3.12 on x86-64 Linux.
# That machine (benchmarks/gpu.md) has torch, numpy, scipy, matplotlib, psutil, py-cpuinfo, ninja,
# msgpack, einops, protobuf, pyyaml, requests, click, anyio and the rest of its image, but no package
# index: what is missing travels as these wheels, and benchmarks/gpu_check.py installs them there with
# `pip install --no-index --no-deps --target`. The versions are the development machine's, so the GPU
# run uses the code the tests ran. DeepSpeed and antlr4 come as source only: their pure-Python wheels
# are built here (DeepSpeed with DS_BUILD_OPS=0: its ops are left to JIT). Wheels already in .whl/
# are kept, so a second run downloads nothing. Prints the total size, which must stay under the
# machine's 64 MiB transfer with the rest of the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=.whl
LIMIT_MIB=64

DEEPSPEED=deepspeed==0.19.8  # source only on PyPI
ANTLR=antlr4-python3-runtime==4.9.3  # source only on PyPI (hydra-core and omegaconf pin 4.9.*)
BINARY=(
  # mlflow-skinny: the tracking client and its sqlite store, without the server and UI of full mlflow
  mlflow-skinny==3.17.2 mlflow-tracing==3.17.2
  cachetools==7.3.3 databricks-sdk==0.162.0
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 gitpython==3.2.1 gitdb==4.0.12 smmap==5.0.3
  importlib-metadata==9.1.0 opentelemetry-api==1.45.2 opentelemetry-proto==1.45.2 opentelemetry-sdk==1.45.2
  opentelemetry-semantic-conventions==0.66b2 python-dotenv==1.2.4 sqlparse==0.6.1
  cryptography==50.0.2 cffi==2.1.1  # MLflow's sqlite store imports Fernet (model registry); cffi's pycparser is not imported
  # optuna, its storage (SQLAlchemy + alembic, also MLflow's sqlite store) and its log colours
  optuna==5.0.0 alembic==1.20.1 sqlalchemy==2.1.9 mako==1.4.3 colorlog==6.12.0
  # hydra and omegaconf
  hydra-core==1.3.8 omegaconf==2.3.1
  # DeepSpeed's needs that the machine lacks
  hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  # XGBoost without its CUDA build and NCCL (the cost model runs on the CPU)
  xgboost-cpu==3.2.0
)

mkdir -p "$OUT"
fail() { echo "gpu_wheels.sh: $1" >&2; exit 1; }
"$PYTHON" -m pip --version >/dev/null 2>&1 || fail "no pip for $PYTHON; run scripts/setup.sh first, or set PYTHON to an interpreter with pip."

# Whether NAME==VERSION's wheel is in .whl/; a wheel of another version of it is removed (two stop the install).
present() {
  local file found=1
  file=$(echo "${1%%==*}" | tr '-' '_')
  for w in "$OUT/$file"-*.whl; do
    [ -e "$w" ] || continue
    if [[ $w == "$OUT/$file-${1#*==}-"* ]]; then found=0; else rm -f "$w"; fi
  done
  return $found
}
to_fetch=()
for spec in "${BINARY[@]}"; do present "$spec" || to_fetch+=("$spec"); done
if [ ${#to_fetch[@]} -gt 0 ]; then
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$OUT" "${to_fetch[@]}" \
    || fail "pip could not download ${to_fetch[*]} (no package index reachable, or a version is gone)."
fi
if ! present "$DEEPSPEED"; then
  # No build isolation: DeepSpeed's setup.py reads torch from the environment that builds it, if it has one.
  DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "$DEEPSPEED" \
    || fail "building the DeepSpeed wheel failed (it needs setuptools and wheel in $PYTHON)."
fi
present "$ANTLR" || "$PYTHON" -m pip wheel -q --no-deps -w "$OUT" "$ANTLR" || fail "building the antlr4 wheel failed."

wheels=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
count=$(ls "$OUT"/*.whl | wc -l)
echo "gpu_wheels.sh: $count wheels in $OUT: $((wheels / 1024 / 1024)) MiB; with the tracked tree ($((tree / 1024 / 1024)) MiB): $(((wheels + tree) / 1024 / 1024)) MiB of $LIMIT_MIB"
[ $((wheels + tree)) -lt $((LIMIT_MIB * 1024 * 1024)) ] || fail "over the $LIMIT_MIB MiB the GPU machine's transfer takes."
