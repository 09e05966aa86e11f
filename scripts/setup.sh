#!/usr/bin/env bash
# Creates .venv with a Python >= 3.12 found on this machine and installs the project, with
# JAX's CUDA 13 plugin (the optional group "gpu") where nvidia-smi finds an NVIDIA GPU
# (UNIEP_GPU=0 or 1 overrides the detection). Idempotent: a second call only re-checks
# the install. Usage: bash scripts/setup.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${UNIEP_VENV:-$ROOT/.venv}"

is_ok() {  # $1: a python executable; true if it runs and is >= 3.12
  "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
  local c
  if [[ -n "${UNIEP_PYTHON:-}" ]] && is_ok "$UNIEP_PYTHON"; then echo "$UNIEP_PYTHON"; return; fi
  for c in python3.14 python3.13 python3.12 python3; do
    if command -v "$c" >/dev/null 2>&1 && is_ok "$(command -v "$c")"; then command -v "$c"; return; fi
  done
  # pyenv installs (which may not be on PATH or not selected by the shims)
  local roots=("${PYENV_ROOT:-}" "$HOME/.pyenv" "/root/.pyenv" "/opt/pyenv" "/usr/local/pyenv")
  for r in "${roots[@]}"; do
    [[ -n "$r" && -d "$r/versions" ]] || continue
    for c in $(ls -1 "$r/versions" | sort -t. -k1,1n -k2,2n -k3,3n -r); do
      if [[ -x "$r/versions/$c/bin/python" ]] && is_ok "$r/versions/$c/bin/python"; then
        echo "$r/versions/$c/bin/python"; return
      fi
    done
  done
  for c in /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9] /opt/*/bin/python3.1[2-9]; do
    if [[ -x "$c" ]] && is_ok "$c"; then echo "$c"; return; fi
  done
  return 1
}

if [[ ! -x "$VENV/bin/python" ]] || ! is_ok "$VENV/bin/python"; then
  PY="$(find_python)" || { echo "setup: no Python >= 3.12 found (set UNIEP_PYTHON=/path/to/python3.12)" >&2; exit 1; }
  echo "setup: creating $VENV with $PY ($("$PY" --version 2>&1))"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi

GPU="${UNIEP_GPU:-}"
if [[ -z "$GPU" ]]; then
  GPU=0
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "^GPU"; then GPU=1; fi
fi
EXTRAS="test"
[[ "$GPU" == 1 ]] && EXTRAS="test,gpu"
STAMP="$VENV/.uniep-installed-$EXTRAS"
if [[ ! -f "$STAMP" || "$ROOT/pyproject.toml" -nt "$STAMP" ]]; then
  echo "setup: installing uniep-jax[$EXTRAS] and its dependencies into $VENV"
  # a current pip: an old one (23.2, the venv's own with Python 3.12.1) makes a
  # fresh set-up slower (92 s against 78 s on a CI machine)
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
  # pip byte-compiles every installed file on one core; compileall on every core instead
  # (on a 2-core machine 29.7 s -> 11.6 + 8.8 s). The .pyc files must exist: with
  # PYTHONDONTWRITEBYTECODE set every process would compile its imports again
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-compile -e "$ROOT[$EXTRAS]" 2>&1 | grep -v "is ignored: it is neither" || true
  "$VENV/bin/python" -m compileall -q -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null 2>&1 || true
  "$VENV/bin/python" -c 'import jax, flax, optax, chex, orbax.checkpoint, pytest, xdist' \
    || { echo "setup: install failed" >&2; exit 1; }
  touch "$STAMP"
fi
# the installed versions, read without importing jax (~1.5 s)
echo "setup: ready ($("$VENV/bin/python" -c 'import importlib.metadata as m; print("jax", m.version("jax"))'))"
