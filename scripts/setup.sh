#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: system pieces, then .venv exactly as uv.lock pins it (the project
# installed editable).
# Usage: scripts/setup.sh [--test]     (--test adds what the test suite needs: SLURM + munge, chromium, iproute2)
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

SUDO=""
if [ "$(id -u)" != 0 ]; then command -v sudo >/dev/null && SUDO="sudo -n" || SUDO=""; fi

apt_missing=()
need_pkg() { dpkg -s "$1" >/dev/null 2>&1 || apt_missing+=("$1"); }
need_pkg dataset-fashion-mnist
# g++, ninja, Python headers: the GPSA's C++ attention, built from source below (core/nn/gated_attention_cpp.py)
need_pkg g++; need_pkg ninja-build; need_pkg python3-dev
# iproute2: the network namespaces of the multi-node test cluster (infra/slurm/local_cluster.sh)
if [ "$want_test" = 1 ]; then need_pkg slurm-wlm; need_pkg munge; need_pkg chromium; need_pkg iproute2; fi
# The Debian packages install in the background while uv builds .venv (both mostly wait on downloads and disk;
# on a fresh machine that is about a minute less): waited for, and their failure reported, before anything
# below needs them (the C++ build needs g++).
apt_pid=""
apt_log=$(mktemp)
# nothing outlives this script: an early exit (a failed uv sync) still waits for apt-get
trap 'if [ -n "$apt_pid" ]; then wait "$apt_pid" || true; fi; rm -f "$apt_log"' EXIT
apt_t0=$(date +%s)
if [ "${#apt_missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] || [ -n "$SUDO" ]; then
    echo "setup: installing Debian packages: ${apt_missing[*]}"
    (
      $SUDO apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${apt_missing[@]}"
    ) >"$apt_log" 2>&1 </dev/null &
    apt_pid=$!
  else
    echo "setup: cannot install ${apt_missing[*]} (not root, no sudo); the stages that need them will say so" >&2
  fi
fi
wait_apt() {
  [ -n "$apt_pid" ] || return 0
  local rc=0
  wait "$apt_pid" || rc=$?
  apt_pid=""
  if [ "$rc" != 0 ]; then
    grep -v '^debconf\|^$' "$apt_log" >&2 || true
    echo "setup: installing ${apt_missing[*]} failed (apt-get exit $rc)" >&2
    exit "$rc"
  fi
  echo "setup: Debian packages installed ($(( $(date +%s) - apt_t0 )) s from the start)"
}

PY=${PYTHON:-python3}
# uv installs the locked environment (uv.lock). Its release is pinned once, in pyproject.toml's
# [tool.uv] required-version; a matching uv on PATH is used, else that release goes into .tools/.
uv_pin=$("$PY" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["tool"]["uv"]["required-version"].lstrip("="))')
UV=$(command -v uv || true)
if [ -z "$UV" ] || [ "$("$UV" --version | cut -d' ' -f2)" != "$uv_pin" ]; then
  UV=.tools/bin/uv
  if [ ! -x "$UV" ] || [ "$("$UV" --version | cut -d' ' -f2)" != "$uv_pin" ]; then
    echo "setup: installing uv $uv_pin into .tools"
    "$PY" -m venv .tools
    .tools/bin/python -m pip install -q "uv==$uv_pin"
  fi
fi
# Exactly the lock: --locked refuses a uv.lock that no longer matches pyproject.toml (docs/environment.md,
# "Updating the lock"); packages the lock does not name are removed. A no-op when .venv already matches.
echo "setup: .venv <- uv.lock (uv sync --locked)"
UV_PYTHON_DOWNLOADS=never "$UV" sync --locked --extra dev --python "$PY" --quiet
echo "setup: .venv ready ($(( $(date +%s) - apt_t0 )) s from the start)"
wait_apt
# `dvc plots show`'s page with the Vega libraries inlined (from the locked wheel): it draws offline.
.venv/bin/python scripts/dvc_plots_page.py
# The GPSA's C++ attention (core/nn/csrc), compiled once into the user's cache (~/.cache/tcnn/torch_extensions,
# shared by every checkout and DVC experiment workspace: the build is named by its content); on failure the layers use
# the Python path and the log says so once. About a minute of one core.
t0=$(date +%s)
if .venv/bin/python -c 'import sys; from core.nn.gated_attention_cpp import available, build_root
print(f"setup: the GPSA C++ attention (built once into {build_root()})", flush=True); sys.exit(not available())'; then
  echo "setup: GPSA C++ attention ready ($(( $(date +%s) - t0 )) s)"
else
  echo "setup: the GPSA C++ attention did not build; the Python path is used (core/nn/gated_attention_cpp.py)" >&2
fi
