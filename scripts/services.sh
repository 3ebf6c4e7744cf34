#!/usr/bin/env bash
# Local servers for a shared tuning session: PostgreSQL (the Optuna study, MLflow's backend store)
# and an MLflow tracking server that serves the artifacts, both on loopback, with their data in DIR.
#
#   bash scripts/services.sh start DIR     # prints, and writes to DIR/env.sh, the variables to use
#   bash scripts/services.sh stop DIR
#   bash scripts/services.sh status DIR
#   bash scripts/services.sh install       # only make sure PostgreSQL is installed (scripts/setup.sh does this)
#
# Ports: PG_PORT (default 55432) and MLFLOW_PORT (default 55000). The database password is
# random, kept in DIR/env.sh (mode 600); nothing listens beyond 127.0.0.1.
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"  # runuser, for root
cd "$(dirname "$0")/.."
ROOT=$(pwd)
cmd=${1:-}; dir=${2:-}
if [ -z "$cmd" ] || { [ -z "$dir" ] && [ "$cmd" != install ]; }; then
  echo "usage: bash scripts/services.sh start|stop|status DIR, or install" >&2; exit 2
fi
if [ -n "$dir" ]; then mkdir -p "$dir"; dir=$(cd "$dir" && pwd); fi
PG_PORT=${PG_PORT:-55432}
MLFLOW_PORT=${MLFLOW_PORT:-55000}
PY=${PYTHON:-$ROOT/.venv/bin/python}
MLFLOW=$(dirname "$PY")/mlflow

pg_bin() {
  local bin
  bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  if [ -z "$bin" ]; then
    echo "services: installing PostgreSQL (Debian package)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q postgresql >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q postgresql >/dev/null 2>&1; } || true
    bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
    if [ -z "$bin" ]; then
      echo "services: PostgreSQL is not installed and could not be installed here. Install Debian's package as root (apt-get install postgresql), then run this again." >&2
      exit 2
    fi
  fi
  echo "$bin"
}

# PostgreSQL refuses to run as root: run it as the `postgres` user then.
as_pg() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

start() {
  local bin; bin=$(pg_bin)
  if [ ! -f "$dir/env.sh" ]; then
    local password; password=$("$PY" -c "import secrets; print(secrets.token_hex(16))")
    mkdir -p "$dir/pg" "$dir/artifacts"
    [ "$(id -u)" = 0 ] && chown postgres "$dir/pg" && chmod 700 "$dir/pg"
    printf '%s\n' "$password" > "$dir/pg.pw"
    [ "$(id -u)" = 0 ] && chown postgres "$dir/pg.pw"
    if ! as_pg test -w "$dir/pg"; then
      echo "services: the postgres user cannot write $dir/pg (a parent folder is private to root). Use a data folder it can reach, e.g. one under /srv or /var/tmp." >&2
      exit 2
    fi
    as_pg "$bin/initdb" -D "$dir/pg" -U mlautotune -E UTF8 --locale=C --pwfile="$dir/pg.pw" -A scram-sha-256 >/dev/null
    rm -f "$dir/pg.pw"
    umask 077
    cat > "$dir/env.sh" <<EOF
# Written by scripts/services.sh; source it in every shell that runs a worker.
export MLAUTOTUNE_PG_URL=postgresql://mlautotune:$password@127.0.0.1:$PG_PORT
export MLAUTOTUNE_STORAGE=postgresql://mlautotune:$password@127.0.0.1:$PG_PORT/optuna
export MLFLOW_TRACKING_URI=http://127.0.0.1:$MLFLOW_PORT
EOF
    umask 022
  fi
  # shellcheck disable=SC1091
  . "$dir/env.sh"
  if ! as_pg "$bin/pg_ctl" -D "$dir/pg" status >/dev/null 2>&1; then
    as_pg "$bin/pg_ctl" -D "$dir/pg" -w -l "$dir/pg/server.log" \
      -o "-p $PG_PORT -c listen_addresses=127.0.0.1 -k $dir/pg" start >/dev/null
  fi
  for db in optuna mlflow; do
    PGPASSFILE=/dev/null "$PY" - "$MLAUTOTUNE_PG_URL" "$db" <<'EOF'
import sys, sqlalchemy
engine = sqlalchemy.create_engine(sys.argv[1] + "/postgres", isolation_level="AUTOCOMMIT")
with engine.connect() as c:
    if not c.execute(sqlalchemy.text("SELECT 1 FROM pg_database WHERE datname = :d"), {"d": sys.argv[2]}).first():
        c.execute(sqlalchemy.text(f'CREATE DATABASE "{sys.argv[2]}"'))
EOF
  done
  if ! curl -sf "http://127.0.0.1:$MLFLOW_PORT/health" >/dev/null 2>&1; then
    nohup "$MLFLOW" server --backend-store-uri "$MLAUTOTUNE_PG_URL/mlflow" --serve-artifacts \
      --artifacts-destination "$dir/artifacts" --host 127.0.0.1 --port "$MLFLOW_PORT" --workers 1 \
      > "$dir/mlflow.log" 2>&1 < /dev/null &
    echo $! > "$dir/mlflow.pid"
    for _ in $(seq 1 120); do
      curl -sf "http://127.0.0.1:$MLFLOW_PORT/health" >/dev/null 2>&1 && break
      kill -0 "$(cat "$dir/mlflow.pid")" 2>/dev/null || { echo "services: mlflow server failed; see $dir/mlflow.log" >&2; tail -5 "$dir/mlflow.log" >&2; exit 1; }
      sleep 1
    done
  fi
  echo "services: PostgreSQL on 127.0.0.1:$PG_PORT, MLflow on http://127.0.0.1:$MLFLOW_PORT (data in $dir)"
  echo "services: in each worker's shell: . $dir/env.sh"
}

stop() {
  if [ -f "$dir/mlflow.pid" ]; then
    local pid; pid=$(cat "$dir/mlflow.pid")
    pkill -TERM -P "$pid" 2>/dev/null || true
    kill "$pid" 2>/dev/null || true
    rm -f "$dir/mlflow.pid"
  fi
  local bin; bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)
  if [ -n "$bin" ] && [ -d "$dir/pg" ]; then
    as_pg "$bin/pg_ctl" -D "$dir/pg" -m fast stop >/dev/null 2>&1 || true
  fi
  echo "services: stopped (data kept in $dir)"
}

status() {
  local bin; bin=$(pg_bin)
  as_pg "$bin/pg_ctl" -D "$dir/pg" status || true
  [ -f "$dir/env.sh" ] && . "$dir/env.sh" && curl -sf "${MLFLOW_TRACKING_URI}/health" && echo " (mlflow)"
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  install) echo "services: PostgreSQL in $(pg_bin)" ;;
  *) echo "usage: bash scripts/services.sh start|stop|status DIR, or install" >&2; exit 2 ;;
esac
