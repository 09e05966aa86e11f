#!/usr/bin/env bash
# Sets up .venv (finds a Python >= 3.12 by itself) and runs the CPU test suite on
# 8 virtual devices. Extra arguments go to pytest. Usage: bash scripts/test.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
# Two workers (pytest-xdist; UNIEP_TEST_WORKERS overrides, 0: none), one test file each at a
# time (a file's compiled programs and module fixtures stay in one process): 2-core CI
# machine, 2026-11-26: 853 s in one process, 603 s in two.
WORKERS="${UNIEP_TEST_WORKERS:-2}"
XDIST=()
[[ "$WORKERS" != 0 ]] && XDIST=(-n "$WORKERS" --dist loadfile)
exec "$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider --durations=15 "${XDIST[@]}" "$@" tests
