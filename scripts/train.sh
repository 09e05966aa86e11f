#!/usr/bin/env bash
# Sets up .venv (finds a Python >= 3.12 by itself) and runs the main job: training
# the reference MoE transformer on its embedded default (the `tiny` config on the
# CPU, 8 virtual devices, mesh data=2,expert=4). Extra arguments go to `python -m train`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m train "$@"
