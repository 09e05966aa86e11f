#!/usr/bin/env bash
# Sets up .venv (finds a Python >= 3.12 by itself) and runs the CPU test suite on
# 8 virtual devices. Extra arguments go to pytest. Usage: bash scripts/test.sh
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
exec "$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider --durations=15 "$@" tests
