#!/usr/bin/env bash
# Several GPU phases in one device call, each under its own time limit, with
# everything they write packed into $OUT/results.tgz (the device tool brings back
# at most 8 files from $OUT). Unpack here with: tar xzf results.tgz -C <dir>
#   bash bench/device_session.sh PHASE:SECONDS [PHASE:SECONDS ...]
# Phases:
#   fused_a  v2 Kernel A bring-up (bench/check_fused_gpu.py, small cases, no timing)
#   fused_b  v2 Kernel B bring-up (bench/check_fused_return_gpu.py, same)
#   layer    MoE layer bench, fwd+bwd, balanced (bench/gpu_suite.sh; $SHAPES, $BACKENDS (plus v1
#            "uniep" unless FORCE_UNIEP=0),
#            $ROUTINGS, $DIRECTIONS override; each shape's programs compiled ahead in
#            $COMPILE_WORKERS threads, default 8, the xla_* baselines first and alone;
#            COMPILE_WORKERS=1: each at its first call, as before 2026-11-28)
#   check    correctness and determinism of every backend on small shapes, all EP meshes
#            (bench/check_moe_gpu.py --quick; $CHECK_BACKENDS a comma list, default all;
#            $CHECK_MESHES e.g. 1x4 (DATAxEP list); $CHECK_DTYPES e.g. bfloat16)
#   sweep    bitwise sweep over the uniep parameter space (bench/determinism_sweep.py;
#            $SWEEP_START skips that many points of its order, covered by an earlier run;
#            $SWEEP_TILINGS=1: every point at the default tiling only; give it >= 250 s at EP 4:
#            on 4x H200, 2026-11-28, SWEEP_START=2 sweep:170 ended before its first point,
#            still compiling the pallas reference and the fused points)
#   train_det  only the determinism runs of train_throughput (pallas vs uniep, uniep twice;
#            mixtral-like, data=1,expert=R, 50 steps) in XLA's deterministic mode
#            ($DET_XLA_FLAGS: extra XLA_FLAGS, e.g. "$NO_COMBINE"; $GRAD_REDUCTION: ordered (default) or xla)
#   stepdiff one train step, pallas vs uniep, every gradient leaf bitwise
#            (bench/train_step_diff.py), in XLA's deterministic mode plus the settings
#            named in $STEPDIFF (default "deterministic det_nocombine_ring"; also
#            det_autotune0: no timing-based GEMM choices, $NO_AUTOTUNE; det_ordered:
#            gradients summed in rank order by us, train --grad-reduction ordered)
#   probe    each stage of the training loop timed and printed (bench/train_loop_probe.py;
#            $PROBE_REDUCTION, default ordered; $PROBE_BACKENDS, default pallas,uniep)
#   train    throughput (bench/train_throughput.py; $MODELS, $MESHES, $TRAIN_BACKENDS,
#            $GRAD_REDUCTION e.g. xla,ordered, $DET_STEPS default 0, $XLA_DET=1: XLA's
#            deterministic mode, the training CLI's default)
#   profile  kernel-level profile of one MoE layer call per backend (bench/profile_layer.py;
#            $PROF_BACKENDS default uniep,uniep_fused, $PROF_SHAPE deepseek-like,
#            $PROF_DIRECTION fwd; $PROF_ARGS extra flags, e.g. --back-to-back; SECONDS is
#            each backend's limit); with $PROF_TRAIN_MODEL
#            (e.g. mixtral-like) the training step of that model instead (1 layer, 64
#            experts at most, $PROF_MESH; $PROF_BACKENDS are training backends then,
#            e.g. xla_capacity,uniep,uniep+xla_dswiglu)
#   tune     the autotuner on each shape of $TUNE_SHAPE (comma list, default deepseek-like;
#            SECONDS split evenly between them) and one direction (python -m uniep_jax.tune;
#            $TUNE_DIRECTION default fwd, $TUNE_ARGS extra flags (e.g. "--stages fused
#            --fused-points 8,2048,0,1");
#            $TUNE_WORKERS compile threads, default 8; XLA deterministic ($TUNE_XLA_FLAGS
#            overrides), as training runs; continues from bench/results/tune when the
#            flags match; copy back tune/* and tuned_configs.json)
#   mp       multi-process runs (bench/multiprocess_gpu.sh; $MP_LIMIT_S per step, default 60)
#   xfer     one GPU: the send side of the de-duplicated dispatch, gather + transfer against
#            the transfer's gathered loads, and the owner side's expansion on all / 64 / 32
#            CTAs and inside transfer_expand's local form (bench/transfer_check.py;
#            $XFER_ARGS extra flags, e.g. --no-expand)
#   teprobe  all GPUs: which part of the communicating transfer_expand faults, each variant
#            in a process of its own (bench/transfer_expand_probe.py; $TEPROBE_VARIANTS)
#   smem     one GPU: which SMEM scalar reads fault (bench/smem_scalar_probe.py, each
#            variant in its own process)
#   ffnab    one GPU: the expert FFN's grouped-GEMM launches at the layer's shapes
#            (bench/ffn_ab.py; $FFNAB_ARGS its flags, e.g. "--shapes deepseek-like
#            --groups routed --raster 8 --no-checks --profile"; traces under ffnab/trace_*
#            are packed too)
#   epiprobe one GPU: the short-K launches timed with parts of their epilogue removed
#            (bench/epilogue_probe.py, timing only; $EPIPROBE_ARGS its flags)
#   cluster  one GPU: JAX's Hopper matmul with and without a 2-CTA cluster (TMA multicast
#            inside the cluster) against cuBLAS and our grouped GEMM on one group
#            (bench/cluster_probe.py; $CLUSTER_ARGS its flags)
# Run `bash bench/stamp_commit.sh` first and carry BENCH_COMMIT so the JSONs name the commit.
set -u
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# XLA combines small collectives into one buffer by thresholds; which ones it combines
# depends on the whole program, and NCCL's reduction order follows the buffer layout
NO_COMBINE="--xla_gpu_all_reduce_combine_threshold_bytes=0 --xla_gpu_reduce_scatter_combine_threshold_bytes=0 --xla_gpu_all_gather_combine_threshold_bytes=0"
# XLA:GPU picks GEMM algorithms (split-K, tiles) by timing them at compile time: two
# programs, or two processes, can pick differently for the same GEMM
NO_AUTOTUNE="--xla_gpu_autotune_level=0"
# XLA:GPU's deterministic mode (no GEMM autotuning), the training CLI's default
DET="--xla_gpu_deterministic_ops=true"
# XLA turns an async all-reduce into a synchronous one when nothing overlaps it, which
# depends on the whole program's schedule; the two run on different NCCL communicators
# (stepdiff, 2026-11-26: the one gradient that differed between pallas and uniep was
# all-reduced synchronously in one program and asynchronously in the other)
SYNC_AR="--xla_gpu_disable_async_collectives=ALLREDUCE,REDUCESCATTER"
FINAL="${OUT:-bench/results/session}"
WORK="$(mktemp -d /tmp/device_session.XXXX)"
LOG="$FINAL/session.log"
mkdir -p "$FINAL"
nvidia-smi -L | tee "$LOG"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1 | tee -a "$LOG"

