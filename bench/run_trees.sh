#!/usr/bin/env bash
# Runs one benchmark in each tree that bench/make_trees.sh copied, one after another,
# each under a time limit, into OUT_DIR/<NAME> (log: OUT_DIR/<NAME>.log):
#
#   bash bench/run_trees.sh OUT_DIR SECONDS "MODULE ARGS" NAME [NAME ...]
#   e.g. bash bench/run_trees.sh $OUT 240 "bench.grouped_gemm --precision fp8 --fp8-tiles 64x128" new old
#
# Each runs as `python -m MODULE ARGS --out OUT_DIR/<NAME>` from build/trees/<NAME> with
# PYTHONPATH at that tree, so its JSON names that tree's commit. The last 40 lines of
# each log are printed; exits 1 when a run failed or timed out.
set -u
[ $# -ge 4 ] || { echo "usage: bash bench/run_trees.sh OUT_DIR SECONDS \"MODULE ARGS\" NAME [NAME ...]" >&2; exit 2; }
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="$(mkdir -p "$1" && cd "$1" && pwd)" SECONDS_EACH="$2" CMD="$3"
shift 3
status=0
for name in "$@"; do
  tree="$ROOT/build/trees/$name"
  [ -d "$tree" ] || { echo "$tree: no such tree (bash bench/make_trees.sh $name=REV)" >&2; exit 2; }
  # shellcheck disable=SC2086  # CMD is split on whitespace on purpose
  (cd "$tree" && PYTHONPATH="$tree" PYTHONUNBUFFERED=1 timeout "$SECONDS_EACH" \
     "${PYTHON:-python3}" -m $CMD --out "$OUT_DIR/$name") > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  echo "== $name ($(cat "$tree/BENCH_COMMIT")): exit $rc"
  tail -40 "$OUT_DIR/$name.log"
  [ $rc -eq 0 ] || status=1
done
exit $status
