#!/usr/bin/env bash
# Writes BENCH_COMMIT at the repository root (ignored by git): the commit of this tree,
# "+dirty" when tracked files differ from it. uniep_jax.measure.git_commit reads it where
# .git is absent, so that the JSONs of a run name the commit that ran; bench/run_gpu.sh
# exports it as GIT_COMMIT. Run it before copying the tree to another machine.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
echo "$(git rev-parse HEAD)$([[ -n "$(git status --porcelain --untracked-files=no)" ]] && echo +dirty)" > BENCH_COMMIT
cat BENCH_COMMIT
