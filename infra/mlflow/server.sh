#!/usr/bin/env bash
# An MLflow tracking server for tcnn: sqlite (default) or PostgreSQL backend, artifact proxying, loopback only
# unless told otherwise.
#
#   infra/mlflow/server.sh            # = run: in the foreground (Ctrl-C stops it)
#   infra/mlflow/server.sh start      # in the background; waits until /health answers; prints the URL
#   infra/mlflow/server.sh stop       # stops the background server
#   infra/mlflow/server.sh status     # exit 0 when it answers
#
# Then point the pipeline at it:  -S tracking.uri=http://127.0.0.1:5000  (or tracking.uri in params.yaml).
#
# Settings (environment):
#   TCNN_MLFLOW_HOST          interface to bind [127.0.0.1]; anything else also needs TCNN_MLFLOW_ALLOWED_HOSTS
#   TCNN_MLFLOW_PORT          [5000]
#   TCNN_MLFLOW_BACKEND_URI   [sqlite:///<repo>/mlruns.db, the pipeline's embedded store, so the UI shows it]
#                             e.g. postgresql://user:pass@db-host:5432/mlflow (needs psycopg2 in the venv)
#   TCNN_MLFLOW_ARTIFACTS     where proxied artifacts are stored [<repo>/mlartifacts]; a path or s3://... URI
#   TCNN_MLFLOW_WORKERS       server worker processes [2]
#   TCNN_MLFLOW_ALLOWED_HOSTS comma-separated Host headers accepted when not on loopback (DNS-rebinding guard)
#   TCNN_MLFLOW_STATE         pid + log directory for start/stop [/tmp/tcnn-mlflow-<port>]
#   TCNN_MLFLOW_BIN           the mlflow executable [<repo>/.venv/bin/mlflow, else mlflow on PATH]
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
HOST=${TCNN_MLFLOW_HOST:-127.0.0.1}
PORT=${TCNN_MLFLOW_PORT:-5000}
BACKEND=${TCNN_MLFLOW_BACKEND_URI:-sqlite:///$REPO/mlruns.db}
ARTIFACTS=${TCNN_MLFLOW_ARTIFACTS:-$REPO/mlartifacts}
WORKERS=${TCNN_MLFLOW_WORKERS:-2}
STATE=${TCNN_MLFLOW_STATE:-/tmp/tcnn-mlflow-$PORT}
MLFLOW=${TCNN_MLFLOW_BIN:-}
if [ -z "$MLFLOW" ]; then
  if [ -x "$REPO/.venv/bin/mlflow" ]; then MLFLOW="$REPO/.venv/bin/mlflow"; else MLFLOW=mlflow; fi
fi
PY=$(dirname "$(command -v "$MLFLOW" || echo "$MLFLOW")")/python
[ -x "$PY" ] || PY=python3
# The GenAI job runner (huey consumers) is not needed for tcnn and costs seconds and memory at start.
export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false}
URL="http://$HOST:$PORT"
[ "$HOST" = "0.0.0.0" ] && URL="http://127.0.0.1:$PORT"

die() {
  echo "mlflow server: error: $*" >&2
  exit 2
}

check() {
  command -v "$MLFLOW" >/dev/null 2>&1 || die "mlflow not found ($MLFLOW); run scripts/setup.sh"
  [[ "$PORT" =~ ^[0-9]+$ ]] && [ "$PORT" -ge 1 ] && [ "$PORT" -le 65535 ] || die "TCNN_MLFLOW_PORT: bad port '$PORT'"
  case "$BACKEND" in
    sqlite:///*)
      local db=${BACKEND#sqlite:///}
      mkdir -p "$(dirname "$db")" || die "TCNN_MLFLOW_BACKEND_URI: cannot create the directory of $db"
      ;;
    postgresql*://*)
      "$PY" -c "import psycopg2" 2>/dev/null || "$PY" -c "import psycopg" 2>/dev/null ||
        die "TCNN_MLFLOW_BACKEND_URI: a PostgreSQL backend needs psycopg2 (.venv/bin/pip install psycopg2-binary)"
      ;;
    mysql*://* | mssql*://*) ;;
    *) die "TCNN_MLFLOW_BACKEND_URI: unsupported backend '$BACKEND' (sqlite:///PATH or postgresql://...)" ;;
  esac
  case "$ARTIFACTS" in
    *://*) ;;
    *) mkdir -p "$ARTIFACTS" || die "TCNN_MLFLOW_ARTIFACTS: cannot create $ARTIFACTS" ;;
  esac
}

args() {
  local -a a=(server --backend-store-uri "$BACKEND" --serve-artifacts --artifacts-destination "$ARTIFACTS"
    --host "$HOST" --port "$PORT" --workers "$WORKERS")
  if [ -n "${TCNN_MLFLOW_ALLOWED_HOSTS:-}" ]; then
    a+=(--allowed-hosts "$TCNN_MLFLOW_ALLOWED_HOSTS")
  elif [ "$HOST" != "127.0.0.1" ] && [ "$HOST" != "localhost" ]; then
    echo "mlflow server: warning: binding $HOST; set TCNN_MLFLOW_ALLOWED_HOSTS to the names clients use" >&2
  fi
  printf '%s\n' "${a[@]}"
}

alive() { "$PY" - "$URL/health" <<'EOF' 2>/dev/null
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=3) as r:
    sys.exit(0 if r.status == 200 else 1)
EOF
}

run() {
  check
  mapfile -t a < <(args)
  echo "mlflow server: $URL (backend $BACKEND, artifacts $ARTIFACTS); the runs: $URL/#/?workflowType=machine_learning" >&2
  exec "$MLFLOW" "${a[@]}"
}

start() {
  check
  mkdir -p "$STATE"
  if [ -f "$STATE/server.pid" ] && kill -0 "$(cat "$STATE/server.pid")" 2>/dev/null && alive; then
    echo "$URL"
    return 0
  fi
  alive && die "something already answers on $URL (not started by this script; state $STATE)"
  mapfile -t a < <(args)
  # setsid: the server and its workers form one process group that stop can end as a whole.
  setsid "$MLFLOW" "${a[@]}" >"$STATE/server.log" 2>&1 </dev/null &
  echo $! >"$STATE/server.pid"
  local timeout=${TCNN_MLFLOW_START_TIMEOUT:-180}
  for _ in $(seq 1 $((timeout * 2))); do
    if alive; then
      echo "$URL"
      return 0
    fi
    kill -0 "$(cat "$STATE/server.pid")" 2>/dev/null || {
      tail -n 20 "$STATE/server.log" >&2
      die "the server exited (log $STATE/server.log)"
    }
    sleep 0.5
  done
  stop
  die "no answer on $URL/health after ${timeout}s (log $STATE/server.log)"
}

stop() {
  [ -f "$STATE/server.pid" ] || return 0
  local pid
  pid=$(cat "$STATE/server.pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  fi
  rm -f "$STATE/server.pid"
}

case "${1:-run}" in
  run) run ;;
  start) start ;;
  stop) stop ;;
  status) if alive; then echo "up: $URL"; else echo "down: $URL" >&2; exit 1; fi ;;
  *)
    echo "usage: $0 [run|start|stop|status]" >&2
    exit 2
    ;;
esac
