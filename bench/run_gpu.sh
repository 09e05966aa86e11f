#!/usr/bin/env bash
# Runs benchmarks one after another, each under its own time limit, into one folder.
#
#   bash bench/run_gpu.sh OUT_DIR PHASE[:SECONDS] [PHASE[:SECONDS] ...]
#   e.g. bash bench/run_gpu.sh /tmp/run1 check:200 layer:480 train:300
#
# Phases, what each runs, and the variable holding its extra arguments (split on
# whitespace, no quoting; they come after --out, so they may override it):
#   layer     python -m bench.moe_layer --out OUT_DIR          $LAYER_ARGS
#   gemm      python -m bench.grouped_gemm --out OUT_DIR       $GEMM_ARGS
#   check     python -m bench.check_moe_gpu --out OUT_DIR      $CHECK_ARGS
#   odd       python -m bench.check_odd_shapes --out OUT_DIR   $ODD_ARGS
#   balance   python -m bench.replication --out OUT_DIR        $BALANCE_ARGS
#   sweep     python -m bench.determinism_sweep --out OUT_DIR  $SWEEP_ARGS
#   train     python -m bench.train_throughput --out OUT_DIR   $TRAIN_ARGS
#   profile   python -m bench.profile_layer --out OUT_DIR      $PROFILE_ARGS
#   stepdiff  python -m bench.train_step_diff --out OUT_DIR    $STEPDIFF_ARGS
#   tune      python -m uniep_jax.autotune --out OUT_DIR/tune  $TUNE_ARGS
#             (its reports and, unless $UNIEP_TUNE_CACHE names one, its cache file there)
#   mp        bash bench/multiprocess_gpu.sh                   $MP_ARGS ([NGPUS] [BACKENDS])
#             (into OUT_DIR/multiprocess; each of its steps limited to $MP_LIMIT_S,
#             default a fifth of the phase's limit)
# SECONDS: the phase's time limit (default $DEFAULT_LIMIT_S, else 600). At the limit the
# phase gets SIGUSR1 (the Python benchmarks that register it print every thread's stack
# and go on; the others end) and SIGKILL $KILL_GRACE_S seconds later (default 20).
# A phase's stdout and stderr go to OUT_DIR/<phase>.log; a phase named a second time
# writes into OUT_DIR/<phase>_2/ and OUT_DIR/<phase>_2.log, and so on.
# Every phase runs whatever the others returned. OUT_DIR/run_gpu.log lists each phase's
# command, exit status and seconds; the script exits 0 when every phase exited 0, 1 when
# one did not, 2 on a bad command line (nothing runs then).
#
# Environment: PYTHONPATH (the repository first), PYTHONUNBUFFERED=1, OUT=OUT_DIR,
# NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# (no NVLink multicast), GIT_COMMIT from the repository's BENCH_COMMIT when present, and
# for sweep and tune XLA's deterministic ops (--xla_gpu_deterministic_ops=true added to
# XLA_FLAGS: no GEMM autotuning while their compile threads run). $PYTHON: the
# interpreter (default python3). Run `bash bench/stamp_commit.sh` before copying the
# tree to the GPU machine: a .git there, if any, may not be this tree's, and the JSONs
# would name its commit.
set -u

PHASES="layer gemm check odd balance sweep train profile stepdiff tune mp"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
DEFAULT_LIMIT_S="${DEFAULT_LIMIT_S:-600}"
KILL_GRACE_S="${KILL_GRACE_S:-20}"

usage() {
  echo "usage: bash bench/run_gpu.sh OUT_DIR PHASE[:SECONDS] [PHASE[:SECONDS] ...]" >&2
  echo "phases: $PHASES" >&2
  exit 2
}

[ $# -ge 2 ] || usage
OUT_DIR="$1"
shift

# Check every phase before anything runs.
for spec in "$@"; do
  name="${spec%%:*}"
  limit="${spec#"$name"}"
  limit="${limit#:}"
  case " $PHASES " in
    *" $name "*) ;;
    *) echo "run_gpu.sh: unknown phase '$name' in '$spec' (known: $PHASES)" >&2; exit 2 ;;
  esac
  if [ -n "$limit" ] && ! [[ "$limit" =~ ^[1-9][0-9]*$ ]]; then
    echo "run_gpu.sh: phase '$spec': the time limit must be a whole number of seconds" >&2
    exit 2
  fi
done
if ! [[ "$DEFAULT_LIMIT_S" =~ ^[1-9][0-9]*$ && "$KILL_GRACE_S" =~ ^[1-9][0-9]*$ ]]; then
  echo "run_gpu.sh: DEFAULT_LIMIT_S and KILL_GRACE_S must be whole numbers of seconds" >&2
  exit 2
