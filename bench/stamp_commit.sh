#!/usr/bin/env bash
# Writes BENCH_COMMIT (untracked, travels with the tree to the device machine,
# where .git is absent) so that results JSON name the commit that ran.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
echo "$(git rev-parse HEAD)$([[ -n "$(git status --porcelain --untracked-files=no)" ]] && echo +dirty)" > BENCH_COMMIT
cat BENCH_COMMIT
