#!/usr/bin/env bash
# The GPU suite in one device call: correctness + determinism checks, then the
# MoE layer benchmark. Each phase has its own time limit so that a hang in one
# (e.g. a semaphore deadlock) cannot take the others with it. Results land in
# $OUT (at most 8 files come back): check_moe_gpu_*.json, moe_layer_*.json/.png, logs.
#   bash bench/gpu_suite.sh [SHAPES] [ROUTINGS] [DIRECTIONS] [CHECK]
set -u
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT="${OUT:-bench/results}"
SHAPES="${1:-mixtral-like,deepseek-like,qwen3-like,small-experts}"
ROUTINGS="${2:-balanced}"
DIRECTIONS="${3:-fwdbwd,fwd}"
CHECK="${4:-1}"
CHECK_S="${CHECK_S:-200}"
BENCH_S="${BENCH_S:-360}"
nvidia-smi -L | tee "$OUT/suite.log"
if [[ "$CHECK" == "1" ]]; then
  timeout "$CHECK_S" python3 -m bench.check_moe_gpu --quick --out "$OUT" > "$OUT/check.log" 2>&1
  echo "check rc=$?" | tee -a "$OUT/suite.log"
  grep -v "^PASS" "$OUT/check.log" | grep -E "^FAIL|passed|Error|error" | head -40
fi
BACKENDS="${BACKENDS:-xla_capacity,xla_dropless_padded,pallas}"
if [[ -f "$OUT/uniep_ok" || "${FORCE_UNIEP:-0}" == "1" ]] && [[ ",$BACKENDS," != *",uniep,"* ]]; then
  BACKENDS="$BACKENDS,uniep"   # once: a BACKENDS naming uniep already ran it twice (run8)
fi
echo "bench backends: $BACKENDS" | tee -a "$OUT/suite.log"
timeout "$BENCH_S" python3 -m bench.moe_layer --shapes "$SHAPES" --routings "$ROUTINGS" \
  --directions "$DIRECTIONS" --backends "$BACKENDS" --budget-s $((BENCH_S - 50)) --out "$OUT" \
  --compile-workers "${COMPILE_WORKERS:-1}" \
  > "$OUT/bench.log" 2>&1
echo "bench rc=$?" | tee -a "$OUT/suite.log"
grep -E "^\{'shape'|^shape|^tiny|like|experts" "$OUT/bench.log" | grep -v "^{" | tail -40
