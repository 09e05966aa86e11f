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
# time (a file's compiled programs and module fixtures stay in one process): on a 2-core CI
# machine the suite takes 853 s in one process and 603 s in two. Files run in xdist's own
# order: sorting the longest first puts the interpreted-kernel files side by side on the
# two workers and is slower (docs/decisions.md).
WORKERS="${UNIEP_TEST_WORKERS:-2}"
XDIST=()
[[ "$WORKERS" != 0 ]] && XDIST=(-n "$WORKERS" --dist loadfile)
# JAX's persistent compilation cache, empty at the start of every run and removed at its
# end: a program compiled again within the run (the Pallas interpret mode compiles each
# kernel launch's body ahead of time, even for a launch it ran before; the same programs in
# several tests and in both workers) is loaded instead. Keyed by the whole program, so a
# program that differs in anything is compiled. Tests that use a cache of their own
# (test_train, test_multiprocess) switch to it and back. On a 2-core machine it takes
# test_grouped_gemm from 230 to 202 s and a warm test_ordered_reduce from 54 to 13 s.
if [[ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]]; then
  CACHE_DIR="$(mktemp -d "${TMPDIR:-/tmp}/uniep_test_jax_cache.XXXXXX")"
  trap 'rm -rf "$CACHE_DIR"' EXIT
  export JAX_COMPILATION_CACHE_DIR="$CACHE_DIR" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
         JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
fi
"$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider --durations=15 "${XDIST[@]}" "$@" tests
