"""`UniEPConfig`: the MoE layer's knobs (backend, routing, capacity, kernel space).

One frozen dataclass, one `backend` value chosen from one registry (`BACKENDS`).
Routing options live in `RoutingConfig`; the fused-kernel parameter space in
`KernelConfig` (used by the `"pallas"` and `"uniep"` backends). Shape-free checks
run in `__post_init__`; shape-dependent checks run in `moe_ffn` before tracing.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

BACKENDS = ("xla_dropless", "xla_capacity", "dense_reference", "pallas", "uniep")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOGITS_MATMULS = ("bf16x3", "float32")
TRANSPORTS = ("ragged", "padded", "nvlink", "local")
SLOT_REDUCTIONS = ("slot_order", "owner_partials")


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
  """How tokens choose experts.

  score_fn: "softmax" (over all experts) or "sigmoid" (independent per expert).
  normalize_topk: renormalise the chosen top-k weights to sum to 1.
  scale: multiplies the final top-k weights (DeepSeek-V3 `routed_scaling_factor`).
  n_groups / topk_groups: group-limited routing (DeepSeek-V3). Experts are split
    into `n_groups` contiguous groups; a group's score is the sum of its best two
    expert scores (the best one if a group has one expert); only the `topk_groups`
    best groups are eligible. `n_groups=1` disables it.
  logits_matmul: how the float32 logits x @ router are computed (forward and both
    gradients; uniep_jax/router_matmul.py). "bf16x3" (default): each float32 operand
    split exactly into bfloat16 pieces, the products of the three leading significance
    levels on bf16 tensor cores with float32 accumulation, summed smallest level first:
    near-float32 accuracy at bf16 GEMM speed (one H100, bench/router_ab.py: logits 2e-6 /
    9e-6 off float64 at qwen3-like / deepseek-like sizes against the float32 GEMM's 1.5e-6
    / 0.9e-6 and a bf16 product's 1.7e-3; the logits and both gradients 0.41 / 0.70 ms
    against 0.94 / 2.41 ms: XLA:GPU runs float32 GEMMs on CUDA cores). "float32": one
    float32 GEMM at `Precision.HIGHEST` (the routing until 2026-11-27). Routing is
    discrete: the two may choose differently where two scores are within float32
    rounding of each other; every backend uses the same one.
  """

  score_fn: str = "softmax"
  normalize_topk: bool = True
  scale: float = 1.0
  n_groups: int = 1
  topk_groups: int = 1
  logits_matmul: str = "bf16x3"

  def __post_init__(self):
    if self.score_fn not in SCORE_FUNCTIONS:
      raise ValueError(f"score_fn={self.score_fn!r} is unknown; expected one of {SCORE_FUNCTIONS}")
    if self.logits_matmul not in LOGITS_MATMULS:
      raise ValueError(f"logits_matmul={self.logits_matmul!r} is unknown; expected one of "
                       f"{LOGITS_MATMULS}")
    if self.n_groups < 1:
      raise ValueError(f"n_groups={self.n_groups} must be >= 1")
    if not 1 <= self.topk_groups <= self.n_groups:
      raise ValueError(f"topk_groups={self.topk_groups} must be in [1, n_groups={self.n_groups}]")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Tiling of the Pallas grouped GEMM (backends "pallas" and "uniep").

  block_m / block_n / block_k: the tile (rows of tokens, output columns,
    reduction step). block_k is fixed per launch: a row's result never depends on
    which other rows share the launch (no M-dependent split-K). In the Pallas
    grouped GEMM (pallas_kernels/grouped_gemm.py) each CTA runs 2 compute
    warpgroups: block_n is the width of ONE warpgroup's tile (CTA tile
    block_m x 2*block_n for forward/dgrad; the fused SwiGLU gate/up kernel uses
    block_n/2 per warpgroup, so block_n must be a multiple of 128 there), and
    wgrad tiles are 2*block_m (K) x block_n (N). block_m must be a
    power of two (ragged row stores).
  max_concurrent_steps: TMA pipeline depth (shared-memory stages). Default 3: the
    tuner's layer forward on 4x H100, mixtral-like, 4 -> 3 stages: 13.49 -> 11.89 ms
    (2 stages 13.73); deepseek-like on 4x H200 16.99 -> 16.95; mixtral-like training
    step 67.3 -> 66.2 ms (bench/results/tune/, train_throughput_*_run7.json). The
    bits do not depend on it (every tuned candidate gave the same checksum).
  num_sms: persistent grid size; None reads the device's SM count.
  epilogue_slots: SMEM staging slots per compute warpgroup for the output stores
    (1 or 2; not "dswiglu", which has its own). 1 (default, measured): each 64-column
    chunk waits until the previous chunk's TMA store has read the slot. 2: chunk i is
    written while chunk i - 1 is still being stored, for 16 KiB more SMEM per
    warpgroup (bf16, block_m 128); measured level or slower (1x H200, 2026-11-28:
    bench/results/epilogue_probe_NVIDIA_H200_run5_candidates.json). The bits do not
    depend on it.
  raster_rows: the order in which the persistent CTAs walk a row-tiled launch's
    (row tile, column tile) grid: in bands of `raster_rows` row tiles, column tiles
    outer and the band's row tiles inner, so the CTAs running at one time share a
    few weight tiles instead of each reading its own. 1: row-major (one row tile's
    column tiles after another): a launch whose per-expert weight does not stay in
    L2 then reads it from HBM once per row tile (mixtral-like gate/up: 235 MB per
    expert, 112 column tiles per row tile on 132 SMs: ~30 GB per call at EP 4).
    None (default): per launch, 4 if the launch's weight per expert is at least
    96 MiB, 8 if it is at least 16 MiB, else 1 (4 since 2026-11-28: on 4x H200
    mixtral-like's layer fwd+bwd -0.4 to -0.7 ms against 8, deepseek-like's level
    within its spread; grouped_gemm.RASTER_AUTO_*). Measured (bench/ffn_ab.py, 1x H100, commit 9a4cce4, the FFN
    fwd+bwd in the MoE layer's mode, 4x dead rows; ms row-major -> bands of 8):
    mixtral-like 30.02 -> 27.50 (gate/up 7.69 -> 5.63), deepseek-like 29.71 -> 26.48
    (gate/up 6.63 -> 5.78), qwen3-like 5.95 -> 6.11, small-experts 1.78 -> 1.80
    (weights of 6.3 / 2.9 MB stay in L2: the bands only cost). Bands of 8, 16, 32 in
    one run (commit 7910eb1): mixtral-like 27.38 / 27.28 / 27.77, deepseek-like
    27.28 / 27.29 / 27.96: 8 = 16 within noise, 32 slower. The bits do not depend on it (each
    tile is computed whole by one CTA; checked on that GPU and on the CPU). The
    fused kernels' GEMMs on a CTA subset (Kernels A and C) walk the same bands since
    v2.2 (before: row-major, so their large-weight GEMMs lacked the bands' gain; not
    yet timed); the walk() path of Kernel B stays row-major.
  group_aligned_tiles: True (default since 2026-11-28): each expert's rows are cut
    into row tiles from its own first row (rounded down to 8 rows), so only its last
    tile is partial (~block_m / 2 wasted rows per expert). False (before): a row tile
    is a block_m-aligned block of rows intersected with one expert's rows, so every
    block that straddles two experts is computed twice, all block_m rows each time
    (~block_m wasted rows per expert boundary: at deepseek-like EP 4, 64 local experts
    over 512 row blocks, ~12% more MMA work in each row-tiled launch; none where every
    expert holds a multiple of block_m rows, as in bench/ffn_ab.py's balanced split).
    Applies to the standalone row-tiled launches (gate/up, down, da, dx) and Kernel C's
    down GEMM (its tiles then signal the one or two chunks their rows touch); Kernels A
    and B (and the fused backward's da, FusedConfig.backward) keep block-aligned tiles.
    Measured (H200, JAX 0.11.2): bench/ffn_ab.py --groups routed on one GPU,
    deepseek-like FFN fwd+bwd at EP 4's rows 30.76 -> 30.02 ms, qwen3-like 6.19 ->
    6.18; the layer at EP 2 (2x H200), deepseek-like uniep_dc_rbw_dd 42.48 -> 40.43
    ms, qwen3-like level in the timing (8.90 / 9.28, inside the trials' spread; its
    profile: span 9.37 -> 9.16 ms per call); at EP 4 (4x H200) qwen3-like 9.89 -> 9.90
    (level). The bits do not depend on it (a row's result does not depend on its
    position in the tile; the same checksums in every run).
  wgrad_raster: the order in which the persistent CTAs walk a wgrad launch's (k tile,
    n tile) grid of each group's output dW[g] [K, N]: in bands of `wgrad_raster` k
    tiles (2 block_m rows of dW each), n tiles outer and the band's k tiles inner
    (`raster_rows`' walk, on the wgrad grid). 1: row-major, one k tile's n tiles
    after another: the CTAs running at one time then each read their own dout panel
    (all of the group's rows x block_n columns), so a group whose dout leaves L2 is
    read from HBM once per k tile. None (default): bands of 4
    (grouped_gemm.WGRAD_RASTER_AUTO; measured there). The bits do not depend on it
    (each tile's sum runs whole on one CTA, in the same order).
  mma_in_flight: the k-steps of MMAs each compute warpgroup keeps in flight across the
    k-steps of a tile (the grouped GEMM's row-tiled and wgrad launches, and the kernels
    that embed them). 0 (default): every step waits for its own MMAs (`wgmma_wait(0)`)
    before the pipeline releases its stage, so the tensor cores drain at every step
    while both warpgroups wait, arrive and issue again. 1: a step waits only for the
    previous step's MMAs (`wgmma_wait(1)`, 2 in the gate/up launch, whose step issues
    two wgmma groups; BlockSpec delay_release=1: a stage is released one step late), on
    one stage more than max_concurrent_steps so the prefetch keeps its stages; after
    the pipeline the compute warpgroups release the last step's stage themselves, which
    the memory warpgroup waits for before the next tile refills the stages. A launch
    whose SMEM or k-steps do not give the extra stage (the da launch, "dswiglu") keeps
    0. Measured (2026-11-28, NOTES_grouped_gemm.md): one H200 alone 1-6% faster per
    launch on mixtral-/deepseek-like (at the cost of a prefetch stage instead: 1-14%
    slower), the layer at EP 4 on 4x H200 level within its trials' spread on all three
    shapes: off by default. The bits do not depend on it (the same MMAs in the same
    order).
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 3
  num_sms: Optional[int] = None
  epilogue_slots: int = 1
  raster_rows: Optional[int] = None
  group_aligned_tiles: bool = True
  wgrad_raster: Optional[int] = None
  mma_in_flight: int = 0

  def __post_init__(self):
    for name in ("block_m", "block_n", "block_k"):
      v = getattr(self, name)
      if v <= 0 or v % 64:
        raise ValueError(f"{name}={v} must be a positive multiple of 64")
    if self.max_concurrent_steps < 1:
      raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be >= 1")
    if self.num_sms is not None and self.num_sms < 1:
      raise ValueError(f"num_sms={self.num_sms} must be >= 1")
    if self.epilogue_slots not in (1, 2):
      raise ValueError(f"epilogue_slots={self.epilogue_slots} must be 1 or 2")
    if self.raster_rows is not None and self.raster_rows < 1:
      raise ValueError(f"raster_rows={self.raster_rows} must be >= 1 (or None: auto)")
    if self.wgrad_raster is not None and self.wgrad_raster < 1:
      raise ValueError(f"wgrad_raster={self.wgrad_raster} must be >= 1 (or None: auto)")
    if self.mma_in_flight not in (0, 1):
      raise ValueError(f"mma_in_flight={self.mma_in_flight} must be 0 or 1")


@dataclasses.dataclass(frozen=True)
class TransferConfig:
  """The in-kernel NVLink row transfer (backend "uniep"; pallas_kernels/ep_transfer.py).

  chunk_rows: rows per work item, a power of two (the store ladder's largest
    step). Larger: fewer, bigger TMAs; smaller: finer load balance over CTAs.
  col_tile: columns per TMA box (<= 256); H must be a multiple of it.
  num_ctas: CTAs that move rows. About half the SMs saturate NVLink (notes).
  gather_rows: how the de-duplicated dispatches (`dedup_tokens`) read their send
    rows (each (token, owner) row once). True (default): the transfer reads them by
    index in its loads (one TMA per row and column block of up to H columns; items of
    min(chunk_rows, 16) rows, ep_transfer.GATHER_ITEM_ROWS), with no send buffer;
    False: the rows are first gathered into a contiguous send buffer
    (`row_gather.gather_live_rows`), then transferred. The same bits either way (rows
    are moved, not computed). On by default since 2026-11-28: EP 4, 4x H200, fwd+bwd
    median (bench/results/moe_layer_NVIDIA_H200_ep4_run34_*.json, _run35_*.json):
    uniep_dc_rbw_dd 10.00 -> 9.79 ms on qwen3-like, 37.69 -> 37.42 on deepseek-like.
  expand_in_transfer: EXPERIMENTAL (needs gather_rows). The de-duplicated dispatches'
    second launch, the owner's expansion of the unique rows into the receive layout
    (`row_gather.gather_live_rows`, weighted in the backward), runs inside the
    transfer's launch on `copy_ctas` more CTAs, source by source as each one's rows
    land (`pallas_kernels/transfer_expand.py`). The same bits (checked on 2 and 4
    H200s). Off by default: slower where measured (2x H200, qwen3-like EP 2, fwd+bwd:
    8.80 -> 9.39 ms, bench/results/moe_layer_NVIDIA_H200_ep2_run39_te_qwen3.json; 4x
    H200, qwen3-like EP 4: 9.90 -> 9.78 ms, run 46, 10.08 -> 9.80 and 9.97 -> 9.83, runs
    58-59, the same checksums; deepseek-like EP 4: 37.41 -> 37.52, run 60;
    pallas_kernels/NOTES_transfer_expand.md): per shape and EP degree, so the autotuner
    times it (`tune.SearchSpace.expand_in_transfer`).
  copy_ctas: CTAs of that expansion (num_ctas + copy_ctas must fit on the SMs).
  copy_stages: SMEM stages of each of those copy CTAs (>= 2; 2 as measured): their rate
    is bound by the bytes each has in flight (one H200: the expansion on 64 CTAs 1.33x its
    all-SM time), so 3 may let copy_ctas keep up where 2 fell behind (deepseek-like's
    14 KiB rows). Not yet timed.
  expand_last_on_all: EXPERIMENTAL (with expand_in_transfer): the last source's
    expansion, the one left exposed after every transfer, dealt over the transfer CTAs
    too (they join it after their last signal). The same bits.
  """

  chunk_rows: int = 128
  col_tile: int = 256
  num_ctas: int = 64
  gather_rows: bool = True
  expand_in_transfer: bool = False
  copy_ctas: int = 64
  expand_last_on_all: bool = False
  copy_stages: int = 2

  def __post_init__(self):
    if self.copy_stages < 2:
      raise ValueError(f"copy_stages={self.copy_stages} must be >= 2")
    if self.chunk_rows < 1 or self.chunk_rows & (self.chunk_rows - 1):
      raise ValueError(f"chunk_rows={self.chunk_rows} must be a power of two")
    if not 8 <= self.col_tile <= 256 or self.col_tile % 8:
      raise ValueError(f"col_tile={self.col_tile} must be a multiple of 8 in [8, 256] "
                       f"(the TMA box limit)")
    if self.num_ctas < 1:
      raise ValueError(f"num_ctas={self.num_ctas} must be >= 1")
    if self.copy_ctas < 1:
      raise ValueError(f"copy_ctas={self.copy_ctas} must be >= 1")
    if self.expand_last_on_all and not self.expand_in_transfer:
      raise ValueError("expand_last_on_all=True needs expand_in_transfer=True (it deals the "
                       "expansion inside the transfer's launch)")
    if self.expand_in_transfer and not self.gather_rows:
      raise ValueError("expand_in_transfer=True needs gather_rows=True (the launch reads "
                       "the send rows by index)")

  def smem_bytes(self, itemsize: int = 2) -> int:
    return 2 * self.chunk_rows * self.col_tile * itemsize

  def col_tile_for(self, hidden: int, itemsize: int = 2, smem_bytes: int | None = None) -> int:
    """The widest column tile <= col_tile that divides `hidden`, is a multiple of
    8 and, with 2 stages of chunk_rows rows, fits in `smem_bytes` of shared memory
    (e.g. float32 rows get half the bf16 tile)."""
    t = self.col_tile
    while t >= 8:
      fits = smem_bytes is None or 2 * self.chunk_rows * t * itemsize <= smem_bytes
      if hidden % t == 0 and fits:
        return t
      t -= 8
    raise ValueError(
        f"no column tile fits: hidden={hidden} needs a divisor that is a multiple of 8 and "
        f"<= col_tile={self.col_tile}, and 2 * chunk_rows={self.chunk_rows} * tile * "
        f"{itemsize} B must fit in {smem_bytes} B of shared memory (lower chunk_rows)")


@dataclasses.dataclass(frozen=True)
class FusedConfig:
  """The v2 fused kernels of backend "uniep" (EXPERIMENTAL; `UniEPConfig.fused`):
  Kernel A (pallas_kernels/fused_dispatch_gemm.py) pushes the rows and runs the
  gate/up GEMM in one launch, each GEMM tile waiting only for its chunk; Kernel B
  (pallas_kernels/fused_gemm_return.py) stores each down-GEMM tile straight into
  the source rank's sorted rows. The backward pass is v1's unless `backward`. Bits:
  the same as v1 (every field combination below that ran on 4x H200 gave v1's output
  and gradient checksums; pallas_kernels/NOTES_fused.md has the times).

  n_comm: CTAs (SMs) that move rows; the other num_sms - n_comm run the GEMM.
  recv_chunk_rows: B, rows per chunk of the receive layout (the unit of
    overlap); a multiple of KernelConfig.block_m (checked at launch). Each
    transfer CTA sends R signals per chunk: fewer, larger chunks signal less,
    smaller chunks start the GEMM earlier.
  return_in_kernel: True: Kernel B (the down GEMM storing its tiles straight into
    the sources' rows); False: v1's down GEMM, then v1's return transfer. The
    profile of 4x H100 (NOTES_fused.md) had Kernel B at 8.53 ms against 4.4 + 2.27
    for v1's pair (its remote stores stall the GEMM CTAs).
  backward: EXPERIMENTAL (bitwise = v1 on 4x H200; no faster there): the backward's
    dispatch of dy and its da GEMM (with dh, du in the epilogue) in one launch, as
    Kernel A fuses the forward's (`fused_dispatch_gemm.fused_dispatch_dswiglu`);
    needs the SwiGLU derivative in the kernel (`swiglu_grad_in_kernel`). False:
    v1's backward.
  wgrad_return_ctas: EXPERIMENTAL (v2.2): > 0 runs the backward's dX return (the
    transfer of d_recv back to the source ranks) on this many CTAs of the dw_gate_up
    wgrad's launch, beside its tiles (pallas_kernels/wgrad_return.py): in v1 the two
    run one after the other although neither needs the other. 0: v1's return after
    the wgrads.
  down_return_ctas: EXPERIMENTAL (v2.2, "Kernel C"): > 0 (with return_in_kernel=False)
    runs the forward's down GEMM and return in one launch
    (pallas_kernels/down_gemm_return.py): this many CTAs push each recv_chunk_rows
    chunk of the GEMM's output back to the sources as soon as its tiles are stored,
    while the other CTAs compute later chunks. 0: v1's down GEMM, then v1's return.
  dispatch_in_kernel: True: Kernel A moves the forward's rows (one per slot) inside its
    gate/up launch. False (EXPERIMENTAL, needs `UniEPConfig.dedup_tokens` resolved on):
    the forward's dispatch is the de-duplicated v1 transfer (one row per (token, owner)
    rank, `uniep_jax/dedup.py`) with the owner's live-rows copy, then v1's gate/up
    launch on every SM; the other fields apply as with Kernel A (n_comm then unused).
    Trades Kernel A's overlap for fewer bytes and no sort gather of x (T*K rows).
  overlap_copy_ctas: EXPERIMENTAL ("Kernel D",
    pallas_kernels/dedup_dispatch_gemm.py; needs dispatch_in_kernel=False): > 0 runs the
    forward's de-duplicated dispatch (on n_comm CTAs), the owner's expansion (on this
    many CTAs) and the gate/up GEMM (on the rest) in one launch, each GEMM row chunk of
    recv_chunk_rows rows starting once its rows are expanded, which needs only the unique
    rows of the expert groups up to the chunk's (`UniEPConfig.dedup_send_groups` groups:
    set it > 1, else every chunk waits for every row). 0: the transfer, the copy and the
    GEMM one after another. Bit for bit on 2x H200; there (EP 2, qwen3-like) 0.36 ms
    slower forward and 0.31 backward than the three launches; EP 4 not yet timed
    (pallas_kernels/NOTES_dedup_dispatch_gemm.md).
  overlap_copy_ctas_bwd: the same for the backward's dy dispatch, weighted expansion and
    da GEMM (with dh, du in its epilogue: needs `swiglu_grad_in_kernel`). 0: off.
  overlap_copy_stages: SMEM stages of each copy CTA of Kernel D (>= 2; 2 as every other
    row copy): the copy's rate per CTA is bound by the bytes it has in flight (one H200:
    the whole qwen3-like layout in 0.62 ms on 32 CTAs, 0.25 on all), so 3 stages may
    let fewer copy CTAs keep up with the GEMM (H 2048 and 7168 keep their column blocks
    at 3 stages; where 3 stages halve them, e.g. H 5120, the bytes in flight stay the
    same). Not yet timed.
  overlap_join_percent: p in 1..100: Kernel D's transfer CTAs, once their sends are done,
    copy too, the receive chunks from p% of the live ones on (their items dealt over
    n_comm + overlap_copy_ctas CTAs): the transfer takes ~0.6 ms of a ~1.4 ms GEMM at
    qwen3-like EP 4, its CTAs idle after. 0: off. Not yet timed.
  The bits never depend on these fields.
  """

  n_comm: int = 32
  recv_chunk_rows: int = 2048
  return_in_kernel: bool = True
  backward: bool = False
  wgrad_return_ctas: int = 0
  down_return_ctas: int = 0
  dispatch_in_kernel: bool = True
  overlap_copy_ctas: int = 0
  overlap_copy_ctas_bwd: int = 0
  overlap_copy_stages: int = 2
  overlap_join_percent: int = 0

  def __post_init__(self):
    if not 0 <= self.overlap_join_percent <= 100:
      raise ValueError(f"overlap_join_percent={self.overlap_join_percent} must be in [0, 100] "
                       f"(0: off)")
    if self.overlap_copy_stages < 2:
      raise ValueError(f"overlap_copy_stages={self.overlap_copy_stages} must be >= 2")
    for name in ("overlap_copy_ctas", "overlap_copy_ctas_bwd"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0: off)")
      if getattr(self, name) and self.dispatch_in_kernel:
        raise ValueError(f"{name}={getattr(self, name)} overlaps the DE-DUPLICATED dispatch "
                         f"with its GEMM; Kernel A (dispatch_in_kernel=True) is the other "
                         f"choice: set dispatch_in_kernel=False")
    if self.down_return_ctas < 0:
      raise ValueError(f"down_return_ctas={self.down_return_ctas} must be >= 0 (0: off)")
    if self.down_return_ctas and self.return_in_kernel:
      raise ValueError(f"down_return_ctas={self.down_return_ctas} picks Kernel C for the "
                       f"forward's return; Kernel B (return_in_kernel=True) is the other "
                       f"choice: set return_in_kernel=False")
    if self.n_comm < 1:
      raise ValueError(f"n_comm={self.n_comm} must be >= 1")
    if self.wgrad_return_ctas < 0:
      raise ValueError(f"wgrad_return_ctas={self.wgrad_return_ctas} must be >= 0 (0: off)")
    if self.recv_chunk_rows < 1:
      raise ValueError(f"recv_chunk_rows={self.recv_chunk_rows} must be >= 1")
    if not isinstance(self.dispatch_in_kernel, bool):
      raise ValueError(f"dispatch_in_kernel must be True or False, got {self.dispatch_in_kernel!r}")
    if not self.dispatch_in_kernel and self.backward:
      raise ValueError("dispatch_in_kernel=False de-duplicates both dispatches outside the "
                       "fused launches; backward=True moves the dy dispatch inside its da "
                       "launch: set backward=False")


@dataclasses.dataclass(frozen=True)
class UniEPConfig:
  """Configuration of `uniep_jax.moe_ffn`.

  backend: one of `BACKENDS`:
    "xla_dropless"    sort-based dispatch (ragged all-to-all on GPU; a padded
                      all_to_all + scatter on the CPU), `lax.ragged_dot` experts,
                      combine. Never drops.
    "xla_capacity"    GShard: each expert takes at most
                      ceil(capacity_factor * tokens * top_k / experts) assignments
                      per source shard; the overflow is dropped and counted.
    "dense_reference" single device, float32, every expert on every token: the
                      test oracle.
    "pallas"          XLA collectives + the Pallas Mosaic GPU grouped GEMM.
    "uniep"           rows pushed over NVLink from inside Pallas kernels straight
                      into the owners' receive layout and back
                      (`transfer`), the Pallas grouped GEMM for the experts.
                      Bitwise equal to "pallas" by construction (same layout,
                      same GEMM). With `fused`, the v2 kernels overlap the
                      transfers with the GEMMs (EXPERIMENTAL, see `fused`).
  routing: see `RoutingConfig`.
  capacity_factor: only for "xla_capacity".
  kernel: see `KernelConfig`; only for "pallas" / "uniep". None means auto:
    `moe_ffn` takes the tuned entry for the device and shapes from the tune
    cache (user file `$UNIEP_TUNE_CACHE`, then `uniep_jax/tuned_configs.json`)
    or else a documented heuristic (`uniep_jax.tune.resolve_config`). A
    `KernelConfig` (the default one included) is used exactly as given.
  transport: how "xla_dropless"/"pallas" move rows: "ragged"
    (`lax.ragged_all_to_all`, packed), "padded" (`lax.all_to_all` of per-peer
    worst-case buffers); None picks "ragged" on GPUs driven by one process,
    "padded" elsewhere (the CPU cannot compile ragged_all_to_all; between processes
    its NCCL fallback hangs in jaxlib 0.11.2), "nvlink" (Pallas kernels writing into
    peers' buffers; GPU only), "local" (an expert axis of size 1 only: nothing moves,
    the receive layout is the sorted order). All land every row at the same place.
    With one rank on the expert axis (every expert on every GPU, data parallel) None
    picks "local", and backend "uniep" runs as "pallas" there (see `one_rank_form`).
  transfer: see `TransferConfig`; used by the "nvlink" transport. None means
    auto, as for `kernel`.
  receive_capacity_factor: dropless backends ("xla_dropless", "pallas",
    "uniep") size each rank's receive buffer for the worst case, R*T*K rows
    (every assignment of every rank to one rank; `receive_buffer_bytes`
    reports it). A factor f bounds it to min(R*T*K, ceil(f*T*K)) rows, rounded
    up to a multiple of 128 (of 8 under 1024 rows); rows past the bound are dropped deterministically
    (the tail of the receive layout) and counted in aux["dropped"]. None: dropless.
  fused: only for "uniep": None (default) runs the v1 transfer and GEMM kernels
    one after the other; a `FusedConfig` runs the forward pass with the v2 fused
    kernels (dispatch + gate/up in one launch, down GEMM + return in another, or
    v1's down GEMM and return with `return_in_kernel=False`, or Kernel C) and, with
    `backward`, the backward's dy dispatch + da GEMM in one launch, with
    `wgrad_return_ctas` the dX return beside the dw_gate_up wgrad. EXPERIMENTAL,
    opt-in: bitwise equal to v1 on GPUs; the fastest points so far (4x H200, EP 4, runs
    21-23 of pallas_kernels/NOTES_fused.md), level within the trials' spread: Kernel C and
    the dX return beside the wgrad, with Kernel A (FusedConfig(16, 2048,
    return_in_kernel=False, wgrad_return_ctas=16, down_return_ctas=16)) or without it
    (the same with dispatch_in_kernel=False): qwen3-like 1.67-1.68x and deepseek-like
    1.41-1.44x the capacity path, against 1.52x / 1.36x for the unfused default; on
    mixtral-like only the point without Kernel A with 4 CTAs is level with the default.
    `uniep_jax/fused.py`.
  swiglu_grad_in_kernel: only for "pallas" / "uniep": compute the backward's
    SwiGLU derivative (dh, du) in the epilogue of the da = dy @ w_down^T GEMM
    (grouped GEMM mode "dswiglu") instead of storing da in float32 and running an
    XLA pass over all R*T*K receive rows. None (default): on for "pallas" and
    "uniep" (one H100, FFN fwd+bwd at the layer's shapes: 34.71 -> 32.18 ms
    deepseek-like, 36.82 -> 34.65 mixtral-like; 4x H200 training +1.1% / +0.4%
    tokens/s), off (meaningless) for the XLA backends; False: the XLA pass. The
    gradients differ from the XLA pass's by at most a bf16 ulp of dh (XLA fuses the
    sigmoid differently); "pallas" and "uniep" give the same bits as each other
    either way. `use_swiglu_grad_in_kernel` is the resolved value.
  dedup_tokens: token de-duplication for the dropless backends ("xla_dropless",
    "pallas", "uniep"): a dispatch sends each token ONCE per destination rank (not
    once per expert there) and the owner copies it to its experts' rows
    (`uniep_jax/dedup.py`; on "nvlink" a Pallas gather that writes the live rows
    only). Both dispatches: the forward's x, and the backward's dy (the owner forms
    each slot's row w * dy itself, the plain combine's multiply). Bytes per rank drop
    from T*K rows to at most T*min(R, K) (K=8, R=4: ~3.6 T). Same receive layout,
    same bits (16-bit activations; tests/test_dedup.py). The two returns are
    unchanged (slot rows returned and summed at home in slot order). With `fused`
    (Kernel A moves the forward's rows itself) only the backward's dy dispatch is
    de-duplicated, and fused.backward must be off. Costs a larger count-matrix
    all_gather (E + R + 2*T*K int32 per rank instead of E) and a unique receive
    buffer of R*T rows. None (default): auto, on for "uniep" (its transport is
    "nvlink") unless `fused.backward` moves the dy dispatch itself, off for the others
    (`use_dedup_tokens`). Measured on 4x H200, layer fwd+bwd (runs 18, 19): 43.87
    -> 42.04 ms deepseek-like, 13.26 -> 11.73 qwen3-like, mixtral-like level (30.67 vs
    30.69); 2x H200 (runs 15, 16) the same way. False: the v1 dispatch.
  dedup_send_groups: with `dedup_tokens`, the order of the unique rows a rank sends to
    one owner. 1 (default): token order. G > 1: the owner's local experts cut into G
    contiguous groups, the rows in (group of the token's smallest expert there, token)
    order, so the rows that the experts of groups 0..g read arrive first from every
    source (`DedupPlan.unique_group_ends`): the order a dispatch overlapped with its
    GEMM needs: Kernel D (`FusedConfig.overlap_copy_ctas`, pallas_kernels/
    dedup_dispatch_gemm.py) starts a GEMM chunk once every source has sent the groups
    up to its last expert. Must divide the local experts. The bits do not depend on it
    (the same rows land in the same receive rows).
  slot_reduction: how a token's K slot rows become one row, in the forward combine
    (y = sum_k w_k y_k) and in the dispatch's backward (dx = sum_k dx_k).
    "slot_order" (default): one float32 fold over k = 0..K-1 at home, rounded once.
    "owner_partials" (EXPERIMENTAL): the slots one EP rank owns summed first (each
    term w_k y_k rounded to the activation dtype, a float32 fold in expert order rounded
    to it), then the partials in rank order (`uniep_jax/combine.py`): the arithmetic of
    a return that carries one row per (token, owner rank) instead of one per slot
    (6 -> ~2.7 off-rank rows per token at K 8, EP 4). Built for the dispatch's backward
    with `dedup_tokens` (the owner folds in XLA, then one row per (token, owner) goes
    back; uniep_jax/dedup.py), not yet for the forward's return (home has every slot
    row, needed for the weights' gradient, and sums them in this order). The bits depend
    on the EP degree; the dropless backends give the same bits as each other at the
    same EP degree, as in "slot_order". "dense_reference" (the float32 oracle) ignores
    it. Not with `fused`.
  """

  backend: str = "xla_dropless"
  routing: RoutingConfig = dataclasses.field(default_factory=RoutingConfig)
  capacity_factor: float = 1.25
  kernel: Optional[KernelConfig] = dataclasses.field(default_factory=KernelConfig)
  transport: Optional[str] = None
  transfer: Optional[TransferConfig] = dataclasses.field(default_factory=TransferConfig)
  receive_capacity_factor: Optional[float] = None
  fused: Optional[FusedConfig] = None
  swiglu_grad_in_kernel: Optional[bool] = None
  dedup_tokens: Optional[bool] = None
  slot_reduction: str = "slot_order"
  dedup_send_groups: int = 1

  def __post_init__(self):
    if not isinstance(self.dedup_send_groups, int) or self.dedup_send_groups < 1:
      raise ValueError(f"dedup_send_groups={self.dedup_send_groups!r} must be an int >= 1")
    if self.slot_reduction not in SLOT_REDUCTIONS:
      raise ValueError(f"slot_reduction={self.slot_reduction!r} is unknown; expected one of "
                       f"{SLOT_REDUCTIONS}")
    if self.slot_reduction != "slot_order" and self.fused is not None:
      raise ValueError(f"slot_reduction={self.slot_reduction!r} is not built into the fused "
                       f"kernels (fused); use fused=None")
    if self.receive_capacity_factor is not None and not self.receive_capacity_factor > 0:
      raise ValueError(f"receive_capacity_factor={self.receive_capacity_factor} must be > 0 or None")
    if self.transport is not None and self.transport not in TRANSPORTS:
      raise ValueError(f"transport={self.transport!r} is unknown; expected one of {TRANSPORTS} or None")
    if self.backend not in BACKENDS:
      raise ValueError(f"backend={self.backend!r} is unknown; expected one of {BACKENDS}")
    if not self.capacity_factor > 0:
      raise ValueError(f"capacity_factor={self.capacity_factor} must be > 0")
    if self.kernel is not None and not isinstance(self.kernel, KernelConfig):
      raise ValueError(f"kernel must be a KernelConfig or None (auto), got {type(self.kernel).__name__}")
    if self.fused is not None and not isinstance(self.fused, FusedConfig):
      raise ValueError(f"fused must be a FusedConfig or None, got {type(self.fused).__name__}")
    if self.fused is not None and self.backend != "uniep":
      raise ValueError(f"fused (the v2 kernels) is only for backend='uniep', got "
                       f"backend={self.backend!r}")
    if self.swiglu_grad_in_kernel and self.backend not in ("pallas", "uniep"):
      raise ValueError(f"swiglu_grad_in_kernel (a grouped-GEMM epilogue) is only for backends "
                       f"'pallas' and 'uniep', got backend={self.backend!r}")
    if self.fused is not None and self.fused.backward and self.swiglu_grad_in_kernel is False:
      raise ValueError("fused.backward (the dy dispatch fused with the da GEMM's dswiglu "
                       "epilogue) needs swiglu_grad_in_kernel (None or True), got False")
    if self.swiglu_grad_in_kernel not in (None, True, False):
      raise ValueError(f"swiglu_grad_in_kernel must be None, True or False, "
                       f"got {self.swiglu_grad_in_kernel!r}")
    if self.dedup_tokens is not None and not isinstance(self.dedup_tokens, bool):
      raise ValueError(f"dedup_tokens must be None (auto), True or False, "
                       f"got {self.dedup_tokens!r}")
    if self.dedup_tokens and self.backend not in ("xla_dropless", "pallas", "uniep"):
      raise ValueError(f"dedup_tokens (de-duplicated dispatch) is for the dropless backends "
                       f"'xla_dropless', 'pallas', 'uniep', got backend={self.backend!r}")
    if self.dedup_tokens and self.fused is not None and self.fused.backward:
      raise ValueError("dedup_tokens with fused de-duplicates the backward's dy dispatch, which "
                       "fused.backward moves inside its da launch: set fused.backward=False or "
                       "dedup_tokens=False")
    if (self.fused is not None and not self.fused.dispatch_in_kernel
        and self.dedup_tokens is False):
      raise ValueError("fused.dispatch_in_kernel=False sends the forward's rows de-duplicated "
                       "(uniep_jax/dedup.py): it needs dedup_tokens None (auto) or True, "
                       "got False")
    if self.transfer is not None and not isinstance(self.transfer, TransferConfig):
      raise ValueError(f"transfer must be a TransferConfig or None (auto), "
                       f"got {type(self.transfer).__name__}")
    if (self.backend == "uniep" and self.transfer is not None
        and self.transfer.expand_in_transfer and not self.use_dedup_tokens):
      raise ValueError("transfer.expand_in_transfer expands the de-duplicated dispatch's "
                       "unique rows inside its transfer: it needs dedup_tokens (None: auto, "
                       "or True) and no fused.backward, got a dispatch without de-duplication")

  def one_rank_form(self) -> "UniEPConfig":
    """This config where the expert axis has one rank (every expert local): no peer to
    send to, so the rows go to the experts with the "local" transport (no collective,
    no copy: the receive layout is then the sorted order), without de-duplication
    (each token has one owner) and without the fused kernels (whose roles move rows
    between GPUs); backend "uniep" becomes "pallas" (the same layout and grouped GEMM).
    The same bits by the backends' guarantees (uniep = pallas, dedup = plain, fused =
    unfused). An explicit transport other than "local" is kept (with its dedup
    setting), as is every other backend."""
    if self.backend not in ("xla_dropless", "pallas", "uniep"):
      return self
    if self.transport not in (None, "local", "nvlink") and self.backend != "uniep":
      return self
    transfer = self.transfer
    if transfer is not None and (transfer.expand_in_transfer or transfer.expand_last_on_all):
      transfer = dataclasses.replace(transfer, expand_in_transfer=False, expand_last_on_all=False)
    return dataclasses.replace(
        self, backend="pallas" if self.backend == "uniep" else self.backend,
        transport="local", fused=None, dedup_tokens=False, dedup_send_groups=1,
        transfer=transfer)

  @property
  def use_dedup_tokens(self) -> bool:
    """dedup_tokens resolved: None means on for "uniep" (whose rows always move over
    "nvlink") unless fused.backward does the dy dispatch itself."""
    if self.dedup_tokens is None:
      return self.backend == "uniep" and not (self.fused is not None and self.fused.backward)
    return self.dedup_tokens

  @property
  def use_swiglu_grad_in_kernel(self) -> bool:
    """swiglu_grad_in_kernel resolved: None means on for "pallas" and "uniep"."""
    if self.swiglu_grad_in_kernel is None:
      return self.backend in ("pallas", "uniep")
    return self.swiglu_grad_in_kernel
