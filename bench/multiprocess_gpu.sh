#!/usr/bin/env bash
# Multi-process moe_ffn on the GPUs of one host.
#   bash bench/multiprocess_gpu.sh [NGPUS] [BACKENDS]
# NGPUS: default every GPU nvidia-smi lists; BACKENDS: moe_ffn backends for
# train.multiprocess_check, comma-separated (default xla_capacity,xla_dropless,pallas).
# $OUT: the folder everything lands in (default bench/results/multiprocess);
# $LIMIT_S: the time limit of each step (default 240); $PYTHON: the interpreter (python3).
# Exits 1 if a step failed or uniep across processes was not refused.
# 1. one process driving all N GPUs, then N processes of one GPU each over
#    jax.distributed + NCCL, on the same global inputs (train/multiprocess_check.py,
#    bfloat16: the Pallas kernels take 16-bit operands), compared array by array;
# 2. backend "uniep" across processes, which moe_ffn refuses with a ValueError (its
#    kernels write into peer GPUs' memory, which across processes needs NVSHMEM);
# 3. a short training run, 1 process x N GPUs against N processes x 1 GPU.
# It writes:
#   multiprocess_gpu.json   per backend and array: bitwise / max abs / max rel difference
#   train_compare.json      the training runs' losses, step by step
#   check_*.log, uniep_refused.log, train_*.log, and summary lines in suite.log
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
OUT="${OUT:-$ROOT/bench/results/multiprocess}"
FAILED=0
mkdir -p "$OUT"
N="${1:-$(nvidia-smi -L | wc -l)}"
BACKENDS="${2:-xla_capacity,xla_dropless,pallas}"
LIMIT_S="${LIMIT_S:-240}"
MESH="data=1,expert=$N"
SHAPE=(--tokens $((1024 * N)) --hidden 512 --ffn 1024 --experts $((4 * N)) --top-k 2 --dtype bfloat16)
nvidia-smi -L | tee "$OUT/suite.log"
echo "gpus=$N mesh=$MESH backends=$BACKENDS" | tee -a "$OUT/suite.log"

# 1a. one process, all N GPUs
timeout "$LIMIT_S" "$PYTHON" -m train.multiprocess_check --platform gpu --mesh "$MESH" "${SHAPE[@]}" \
  --backends "$BACKENDS" --out "$OUT/single" > "$OUT/check_single.log" 2>&1
rc=$?; [ $rc = 0 ] || FAILED=1
echo "single-process rc=$rc" | tee -a "$OUT/suite.log"

# 1b. N processes, one GPU each (JAX_LOCAL_DEVICE_IDS=i), NCCL between them
timeout "$LIMIT_S" "$PYTHON" -m train.launch --processes "$N" --devices-per-process 1 \
  --timeout $((LIMIT_S - 10)) --module train.multiprocess_check -- --platform gpu --mesh "$MESH" \
  "${SHAPE[@]}" --backends "$BACKENDS" --out "$OUT/multi" > "$OUT/check_multi.log" 2>&1
rc=$?; [ $rc = 0 ] || FAILED=1
echo "multi-process rc=$rc" | tee -a "$OUT/suite.log"

"$PYTHON" - "$OUT" <<'EOF' | tee -a "$OUT/suite.log"
import json, os, sys
from train.multiprocess_check import compare
out = sys.argv[1]
res = compare(os.path.join(out, "single"), os.path.join(out, "multi"))
json.dump(res, open(os.path.join(out, "multiprocess_gpu.json"), "w"), indent=2)
for backend, rows in res.items():
  print(backend, {k: ("bitwise" if v["bitwise"] else f"rel {v['max_rel_diff']:.2e}") for k, v in rows.items()})
if not res:
  print("no results to compare (see check_*.log)")
EOF

# 2. uniep across processes: refused with a ValueError naming what is unsupported
timeout "$LIMIT_S" "$PYTHON" -m train.launch --processes "$N" --devices-per-process 1 --timeout $((LIMIT_S - 10)) \
  --module train.multiprocess_check -- --platform gpu --mesh "$MESH" "${SHAPE[@]}" \
  --backends uniep --out "$OUT/uniep_refused" > "$OUT/uniep_refused.log" 2>&1
rc=$?
refusal="$(grep -o 'unsupported in multi-process runs[^;]*' "$OUT/uniep_refused.log" | head -1)"
[ $rc != 0 ] && [ -n "$refusal" ] || FAILED=1
echo "uniep across processes rc=$rc (expect a refusal): $refusal" | tee -a "$OUT/suite.log"
# 3. training: 1 process x N GPUs vs N processes x 1 GPU, a few steps
TRAIN=(--config tiny --mesh "$MESH" --batch $((8 * N)) --seq 128 --steps 20 --warmup 2 --eval-every 10
       --eval-batches 2 --no-progress --no-plot)
timeout "$LIMIT_S" "$PYTHON" -m train "${TRAIN[@]}" --out "$OUT/train_single" > "$OUT/train_single.log" 2>&1
rc=$?; [ $rc = 0 ] || FAILED=1
echo "train single rc=$rc" | tee -a "$OUT/suite.log"
timeout "$LIMIT_S" "$PYTHON" -m train.launch --processes "$N" --devices-per-process 1 --timeout $((LIMIT_S - 10)) \
  -- "${TRAIN[@]}" --out "$OUT/train_multi" > "$OUT/train_multi.log" 2>&1
rc=$?; [ $rc = 0 ] || FAILED=1
echo "train multi rc=$rc" | tee -a "$OUT/suite.log"
"$PYTHON" - "$OUT" <<'EOF' | tee -a "$OUT/suite.log"
import json, os, sys
out = sys.argv[1]
rd = lambda d: [json.loads(l) for l in open(os.path.join(out, d, "metrics.jsonl"))]
try:
  s, m = rd("train_single"), rd("train_multi")
except OSError as e:
  print("train comparison skipped:", e); sys.exit(0)
pairs = [(a["step"], a.get("loss", a.get("heldout_loss")), b.get("loss", b.get("heldout_loss"))) for a, b in zip(s, m)]
res = dict(bitwise_steps=sum(x == y for _, x, y in pairs), steps=len(pairs),
           max_rel_diff=max((abs(x - y) / abs(x) for _, x, y in pairs), default=None))
json.dump(dict(pairs=pairs, **res), open(os.path.join(out, "train_compare.json"), "w"), indent=2)
print("train 1 vs N processes:", res)
EOF
exit $FAILED
