#!/usr/bin/env bash
# Multi-process moe_ffn on GPUs.
# One process per GPU over jax.distributed + NCCL, against one process driving all
# GPUs, on the same global inputs (train/multiprocess_check.py, bfloat16: the Pallas
# kernels take 16-bit operands); then backend "uniep" across processes, which must fail
# with moe_ffn's ValueError (jaxlib 0.11.2's XLA has no NVSHMEM mode: it aborts on
# --xla_gpu_experimental_enable_nvshmem, 4x H200 run 4, 2026-11-26). Finally a short
# training run, 1 process vs N processes. Everything lands in $OUT:
#   multiprocess_gpu.json   per backend and array: bitwise / max abs / max rel difference
#   uniep_*.log, train_*.log, check_*.log, summary lines in suite.log
#   bash bench/multiprocess_gpu.sh [NGPUS (2 or 4)] [BACKENDS]
set -u
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
OUT="${OUT:-bench/results/multiprocess}"
mkdir -p "$OUT"
N="${1:-$(nvidia-smi -L | wc -l)}"
BACKENDS="${2:-xla_capacity,xla_dropless,pallas}"
LIMIT_S="${LIMIT_S:-240}"
MESH="data=1,expert=$N"
SHAPE=(--tokens $((1024 * N)) --hidden 512 --ffn 1024 --experts $((4 * N)) --top-k 2 --dtype bfloat16)
nvidia-smi -L | tee "$OUT/suite.log"
echo "gpus=$N mesh=$MESH backends=$BACKENDS" | tee -a "$OUT/suite.log"

# 1. one process, all N GPUs
timeout "$LIMIT_S" python3 -m train.multiprocess_check --platform gpu --mesh "$MESH" "${SHAPE[@]}" \
  --backends "$BACKENDS" --out "$OUT/single" > "$OUT/check_single.log" 2>&1
echo "single-process rc=$?" | tee -a "$OUT/suite.log"

# 2. N processes, one GPU each (JAX_LOCAL_DEVICE_IDS=i), NCCL between them
timeout "$LIMIT_S" python3 -m train.launch --processes "$N" --devices-per-process 1 \
  --timeout $((LIMIT_S - 10)) --module train.multiprocess_check -- --platform gpu --mesh "$MESH" \
  "${SHAPE[@]}" --backends "$BACKENDS" --out "$OUT/multi" > "$OUT/check_multi.log" 2>&1
echo "multi-process rc=$?" | tee -a "$OUT/suite.log"

python3 - "$OUT" <<'EOF' | tee -a "$OUT/suite.log"
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

# 3. uniep across processes: refused with a ValueError naming what is unsupported
timeout "$LIMIT_S" python3 -m train.launch --processes "$N" --devices-per-process 1 --timeout $((LIMIT_S - 10)) \
  --module train.multiprocess_check -- --platform gpu --mesh "$MESH" "${SHAPE[@]}" \
  --backends uniep --out "$OUT/uniep_refused" > "$OUT/uniep_refused.log" 2>&1
echo "uniep across processes rc=$? (expect 2):" \
  "$(grep -o 'unsupported in multi-process runs[^;]*' "$OUT/uniep_refused.log" | head -1)" | tee -a "$OUT/suite.log"
# 4. training: 1 process x N GPUs vs N processes x 1 GPU, a few steps
TRAIN=(--config tiny --mesh "$MESH" --batch $((8 * N)) --seq 128 --steps 20 --warmup 2 --eval-every 10
       --eval-batches 2 --no-progress --no-plot)
timeout "$LIMIT_S" python3 -m train "${TRAIN[@]}" --out "$OUT/train_single" > "$OUT/train_single.log" 2>&1
echo "train single rc=$?" | tee -a "$OUT/suite.log"
timeout "$LIMIT_S" python3 -m train.launch --processes "$N" --devices-per-process 1 --timeout $((LIMIT_S - 10)) \
  -- "${TRAIN[@]}" --out "$OUT/train_multi" > "$OUT/train_multi.log" 2>&1
echo "train multi rc=$?" | tee -a "$OUT/suite.log"
python3 - "$OUT" <<'EOF' | tee -a "$OUT/suite.log"
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
