#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: system pieces, .venv, the project.
# Usage: scripts/setup.sh [--test]     (--test adds what the test suite needs: SLURM + munge, chromium)
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

SUDO=""
if [ "$(id -u)" != 0 ]; then command -v sudo >/dev/null && SUDO="sudo -n" || SUDO=""; fi

apt_missing=()
need_pkg() { dpkg -s "$1" >/dev/null 2>&1 || apt_missing+=("$1"); }
need_pkg dataset-fashion-mnist
if [ "$want_test" = 1 ]; then need_pkg slurm-wlm; need_pkg munge; need_pkg chromium; fi
if [ "${#apt_missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; then
    echo "setup: installing Debian packages: ${apt_missing[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${apt_missing[@]}" >/dev/null
  else
    echo "setup: cannot install ${apt_missing[*]} (not root, no sudo); the stages that need them will say so" >&2
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
# Re-install only when the dependency list changed (the stamp holds pyproject's hash).
stamp=.venv/.tcnn-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "setup: installing the project into .venv (first time: torch + CUDA wheels, a few minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