fi

mkdir -p "$OUT_DIR" || exit 2
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
cd "$ROOT" || exit 2

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OUT="$OUT_DIR"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if [ -z "${GIT_COMMIT:-}" ] && [ -s "$ROOT/BENCH_COMMIT" ]; then
  GIT_COMMIT="$(head -n 1 "$ROOT/BENCH_COMMIT")"
  export GIT_COMMIT
fi

LOG="$OUT_DIR/run_gpu.log"
commit="${GIT_COMMIT:-$(git -C "$ROOT" rev-parse HEAD 2> /dev/null || echo unknown)}"
{
  echo "run_gpu.sh $OUT_DIR $*"
  echo "date $(date -u +%Y-%m-%dT%H:%M:%SZ) host $(hostname) commit $commit"
  if command -v nvidia-smi > /dev/null 2>&1; then
    nvidia-smi -L
  fi
} | tee -a "$LOG"

FAILED=0
declare -A RUNS=()

for spec in "$@"; do
  name="${spec%%:*}"
  limit="${spec#"$name"}"
  limit="${limit#:}"
  limit="${limit:-$DEFAULT_LIMIT_S}"
  RUNS[$name]=$(( ${RUNS[$name]:-0} + 1 ))
  tag="$name"
  dir="$OUT_DIR"
  if [ "${RUNS[$name]}" -gt 1 ]; then
    tag="${name}_${RUNS[$name]}"
    dir="$OUT_DIR/$tag"
    mkdir -p "$dir"
  fi
  var="$(echo "$name" | tr '[:lower:]' '[:upper:]')_ARGS"
  read -r -a extra <<< "${!var:-}"
  xla_flags="${XLA_FLAGS:-}"
  case "$name" in
    layer)    cmd=("$PYTHON" -m bench.moe_layer --out "$dir") ;;
    gemm)     cmd=("$PYTHON" -m bench.grouped_gemm --out "$dir") ;;
    check)    cmd=("$PYTHON" -m bench.check_moe_gpu --out "$dir") ;;
    odd)      cmd=("$PYTHON" -m bench.check_odd_shapes --out "$dir") ;;
    balance)  cmd=("$PYTHON" -m bench.replication --out "$dir") ;;
    sweep)    cmd=("$PYTHON" -m bench.determinism_sweep --out "$dir") ;;
    train)    cmd=("$PYTHON" -m bench.train_throughput --out "$dir") ;;
    profile)  cmd=("$PYTHON" -m bench.profile_layer --out "$dir") ;;
    stepdiff) cmd=("$PYTHON" -m bench.train_step_diff --out "$dir") ;;
    tune)     cmd=("$PYTHON" -m uniep_jax.autotune --out "$dir/tune") ;;
    mp)       cmd=(env OUT="$dir/multiprocess" LIMIT_S="${MP_LIMIT_S:-$(( limit / 5 ))}"
                   PYTHON="$PYTHON" bash bench/multiprocess_gpu.sh) ;;
  esac
  case "$name" in
    sweep|tune)
      if [[ "$xla_flags" != *xla_gpu_deterministic_ops* ]]; then
        xla_flags="${xla_flags:+$xla_flags }--xla_gpu_deterministic_ops=true"
      fi ;;
  esac
  cmd+=("${extra[@]}")
  echo "== $tag (limit ${limit}s): ${cmd[*]}${xla_flags:+ [XLA_FLAGS=$xla_flags]}" | tee -a "$LOG"
  t0=$SECONDS
  XLA_FLAGS="$xla_flags" timeout -s USR1 -k "$KILL_GRACE_S" "$limit" "${cmd[@]}" \
    > "$OUT_DIR/$tag.log" 2>&1
  rc=$?
  case $rc in
    0)       status="ok" ;;
    124|137) status="timed out" ;;
    *)       status="failed" ;;
  esac
  [ $rc = 0 ] || FAILED=1
  echo "== $tag: $status (exit $rc) after $(( SECONDS - t0 ))s; log $OUT_DIR/$tag.log" | tee -a "$LOG"
  if [ $rc != 0 ]; then
    tail -n 15 "$OUT_DIR/$tag.log" | sed 's/^/   | /'
  fi
done

echo "run_gpu.sh: $([ $FAILED = 0 ] && echo "every phase exited 0" || echo "a phase did not exit 0"); results in $OUT_DIR" | tee -a "$LOG"
exit $FAILED
