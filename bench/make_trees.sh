#!/usr/bin/env bash
# Copies committed revisions into build/trees/<NAME> (their files without .git and
# bench/results, each with its own BENCH_COMMIT), so that one device call can time
# several branches side by side in one session of the machine:
#
#   bash bench/make_trees.sh NAME=REV [NAME=REV ...]     e.g. new=fp8-cross-tile old=main
#
# then pass carry ["BENCH_COMMIT", "build/trees"] and run each tree from its folder:
#   (cd build/trees/new && PYTHONPATH=$PWD python -m bench.grouped_gemm ... --out $OUT/new)
# build/ is ignored by git; the JSONs name the revision that ran.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ $# -ge 1 ] || { echo "usage: bash bench/make_trees.sh NAME=REV [NAME=REV ...]" >&2; exit 2; }
for spec in "$@"; do
  name="${spec%%=*}" rev="${spec#*=}"
  [[ "$name" != "$spec" && -n "$name" && "$name" != */* ]] || { echo "bad NAME=REV: $spec" >&2; exit 2; }
  dir="build/trees/$name"
  rm -rf "$dir" && mkdir -p "$dir"
  git archive "$rev" | tar -x -C "$dir" --exclude=bench/results
  git rev-parse "$rev^{commit}" > "$dir/BENCH_COMMIT"
  echo "$dir: $(cat "$dir/BENCH_COMMIT") ($(du -sh "$dir" | cut -f1))"
done
