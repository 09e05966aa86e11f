#!/usr/bin/env bash
# Does XLA's default GPU path for lax.ragged_all_to_all make the `pallas` backend slow
# at EP > 1 in one process? Runs bench/moe_layer.py (pallas, pallas:padded and uniep,
# forward, balanced routing, all local GPUs) once per XLA flag setting, each in its own
# process (XLA reads its flags at start-up) and under a time limit (a path that hangs
# shows as exit 124):
#   default       XLA's defaults (the one-shot ragged kernel where it applies)
#   no_one_shot   --xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=false
#   send_recv     the same, and --xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true
# Each run's JSON (under OUT_DIR/<setting>) holds the layer times and, per row,
# `collectives`: all_to_all and ragged_all_to_all timed alone on one dispatch's rows.
#
#   bash bench/ragged_a2a_flags.sh OUT_DIR [SECONDS_EACH] [SHAPES]
set -u
OUT_DIR="$(mkdir -p "${1:?usage: bash bench/ragged_a2a_flags.sh OUT_DIR [SECONDS_EACH] [SHAPES]}" && cd "$1" && pwd)"
SECONDS_EACH="${2:-170}" SHAPES="${3:-mixtral-like,deepseek-like}"
run() {
  local name="$1" flags="$2"
  mkdir -p "$OUT_DIR/$name"
  XLA_FLAGS="${XLA_FLAGS:-} $flags" timeout "$SECONDS_EACH" "${PYTHON:-python3}" -m bench.moe_layer \
    --shapes "$SHAPES" --backends pallas,pallas:padded,uniep --directions fwd \
    --routings balanced --interleaved-trials 3 --budget-s $((SECONDS_EACH - 40)) \
    --out "$OUT_DIR/$name" > "$OUT_DIR/$name.log" 2>&1
  echo "== $name (XLA_FLAGS +'$flags'): exit $?"
  grep -E "all_to_all \{|'median_ms'|\(interleaved\)|Error|error" "$OUT_DIR/$name.log" \
    | sed -E "s/'checksum': \([^)]*\)//; s/'rank_rows': \[[^]]*\]\]//" | cut -c1-400 | tail -14
}
run default ""
run no_one_shot "--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=false"
run send_recv "--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel=false --xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true"