run_phase() {  # name seconds
  local name="$1" secs="$2" dir="$WORK/$1" t0=$SECONDS rc
  mkdir -p "$dir"
  echo "== $name (limit ${secs}s)" | tee -a "$LOG"
  case "$name" in
    fused_a) timeout "$secs" python3 -m bench.check_fused_gpu --cases small,small-skew --no-time \
               --out "$dir" > "$dir/log" 2>&1 ;;
    fused_b) timeout "$secs" python3 -m bench.check_fused_return_gpu --cases small,small-skew \
               --no-time --out "$dir" > "$dir/log" 2>&1 ;;
    layer)   JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
               OUT="$dir" CHECK_S=0 BENCH_S="$secs" FORCE_UNIEP="${FORCE_UNIEP:-1}" \
               COMPILE_WORKERS="${COMPILE_WORKERS:-8}" \
               BACKENDS="${BACKENDS:-xla_capacity,pallas}" \
               bash bench/gpu_suite.sh "${SHAPES:-mixtral-like,deepseek-like,qwen3-like,small-experts}" \
               "${ROUTINGS:-balanced}" "${DIRECTIONS:-fwdbwd}" 0 > "$dir/log" 2>&1 ;;
    check)   timeout "$secs" python3 -m bench.check_moe_gpu --quick --out "$dir" \
               ${CHECK_BACKENDS:+--backends "$CHECK_BACKENDS"} ${CHECK_MESHES:+--meshes "$CHECK_MESHES"} \
               ${CHECK_DTYPES:+--dtypes "$CHECK_DTYPES"} > "$dir/log" 2>&1 ;;
    sweep)   XLA_FLAGS="$DET" timeout "$secs" python3 -m bench.determinism_sweep --budget-s $((secs - 50)) \
               --start "${SWEEP_START:-0}" ${SWEEP_TILINGS:+--tilings "$SWEEP_TILINGS"} \
               --out "$dir" > "$dir/log" 2>&1 ;;
    train)   JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
               timeout -s USR1 -k 15 "$secs" python3 -m bench.train_throughput \
               --models "${MODELS:-mixtral-like,deepseek-like}" --budget-s $((secs - 90)) \
               ${MESHES:+--meshes "$MESHES"} ${TRAIN_BACKENDS:+--backends "$TRAIN_BACKENDS"} \
               --grad-reduction "${GRAD_REDUCTION:-ordered}" --det-steps "${DET_STEPS:-0}" \
               ${XLA_DET:+--xla-deterministic} \
               --out "$dir" > "$dir/log" 2>&1 ;;
    train_det) XLA_FLAGS="${DET_XLA_FLAGS:-}" timeout -s USR1 -k 15 "$secs" python3 -m bench.train_throughput --models mixtral-like --det-only \
               --xla-deterministic --backends pallas,uniep --det-steps 50 \
               --meshes "data=1,expert=$(nvidia-smi -L | wc -l)" --budget-s $((secs - 30)) \
               --grad-reduction "${GRAD_REDUCTION:-ordered}" \
               --out "$dir" > "$dir/log" 2>&1 ;;
    stepdiff) local settings=(${STEPDIFF:-deterministic det_nocombine_ring}) tag flags gr src=0
             local each=$((secs / ${#settings[@]})) tsd=(python3 -m bench.train_step_diff --out "$dir")
             for tag in "${settings[@]}"; do
               gr=xla
               case "$tag" in
                 deterministic) flags="" ;;
                 det_nocombine_ring) flags="$NO_COMBINE" ;;
                 det_autotune0) flags="$NO_AUTOTUNE" ;;
                 det_sync_ar) flags="$SYNC_AR" ;;
                 det_ordered) flags="" gr=ordered ;;
               esac
               [ "$tag" = det_nocombine_ring ] && export NCCL_ALGO=Ring || unset NCCL_ALGO
               # HLO_DUMP=1: keep each program's optimized HLO (which fusions differ)
               [ -n "${HLO_DUMP:-}" ] && flags="$flags --xla_dump_to=$dir/hlo_$tag --xla_dump_hlo_as_text"
               XLA_FLAGS="$flags" timeout -s USR1 -k 15 "$each" "${tsd[@]}" --xla-deterministic --tag "$tag" \
                 --grad-reduction "$gr" \
                 >> "$dir/log" 2>&1 || src=$?
               [ -d "$dir/hlo_$tag" ] && find "$dir/hlo_$tag" -type f \
                 ! -name "*after_optimizations.txt" -delete
             done; unset NCCL_ALGO; (exit $src) ;;
    probe)   timeout -s USR1 -k 15 "$secs" python3 -m bench.train_loop_probe --xla-deterministic \
               --grad-reduction "${PROBE_REDUCTION:-ordered}" --backends "${PROBE_BACKENDS:-pallas,uniep}" \
               > "$dir/log" 2>&1 ;;
    profile) local b prc=0
             PROF_BACKENDS="${PROF_BACKENDS:-$([ -n "${PROF_TRAIN_MODEL:-}" ] && echo uniep || echo uniep,uniep_fused)}"
             for b in ${PROF_BACKENDS//,/ }; do
               timeout -s USR1 -k 15 "$secs" python3 -m bench.profile_layer --backend "$b" \
                 --shape "${PROF_SHAPE:-deepseek-like}" --direction "${PROF_DIRECTION:-fwd}" \
                 ${PROF_TRAIN_MODEL:+--train-model "$PROF_TRAIN_MODEL"} \
                 ${PROF_MESH:+--mesh "$PROF_MESH"} ${PROF_ARGS:-} \
                 --out "$dir" >> "$dir/log" 2>&1 || { prc=$?; break; }
             done; (exit $prc) ;;
    tune)    local shape trc=0 shapes=(${TUNE_SHAPE:-deepseek-like}) ; shapes=(${shapes[@]//,/ })
             local each=$((secs / ${#shapes[@]}))
             cp uniep_jax/tuned_configs.json "$dir/"
             for shape in "${shapes[@]}"; do   # one budget each; one cache, one report dir
               XLA_FLAGS="${TUNE_XLA_FLAGS-$DET}" timeout -s USR1 -k 15 "$each" \
                 python3 -m uniep_jax.tune --moe-config "$shape" \
                 --ep "$(nvidia-smi -L | wc -l)" --direction "${TUNE_DIRECTION:-fwd}" \
                 --budget-s $((each - 60)) --cache "$dir/tuned_configs.json" --out "$dir/tune" \
                 --compile-workers "${TUNE_WORKERS:-8}" \
                 --resume bench/results/tune --no-progress ${TUNE_ARGS:-} >> "$dir/log" 2>&1 || trc=$?
             done; (exit $trc) ;;
    mp)      OUT="$dir" LIMIT_S="${MP_LIMIT_S:-60}" timeout "$secs" \
               bash bench/multiprocess_gpu.sh > "$dir/log" 2>&1 ;;
    xfer)    timeout "$secs" python3 -m bench.transfer_check --out "$dir" ${XFER_ARGS:-} \
               > "$dir/log" 2>&1 ;;
    smem)    timeout "$secs" python3 -m bench.smem_scalar_probe --out "$dir" > "$dir/log" 2>&1 ;;
    ffnab)   timeout "$secs" python3 -m bench.ffn_ab --out "$dir" ${FFNAB_ARGS:-} \
               > "$dir/log" 2>&1 ;;
    epiprobe) timeout "$secs" python3 -m bench.epilogue_probe --out "$dir" ${EPIPROBE_ARGS:-} \
               > "$dir/log" 2>&1 ;;
    cluster) timeout "$secs" python3 -m bench.cluster_probe --out "$dir" ${CLUSTER_ARGS:-} \
               > "$dir/log" 2>&1 ;;
    teprobe) timeout "$secs" python3 -m bench.transfer_expand_probe --out "$dir" \
               ${TEPROBE_VARIANTS:+--variants "$TEPROBE_VARIANTS"} > "$dir/log" 2>&1 ;;
    *)       echo "unknown phase $name" > "$dir/log"; false ;;
  esac
  rc=$?
  echo "== $name rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
  grep -E "PASS|FAIL|ok|mismatch|Error|rc=|bitwise|tok|step_ms|like|experts|equal" "$dir/log" \
    | grep -v "^ *File " | tail -25 | tee -a "$LOG"
  return $rc
}

# STOP_ON_FAIL=1: a phase that fails (or runs past its limit) skips the phases after it
for spec in "$@"; do
  run_phase "${spec%%:*}" "${spec##*:}" && continue
  [ "${STOP_ON_FAIL:-0}" != 0 ] && { echo "== stopping: ${spec%%:*} failed" | tee -a "$LOG"; break; }
done
find "$WORK" -name "*.npz" -delete
tar czf "$FINAL/results.tgz" -C "$WORK" .
# the device tool brings back files of at most 16 MiB: drop the profiler traces if over
if [ "$(stat -c %s "$FINAL/results.tgz")" -gt 15000000 ]; then
  echo "== results.tgz over 15 MB: packed again without *.trace.json.gz" | tee -a "$LOG"
  tar czf "$FINAL/results.tgz" --exclude="*.trace.json.gz" -C "$WORK" .
fi
ls -la "$FINAL" | tee -a "$LOG"
