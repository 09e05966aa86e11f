"""Grouped GEMM (MoE expert compute) for Hopper in Pallas Mosaic GPU, with VJP.

Problem
-------
Rows of `lhs` [M, K] are ordered by group: group g owns rows
[start_g, end_g) with start_0 = 0 and end_g = start_g + group_sizes[g]
(`group_sizes` [G] int32, values known only at run time, sum <= M). Rows
[sum(group_sizes), M) are "dead".

  forward  out[rows of g]  = lhs[rows of g] @ rhs[g]          rhs [G, K, N]
  dgrad    dlhs[rows of g] = dout[rows of g] @ rhs[g]^T       (transposed SMEM view)
  wgrad    drhs[g]         = lhs[rows of g]^T @ dout[rows of g]   -> [G, K, N]

plus the SwiGLU expert FFN's fused variants, on its gate/up weights stored as one
array w_gate_up [G, H, 2F] = [w_gate | w_up] (`split_gate_up`): "swiglu" (one
pass over the rows computes h = x @ w_gate[g] and u = x @ w_up[g] into two
accumulators, the rhs read twice at column offsets 0 and F, and writes
a = silu(h) * u, optionally h and u too) and "dswiglu" for the backward's
da = dy @ w_down^T: a plain launch whose epilogue TMA-loads the saved h, u of its
tile and writes [dh | du] (one [M, 2F] buffer) instead of da (the SwiGLU
derivative, module function `_dswiglu_epilogue`; da never leaves the registers).
The backward's dx = [dh | du] @ w_gate_up^T is then one plain dgrad over K = 2F,
and [dw_gate | dw_up] = x^T [dh | du] one wgrad over N = 2F: no copy of the weights.

All products accumulate in float32 (wgmma); outputs are cast once at the end.

Row-tiled kernel (forward, dgrad, swiglu, dswiglu)
--------------------------------------------------
Work list. Before the launch, plain JAX turns `group_sizes` into a static-size
list of T row tiles (`_row_tile_plan`, T = `num_row_tiles`). A group's rows are cut
into tiles of block_m rows from its first row rounded down to 8, so only its last tile
is partial. The dead rows (a pseudo-group G) take block-aligned pieces.
Fields:
  group     which rhs[g] to use,
  load_row  first row of the block_m rows loaded (the block start, or the group's
            8-aligned row, clamped to M - block_m; M is padded to a multiple of
            block_m, so a load never leaves the array),
  lo, hi    the rows [lo, hi) this tile stores,
  kind      0 none (list padding), 1 compute, 2 zero (dead rows).
There is no Python loop over groups: compile time does not depend on G.

Persistent grid. num_sms CTAs ("sm") walk the schedule s = 0 .. T x n_tiles - 1
with `plgpu.nd_loop`; CTA i takes s = i, i + num_sms, ... Schedule index s is
tile (t, nt) in bands of `KernelConfig.raster_rows` row tiles (`_raster`): within a
band, column tiles outer, the band's row tiles inner (raster_rows 1: row-major, n
fastest), so the ~num_sms tiles in flight share weight tiles (None: 4 for launches
whose weight per group is >= 96 MiB, 8 from 16 MiB, else 1). Kind-0
tiles are skipped; kind-2 tiles run a pipeline of 0 steps, so their epilogue
stores a zero accumulator (no MMA, no operand loads).

CTA = 3 warpgroups ("wg"): 2 compute warpgroups and 1 memory (TMA) warpgroup
(`emit_pipeline_warp_specialized`). The CTA tile is block_m x (2 * wg_n);
compute warpgroup w owns output columns [w * wg_n, (w + 1) * wg_n).
wg_n = block_n ("plain", "dswiglu") or block_n // 2 ("swiglu": each warpgroup
keeps two accumulators, so a stage stays 48 KiB for 128/128/64).

SMEM (bf16, defaults block_m = block_n = 128, block_k = 64, 3 stages; up to 4 fit):
  per stage  A [block_m, block_k] per lhs operand (16 KiB) and
             B [block_k, 2 wg_n] per rhs operand (16 or 32 KiB), 128B swizzle;
             48 KiB;
  epilogue   [2 warpgroups, 1, block_m, 64] in the output dtype, unswizzled so
             a row range can start anywhere (16 KiB per warpgroup in bf16;
             "dswiglu" has its own [2 warpgroups, 2 (h, u), block_m, 64]).
  `stages` = min(max_concurrent_steps, k_iters, what fits in 227 KiB).

Synchronisation (all inside emit_pipeline_warp_specialized, per CTA):
  produced[s]  (one barrier per stage, arrivals = number of operands): producer
               the memory warpgroup (one TMA per operand, expect-tx bytes);
               consumer both compute warpgroups, which wait before step s's
               wgmma. Completes once per use of stage s; phase flips = reset.
  consumed[s]  (arrivals = 2, one per compute warpgroup): producer the compute
               warpgroups, after `wgmma_wait(0)` of the step (delay_release=0,
               so a stage is free only once the MMAs that read it are done);
               consumer the memory warpgroup, before it refills stage s. At the
               end of each pipeline it waits the outstanding consumed barriers,
               so every tile starts with all stages free and barrier phases
               aligned (this is what makes back-to-back tiles race-free).
  epilogue     each compute warpgroup owns its own epilogue slot; before
               writing it, `wait_smem_to_gmem(0, wait_read_only=True)` waits
               until its previous TMA stores have read it; then `commit_smem()`
               (proxy fence) before the TMA store. No
               barrier is shared between warpgroups in the epilogue.
Partial row ranges are stored with a ladder of power-of-two-row TMA stores
(block_m, block_m/2, ..., 1 rows; the bits of hi - lo), so rows outside
[lo, hi) are never written.

Row behaviour (documented contract):
  * rows [0, sum(group_sizes)) get their group's product;
  * dead rows [sum(group_sizes), M) come back ZERO (a store of zeros, no MMA);
    with `zero_window` W (the MoE layer's FFN, whose receive buffer is sized for
    the worst case and mostly dead) only those before round_up(sum, W) do, and
    the rest are not touched at all (undefined);
  * group sizes past M are clipped to M.
  * A row's result depends only on that row, its group's weights and the fixed
    block_k: no M-dependent split (row-split invariance), and every reduction is
    in a fixed order, so results are bitwise deterministic.

Wgrad kernel
------------
Tiles (g, k-tile, n-tile) of the output [G, K, N]; CTA tile (2 block_m) x block_n,
compute warpgroup w owns output rows [w block_m, (w + 1) block_m) of the k-tile.
For group g the pipeline walks the block_k-aligned row blocks
b = start_g // block_k ... cdiv(end_g, block_k) - 1 IN ORDER (dynamic pipeline
length, 0 for an empty group, whose tile is then stored as zeros). A block that
straddles the group boundary is masked: each compute warpgroup zeroes (select,
not multiply) the rows outside [start_g, end_g) of ITS OWN column slice of the
lhs tile in SMEM, then `commit_smem()`, then its wgmma; the two warpgroups touch
disjoint SMEM, so no barrier between them is needed. The dout tile is not
masked: the masked rows multiply exact zeros, so dout rows of neighbouring
groups (or dead rows) must be finite, which holds for cotangents of finite
losses. Same barriers as above (2 operands), same epilogue (always full tiles).
No atomics, no split over rows: the sum over a group's rows runs sequentially
over its row blocks in one CTA. Tile order: each group's (k tile, n tile) grid in
bands of `KernelConfig.wgrad_raster` k tiles (`_raster`; None: 4), n tiles outer, so
the tiles in flight share dout panels; which CTA runs a tile, and when, changes no bit.

Padding (the cost is a copy of the padded operand; docs/performance.md):
  contraction dims are padded to a multiple of block_k, output column dims to
  a multiple of the CTA tile, M to a multiple of block_m (the TMA row offset
  must be provably tile-aligned; MoE buffers sized T * top_k are already
  multiples of 128, so nothing is copied there) and of block_k for wgrad, all
  with zeros; results are sliced back. The SwiGLU FFN pads F
  once on the (small) weights and then works in the padded F space, so
  activations are never copied for padding.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional, Sequence

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import device as device_lib
from pallas_kernels.ragged import block_pieces, enumerate_runs
from pallas_kernels.tma import ladder_store

_NONE, _COMPUTE, _ZERO = 0, 1, 2
_EPI_N = 64  # epilogue chunk width (columns)
_NUM_COMPUTE_WGS = 2
_MEMORY_REGISTERS = 40
_SMEM_RESERVE = 1024  # barriers and alignment slack
_PLAN_FIELDS = 5


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Tiling of the grouped GEMM (the knobs the autotuner searches).

  block_m / block_n / block_k: the tile (rows of tokens, output columns, reduction
    step). block_k is fixed per launch: a row's result never depends on which other
    rows share the launch (no M-dependent split-K). Each CTA has 2 compute
    warpgroups: block_n is the width of ONE warpgroup's tile (CTA tile
    block_m x 2 block_n for forward and dgrad; "swiglu" gives each warpgroup
    block_n / 2 columns, so block_n must be a multiple of 128 there), and wgrad tiles
    are 2 block_m (K) x block_n (N). block_m must be a power of two (the ragged row
    stores' ladder).
  max_concurrent_steps: TMA pipeline depth (shared-memory stages), clamped to what fits.
  num_sms: persistent grid size; None reads the device's SM count.
  raster_rows: the order in which the persistent CTAs walk a row-tiled launch's
    (row tile, column tile) grid: bands of `raster_rows` row tiles, column tiles outer
    and the band's row tiles inner, so the CTAs running at one time share a few weight
    tiles instead of each reading its own. 1: row-major. None (default): per launch,
    `RASTER_AUTO_ROWS_LARGE` if its weight per group is at least
    `RASTER_AUTO_LARGE_BYTES`, `RASTER_AUTO_ROWS` from `RASTER_AUTO_MIN_BYTES`, else 1.
  wgrad_raster: the same walk on a wgrad launch's (k tile, n tile) grid of each group
    (bands of `wgrad_raster` k tiles, n tiles outer). None (default): bands of
    `WGRAD_RASTER_AUTO`.
  No field changes a bit of any result: every tile's sum runs whole on one CTA in a
  fixed order; only block_k fixes the accumulation order.
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 3
  num_sms: Optional[int] = None
  raster_rows: Optional[int] = None
  wgrad_raster: Optional[int] = None

  def __post_init__(self):
    for name in ("block_m", "block_n", "block_k"):
      v = getattr(self, name)
      if not isinstance(v, int) or v <= 0 or v % 64:
        raise ValueError(f"{name}={v} must be a positive multiple of 64")
    if self.max_concurrent_steps < 1:
      raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be >= 1")
    if self.num_sms is not None and self.num_sms < 1:
      raise ValueError(f"num_sms={self.num_sms} must be >= 1")
    if self.raster_rows is not None and self.raster_rows < 1:
      raise ValueError(f"raster_rows={self.raster_rows} must be >= 1 (or None: auto)")
    if self.wgrad_raster is not None and self.wgrad_raster < 1:
      raise ValueError(f"wgrad_raster={self.wgrad_raster} must be >= 1 (or None: auto)")


def split_gate_up(w_gate_up):
  """[..., 2F] -> (w_gate [..., F], w_up [..., F]): the two halves of the SwiGLU FFN's
  gate/up weights, stored as one array [w_gate | w_up] along the last axis."""
  two_f = w_gate_up.shape[-1]
  if two_f % 2:
    raise ValueError(f"w_gate_up's last axis ({two_f}) must be even: [w_gate | w_up]")
  return w_gate_up[..., :two_f // 2], w_gate_up[..., two_f // 2:]


def swiglu_grad(da, h, u):
  """(dh, du) of a = silu(h) * u given da, all float32: s = sigmoid(h),
  dh = da * u * s * (1 + h (1 - s)), du = da * h * s. The one formula of every
  backend: the "dswiglu" epilogue and the XLA experts run these same ops."""
  s = jax.nn.sigmoid(h)
  return da * u * s * (1.0 + h * (1.0 - s)), da * h * s


# ----------------------------------------------------------------------------
# Launch parameters
# ----------------------------------------------------------------------------


def resolve_interpret(interpret):
  """`None` -> interpret params on a CPU backend, else compile for the GPU
  (`device_lib.default_interpret`)."""
  if interpret is None:
    return device_lib.default_interpret()
  return interpret


@dataclasses.dataclass(frozen=True)
class _Launch:
  """Static shape of one row-tiled or wgrad launch (derived, not a user knob)."""

  block_m: int
  block_k: int
  wg_n: int  # output columns per compute warpgroup
  num_a: int  # lhs operands per stage
  num_b: int  # rhs operands per stage
  b_cols: int  # columns (or rows, transposed) of each rhs stage tile
  a_cols: int  # columns of each lhs stage tile
  out_itemsize: int
  in_itemsize: int
  epi_buffers: int = 1  # epilogue buffers per warpgroup (2 in "dswiglu": h and u)

  def stage_bytes(self) -> int:
    return self.in_itemsize * (
        self.num_a * self.block_m * self.a_cols + self.num_b * self.block_k * self.b_cols)

  def epilogue_bytes(self, epi_rows: int) -> int:
    return _NUM_COMPUTE_WGS * self.epi_buffers * epi_rows * _EPI_N * self.out_itemsize

  def stages(self, requested: int, k_iters: int, epi_rows: int, smem: int) -> int:
    return fit_stages(requested, k_iters, self.stage_bytes(), self.epilogue_bytes(epi_rows),
                      smem)


def fit_stages(requested: int, steps: int, stage_bytes: int, epilogue_bytes: int,
               smem: int) -> int:
  """Pipeline stages of a launch: `requested`, at most its `steps` (at least 1) and what
  fits in `smem` bytes beside the epilogue and the barriers (ValueError if none does)."""
  fit = (smem - _SMEM_RESERVE - epilogue_bytes) // stage_bytes
  stages = min(requested, max(steps, 1), fit)
  if stages < 1:
    raise ValueError(f"tile does not fit in {smem} bytes of shared memory: "
                     f"stage {stage_bytes} B + epilogue {epilogue_bytes} B")
  return int(stages)


def smem_bytes(config: KernelConfig, dtype=jnp.bfloat16, out_dtype=None, mode: str = "plain") -> int:
  """Shared memory of one CTA of the row-tiled kernel for `config` (all stages)."""
  out_dtype = out_dtype or dtype
  launch = _launch_of(config, mode, dtype, out_dtype)
  return (config.max_concurrent_steps * launch.stage_bytes()
          + launch.epilogue_bytes(config.block_m) + _SMEM_RESERVE)


# mode -> (lhs operands, rhs operands) per pipeline stage; the two-operand modes give
# each warpgroup block_n // 2 columns
_MODE_OPERANDS = {"plain": (1, 1), "dswiglu": (1, 1), "swiglu": (1, 2)}


def _launch_of(config: KernelConfig, mode: str, in_dtype, out_dtype) -> "_Launch":
  num_a, num_b = _MODE_OPERANDS[mode]
  wg_n = config.block_n if num_b == 1 else config.block_n // 2
  return _Launch(config.block_m, config.block_k, wg_n, num_a, num_b, 2 * wg_n, config.block_k,
                 jnp.dtype(out_dtype).itemsize, jnp.dtype(in_dtype).itemsize,
                 epi_buffers=2 if mode == "dswiglu" else 1)


def _swizzle_transforms(dtype, minor: int):
  swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
  swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _pad_axis(x, axis: int, size: int):
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


# ----------------------------------------------------------------------------
# Work lists (plain JAX, before the launch)
# ----------------------------------------------------------------------------


def _group_bounds(group_sizes, m: int):
  """[start_g, end_g) of every group, clipped to [0, m]. int32 [G] each."""
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  cumsum = jnp.cumsum(sizes)
  ends = jnp.minimum(cumsum, m)
  # from the unclipped sums, so a group past m is empty (ends - sizes would make the
  # groups overlap when the sizes sum past m)
  starts = jnp.minimum(cumsum - sizes, m)
  return starts, ends


# row tiles start at a group's first row rounded down to this many rows: the A
# operand's TMA tiling is (8, 64) (bf16)
GROUP_TILE_ALIGN = 8


def num_row_tiles(m: int, num_groups: int, block_m: int) -> int:
  """Static length of the row-tile work list: group g's live rows take
  cdiv(n_g + 7, block_m) <= n_g / block_m + 1 + 6 / block_m tiles, the dead rows'
  block pieces one more than their blocks."""
  extra = -(-(GROUP_TILE_ALIGN - 1) * num_groups // block_m) + 1
  return -(-m // block_m) + num_groups + extra


def _row_tile_plan(group_sizes, m: int, block_m: int, zero_window: Optional[int] = None):
  """Flat int32 [5 * T] work list: group, load_row, lo, hi, kind (see module doc).
  zero_window=None: every dead row gets a ZERO tile. zero_window=W: only the dead
  row blocks starting before round_up(sum(group_sizes), W) do; the later ones are
  NONE, so those rows of the outputs are left undefined (not written at all).
  Group g's rows are cut into tiles from its first row rounded down to
  GROUP_TILE_ALIGN (at most 7 rows of the previous group loaded, not stored), so only
  each group's last tile is partial (~block_m / 2 wasted rows per group); load_row is
  clamped to m - block_m (the load box stays inside; the tile's rows then sit further
  down it). The dead rows take block-aligned pieces. A row's bits do not depend on its
  position in the tile (row-split invariance)."""
  g = group_sizes.shape[0]
  starts, ends = _group_bounds(group_sizes, m)
  total = ends[-1]
  starts_x = jnp.concatenate([starts, total[None]])  # [G + 1]; G = dead rows
  ends_x = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
  sizes = ends_x - starts_x
  first, count = block_pieces(starts_x, sizes, block_m)
  first_row = first * block_m
  # live groups: tiles from the group's (aligned-down) first row
  aligned = starts // GROUP_TILE_ALIGN * GROUP_TILE_ALIGN
  live_count = jnp.where(ends > starts, (ends - aligned + block_m - 1) // block_m, 0)
  count = jnp.concatenate([live_count.astype(jnp.int32), count[g:]])
  first_row = jnp.concatenate([aligned, first_row[g:]])
  gi, piece, valid = enumerate_runs(count, num_row_tiles(m, g, block_m))
  row0 = first_row[gi] + piece * block_m   # gi in [0, G]
  lo = jnp.maximum(starts_x[gi], row0)
  hi = jnp.minimum(ends_x[gi], row0 + block_m)
  # m is a multiple of block_m (the wrapper pads): block-aligned loads (the dead rows')
  # stay inside, group-aligned ones are clamped
  load_row = jnp.minimum(row0, m - block_m)
  dead_kind = _ZERO
  if zero_window is not None:
    dead_kind = jnp.where(row0 < -(-total // zero_window) * zero_window, _ZERO, _NONE)
  kind = jnp.where(valid, jnp.where(gi < g, _COMPUTE, dead_kind), _NONE)
  group = jnp.where(gi < g, gi, 0)
  lo = jnp.where(valid, lo, 0)
  hi = jnp.where(valid, hi, 0)
  load_row = jnp.where(valid, load_row, 0)
  return jnp.concatenate([group, load_row, lo, hi, kind]).astype(jnp.int32)


# ----------------------------------------------------------------------------
# Shared pieces of the kernel bodies
# ----------------------------------------------------------------------------


def read_plan(plan_gmem, t, num_tiles: int, load_align: int):
  """Row tile t of a `_row_tile_plan` work list in GMEM: (group, load_row, lo, hi, kind)."""
  return (plan_gmem[t], pl.multiple_of(plan_gmem[num_tiles + t], load_align),
          plan_gmem[2 * num_tiles + t], plan_gmem[3 * num_tiles + t],
          plan_gmem[4 * num_tiles + t])


def _store_epilogue(vals, out_gmems, epi_smem, *, smem_row, gmem_row, count, rows: int,
                    col0, ragged: bool):
  """Each compute warpgroup stores its [rows, wg_n] values through its own SMEM slot
  (epi_smem [warpgroups, 1, rows, _EPI_N]), chunk by chunk (see the module doc,
  "epilogue"): before each chunk, wait until every earlier TMA store has read the
  slot."""
  slot = epi_smem.at[lax.axis_index("wg"), 0]
  for val, out_gmem in zip(vals, out_gmems):
    for c in range(val.shape[1] // _EPI_N):
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # slot free again
      slot[...] = val[:, c * _EPI_N:(c + 1) * _EPI_N].astype(slot.dtype)
      plgpu.commit_smem()
      dst = out_gmem.at[:, pl.ds(col0 + c * _EPI_N, _EPI_N)]
      if ragged:
        ladder_store(slot, dst, smem_row, gmem_row, count, rows, commit_group=True)
      else:
        plgpu.copy_smem_to_gmem(slot, dst.at[pl.ds(gmem_row, rows)], commit_group=True)


def _silu_mul(h, u):
  return h * jax.nn.sigmoid(h) * u


def _dswiglu_epilogue(da, h_gmem, u_gmem, dhu_gmem, hu_smem, hu_barrier, *, load_row,
                      smem_row, gmem_row, count, rows: int, col0):
  """The "dswiglu" epilogue of one compute warpgroup: da [rows, wg_n] (f32, the
  accumulator) -> dh, du of the same rows and F columns, chunk by chunk:
    TMA-load h, u [rows, 64] (rows load_row.., the saved residuals) into this
    warpgroup's buffer pair, wait its barrier, read them (each thread reads the
    elements it later overwrites: same layout, no cross-thread hazard), compute
      s = sigmoid(h), dh = da * u * s * (1 + h (1 - s)), du = da * h * s   (f32)
    write dh, du over h, u, fence, and store rows [lo, hi) with the TMA ladder.
  Before each chunk's loads, the previous chunk's stores must have read the buffer.
  dhu_gmem: one [M, 2N] buffer [dh | du] (du's columns start at N)."""
  du_col_offset = dhu_gmem.shape[1] // 2
  wg = lax.axis_index("wg")
  buf = hu_smem.at[wg]
  bar = hu_barrier.at[wg]
  for c in range(da.shape[1] // _EPI_N):
    col = col0 + c * _EPI_N
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for i, src in enumerate((h_gmem, u_gmem)):
      plgpu.copy_gmem_to_smem(src.at[pl.ds(load_row, rows), pl.ds(col, _EPI_N)], buf.at[i], bar)
    plgpu.barrier_wait(bar)
    h = buf.at[0][...].astype(jnp.float32)
    u = buf.at[1][...].astype(jnp.float32)
    dh, du = swiglu_grad(da[:, c * _EPI_N:(c + 1) * _EPI_N], h, u)
    buf.at[0][...] = dh.astype(buf.dtype)
    buf.at[1][...] = du.astype(buf.dtype)
    plgpu.commit_smem()
    for i, offset in enumerate((0, du_col_offset)):
      ladder_store(buf.at[i], dhu_gmem.at[:, pl.ds(offset + col, _EPI_N)], smem_row, gmem_row,
                   count, rows)


# ----------------------------------------------------------------------------
# Row-tiled kernel: forward / dgrad / swiglu / dswiglu
# ----------------------------------------------------------------------------


# KernelConfig.raster_rows=None: bands of RASTER_AUTO_ROWS row tiles for a launch whose
# weight per group (K x N x rhs operands) is at least RASTER_AUTO_MIN_BYTES, bands of
# RASTER_AUTO_ROWS_LARGE from RASTER_AUTO_LARGE_BYTES, else row-major. Why (1x H100):
# weights of 29-235 MB gain 8-13% per FFN fwd+bwd with bands of 8, weights of 2.9-6.3 MB
# (L2-resident) lose 1-3%. Bands of 4 instead of 8 (4x H200): mixtral-like (weights of
# 117 and 235 MB) -0.4 to -0.7 ms per layer fwd+bwd, deepseek-like (29 and 59 MB) +0.3
# to +0.5 (inside its spread); on one H200, mixtral-like: dx 6.07 -> 5.64 ms, gate/up
# 6.43 -> 6.24, da 3.29 -> 3.21. Empirical: the two shapes measured, not a model
# (docs/decisions.md, "Tile orders").
RASTER_AUTO_ROWS = 8
RASTER_AUTO_MIN_BYTES = 16 << 20
RASTER_AUTO_ROWS_LARGE = 4
RASTER_AUTO_LARGE_BYTES = 96 << 20


def _raster(s, num_tiles: int, n_tiles: int, rows: int):
  """Schedule index s -> linear tile index t * n_tiles + nt, walking the grid in bands
  of `rows` row tiles (the last band may be shorter): band b holds row tiles
  [b rows, b rows + height); inside it s runs over the column tiles, and for each
  column tile over the band's row tiles. A bijection of [0, num_tiles * n_tiles);
  rows = 1 is the identity (row-major)."""
  if rows <= 1:
    return s
  band = s // (rows * n_tiles)
  first = band * rows
  height = jnp.minimum(num_tiles - first, rows)
  within = s - band * (rows * n_tiles)
  return (first + within % height) * n_tiles + within // height


def _row_tiled_kernel(plan_gmem, *refs, mode: str, transpose_b: bool, save_hu: bool,
                      b_col_offsets: tuple = (), raster_rows: int = 1,
                      m: int, k: int, n: int, num_tiles: int, block_m: int, load_align: int,
                      block_k: int,
                      wg_n: int, stages: int, in_dtype, cta_offset: int = 0,
                      num_ctas: Optional[int] = None,
                      after_tile: Optional[Callable[[Any, Any], None]] = None):
  """The row-tiled body. Hooks for kernels that embed it (all default off, and
  then the traced program is exactly that of the standalone kernel):
    cta_offset, num_ctas  walk the tiles on CTAs [cta_offset, cta_offset +
        num_ctas) of the "sm" grid axis only (same interleaved order as
        `plgpu.nd_loop`: local CTA i takes schedule steps i, i + num_ctas, ...,
        each mapped through the same `raster_rows` bands; bands walk the rows
        upward, band after band); the caller must run this body only on those CTAs.
        None: every CTA.
    after_tile(lo, hi)  called by each of the two COMPUTE warpgroups after it has
        issued the epilogue stores of a compute or zero tile (not "dswiglu"), e.g. to
        wait for them and signal that its columns of the tile's rows [lo, hi) are
        written (`down_gemm_return.py`).
  """
  if after_tile is not None and mode == "dswiglu":
    raise ValueError("after_tile: mode 'dswiglu' stores through its own epilogue, which "
                     "does not call the hook (a caller counting its signals would wait "
                     "forever)")
  num_a, num_b = _MODE_OPERANDS[mode]
  a_gmems = refs[:num_a]
  b_gmems = refs[num_a:num_a + num_b]
  epi_in_gmems = refs[num_a + num_b:num_a + num_b + 2] if mode == "dswiglu" else ()
  out_gmems = refs[num_a + num_b + len(epi_in_gmems):]
  cta_n = _NUM_COMPUTE_WGS * wg_n
  k_iters = k // block_k
  n_tiles = n // cta_n
  pairs = {"plain": ((0, 0, 0),), "dswiglu": ((0, 0, 0),),
           "swiglu": ((0, 0, 0), (0, 1, 1))}[mode]
  num_acc = 2 if mode == "swiglu" else 1

  a_transforms = _swizzle_transforms(in_dtype, block_k)
  b_transforms = _swizzle_transforms(in_dtype, block_k if transpose_b else cta_n)

  def mma_step(_, *args):
    *smems, accs = args
    a_smems, b_smems = smems[:num_a], smems[num_a:]
    wg_cols = pl.ds(lax.axis_index("wg") * wg_n, wg_n)
    for ai, bi, ci in pairs:
      if transpose_b:
        b = b_smems[bi].at[wg_cols, :].T
      else:
        b = b_smems[bi].at[:, wg_cols]
      plgpu.wgmma(accs[ci], a_smems[ai], b)
    # the step's stage is released (consumed) once its MMAs are done
    plgpu.wgmma_wait(0)
    return accs

  def make_pipeline(compute_context, k_steps):
    a_spec = plgpu.BlockSpec((block_m, block_k), lambda ki: (0, ki), transforms=a_transforms)
    if transpose_b:
      b_spec = plgpu.BlockSpec((cta_n, block_k), lambda ki: (0, ki), transforms=b_transforms)
    else:
      b_spec = plgpu.BlockSpec((block_k, cta_n), lambda ki: (ki, 0), transforms=b_transforms)
    return plgpu.emit_pipeline_warp_specialized(
        mma_step,
        grid=(k_steps,),
        memory_registers=_MEMORY_REGISTERS,
        in_specs=[a_spec] * num_a + [b_spec] * num_b,
        wg_axis="wg",
        num_compute_wgs=_NUM_COMPUTE_WGS,
        max_concurrent_steps=stages,
        compute_context=compute_context,
    )

  def operand_views(group, load_row, nt):
    a_views = [a.at[pl.ds(load_row, block_m), :] for a in a_gmems]
    offsets = b_col_offsets or (0,) * num_b
    if transpose_b:
      b_views = [b.at[group, pl.ds(off + nt * cta_n, cta_n), :]
                 for b, off in zip(b_gmems, offsets)]
    else:
      b_views = [b.at[group, :, pl.ds(off + nt * cta_n, cta_n)]
                 for b, off in zip(b_gmems, offsets)]
    return a_views, b_views

  a0, b0 = operand_views(0, 0, 0)
  ignore = lambda *_, **__: None
  # Dynamic grid (k_steps is traced) so the allocation matches every tile's pipeline.
  alloc_pipeline = make_pipeline(ignore, jnp.int32(k_iters))

  if mode == "dswiglu":   # h, u buffer pairs (also the output staging) + their barriers
    scoped = dict(epi_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, 2, block_m, _EPI_N),
                                      out_gmems[0].dtype),
                  hu_barrier=plgpu.Barrier(num_arrivals=2, num_barriers=_NUM_COMPUTE_WGS))
  else:
    scoped = dict(epi_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, 1, block_m, _EPI_N),
                                      out_gmems[0].dtype))

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=alloc_pipeline.get_allocations(*a0, *b0),
      collective_axes="wg",
      **scoped,
  )
  def _scope(pipeline_allocs, epi_smem, hu_barrier=None):
    def tile(lin):
      t = lin // n_tiles
      nt = lin % n_tiles
      group, load_row, lo, hi, kind = read_plan(plan_gmem, t, num_tiles, load_align)

      @pl.when(kind != _NONE)
      def _live_tile():
        k_steps = jnp.where(kind == _COMPUTE, k_iters, 0)

        def compute_context(eval_pipeline):
          def acc_scope(*accs):
            eval_pipeline(tuple(accs))
            vals = [acc[...] for acc in accs]
            if mode == "swiglu":
              outs = [_silu_mul(vals[0], vals[1])] + (vals if save_hu else [])
            else:
              outs = vals
            col0 = nt * cta_n + lax.axis_index("wg") * wg_n
            if mode == "dswiglu":   # one [m, 2n] output [dh | du]
              _dswiglu_epilogue(vals[0], *epi_in_gmems, out_gmems[0], epi_smem, hu_barrier,
                                load_row=load_row, smem_row=lo - load_row, gmem_row=lo,
                                count=hi - lo, rows=block_m, col0=col0)
              return
            _store_epilogue(outs, out_gmems, epi_smem, smem_row=lo - load_row, gmem_row=lo,
                            count=hi - lo, rows=block_m, col0=col0, ragged=True)
            if after_tile is not None:
              after_tile(lo, hi)
          pl.run_scoped(acc_scope, *[plgpu.ACC((block_m, wg_n), jnp.float32)] * num_acc)

        a_views, b_views = operand_views(group, load_row, nt)
        make_pipeline(compute_context, k_steps)(*a_views, *b_views, allocations=pipeline_allocs)

    if num_ctas is None:
      @plgpu.nd_loop((num_tiles * n_tiles,), collective_axes="sm")
      def _tile_loop(loop_info):
        (s,) = loop_info.index
        tile(_raster(s, num_tiles, n_tiles, raster_rows))
    else:   # the same banded walk on the subset
      _cta_subset_loop(num_tiles * n_tiles, cta_offset, num_ctas,
                       lambda s: tile(_raster(s, num_tiles, n_tiles, raster_rows)))

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _cta_subset_loop(total, cta_offset: int, num_ctas: int, body):
  """`body(lin)` for lin = i, i + num_ctas, ... < total, where i = this CTA's
  index on the "sm" axis minus cta_offset (nd_loop's order on a CTA subset).
  total may be traced (a run-time tile count)."""
  local = lax.axis_index("sm") - cta_offset
  steps = jnp.maximum(total - local + num_ctas - 1, 0) // num_ctas

  def step(i, carry):
    body(local + i * num_ctas)
    return carry

  lax.fori_loop(0, steps, step, 0)


def row_tiled_params(m: int, k: int, n: int, g: int, *, mode: str, transpose_b: bool,
                     out_dtype, in_dtype, save_hu: bool, config: KernelConfig,
                     smem: int = device_lib.HOPPER_SMEM_BYTES,
                     b_col_offsets: tuple = ()) -> dict:
  """Validates one row-tiled launch on operands padded to the tile grid and
  returns the static keyword arguments of `_row_tiled_kernel` (one source of
  truth for the standalone launch and for kernels that embed the body).
  b_col_offsets: per rhs operand, where its n output columns start in it (mode
  "swiglu" reads w_gate_up twice, at 0 and F); () = all 0.
  Raises ValueError if the tile does not fit in `smem` bytes."""
  if mode not in _MODE_OPERANDS:
    raise ValueError(f"unknown {mode=}; expected one of {tuple(_MODE_OPERANDS)}")
  launch = _launch_of(config, mode, in_dtype, out_dtype)
  wg_n = launch.wg_n
  if wg_n % _EPI_N:
    raise ValueError(f"per-warpgroup tile width {wg_n=} must be a multiple of {_EPI_N}")
  cta_n = _NUM_COMPUTE_WGS * wg_n
  block_m, block_k = config.block_m, config.block_k
  if block_m & (block_m - 1):
    raise ValueError(f"{block_m=} must be a power of two (ragged TMA store ladder)")
  if k % block_k:
    raise ValueError(f"{k=} must be divisible by {block_k=}")
  if b_col_offsets and (len(b_col_offsets) != launch.num_b
                        or any(o % cta_n for o in b_col_offsets)):
    raise ValueError(f"{b_col_offsets=} must give each of the {launch.num_b} rhs operands "
                     f"a multiple of the CTA tile width {cta_n}")
  if n % cta_n:
    raise ValueError(f"{n=} must be divisible by the CTA tile width {cta_n}")
  if m % block_m:
    raise ValueError(f"{m=} must be divisible by {block_m=}")
  stages = launch.stages(config.max_concurrent_steps, k // block_k, block_m, smem)
  raster = config.raster_rows
  if raster is None:   # auto: bands only where a group's weight leaves L2
    weight_bytes = k * n * launch.num_b * jnp.dtype(in_dtype).itemsize
    raster = (RASTER_AUTO_ROWS_LARGE if weight_bytes >= RASTER_AUTO_LARGE_BYTES
              else RASTER_AUTO_ROWS if weight_bytes >= RASTER_AUTO_MIN_BYTES else 1)
  return dict(mode=mode, transpose_b=transpose_b, save_hu=save_hu, b_col_offsets=b_col_offsets,
              raster_rows=raster, m=m, k=k, n=n, num_tiles=num_row_tiles(m, g, block_m),
              block_m=block_m, load_align=GROUP_TILE_ALIGN, block_k=block_k,
              wg_n=wg_n, stages=stages, in_dtype=in_dtype)


def _row_tiled_call(a_list, b_list, group_sizes, *, mode: str, transpose_b: bool,
                    out_dtype, save_hu: bool, config: KernelConfig, interpret,
                    zero_window: Optional[int] = None, epi_inputs: Sequence = (),
                    b_col_offsets: tuple = ()):
  """Launch the row-tiled kernel on operands already padded to the tile grid.
  zero_window: see `_row_tile_plan` (None: dead rows come back zero).

  a_list: [M, K] each; b_list: [G, K, N] (or [G, N, K] with transpose_b).
  Returns a tuple of [M, N] outputs. Mode "dswiglu": epi_inputs = (h, u) [M, N]
  (x.dtype), read by the epilogue; returns one [M, 2N] buffer [dh | du] in out_dtype
  (the lhs of the dx launch over K = 2N and of the [dw_gate | dw_up] wgrad).
  b_col_offsets: see `row_tiled_params`; N is then each rhs's width minus the
  largest offset (mode "swiglu" on [w_gate | w_up]: offsets (0, F), N = F).
  """
  if (mode == "dswiglu") != (len(epi_inputs) == 2):
    raise ValueError(f"mode {mode!r} takes epi_inputs=(h, u) exactly when it is 'dswiglu'")
  m, k = a_list[0].shape
  g = b_list[0].shape[0]
  n = b_list[0].shape[1] if transpose_b else b_list[0].shape[2]
  n -= max(b_col_offsets, default=0)
  in_dtype = a_list[0].dtype
  for x in (*a_list, *b_list):
    if x.dtype != in_dtype:
      raise ValueError(f"all operands must share one dtype, got {x.dtype} and {in_dtype}")
  params = row_tiled_params(m, k, n, g, mode=mode, transpose_b=transpose_b, out_dtype=out_dtype,
                            in_dtype=in_dtype, save_hu=save_hu, config=config,
                            b_col_offsets=b_col_offsets)
  plan = _row_tile_plan(group_sizes, m, config.block_m, zero_window)
  num_out = 3 if (mode == "swiglu" and save_hu) else 1
  for x in epi_inputs:
    if x.shape != (m, n) or x.dtype != out_dtype:
      raise ValueError(f"epilogue input {x.shape} {x.dtype} must be {(m, n)} {out_dtype}")
  body = functools.partial(_row_tiled_kernel, **params)
  out_n = 2 * n if mode == "dswiglu" else n
  out_type = tuple(jax.ShapeDtypeStruct((m, out_n), out_dtype) for _ in range(num_out))
  kernel = device_lib.kernel(
      body,
      kernel_name=f"grouped_gemm_{mode}{'_t' if transpose_b else ''}",   # names in profiles
      out_type=out_type,
      grid=(device_lib.num_sms(config.num_sms),),
      grid_names=("sm",),
      num_threads=_NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=resolve_interpret(interpret),
  )
  return kernel(plan, *a_list, *b_list, *epi_inputs)


# ----------------------------------------------------------------------------
# Wgrad kernel
# ----------------------------------------------------------------------------


def _wgrad_kernel(bounds_gmem, lhs_gmem, dout_gmem, out_gmem, *, num_groups: int,
                  block_m: int, block_n: int, block_k: int, stages: int, in_dtype,
                  raster_k: int = 1, cta_offset: int = 0, num_ctas: Optional[int] = None):
  """The wgrad body. raster_k: each group's (k-tile, n-tile) grid walked in bands of
  raster_k k-tiles (`_raster`; 1: row-major). cta_offset, num_ctas (default off: the
  standalone kernel's program): walk the output tiles on CTAs [cta_offset, cta_offset +
  num_ctas) of the "sm" axis only (local CTA i takes tiles i, i + num_ctas, ...), for
  kernels that give the other CTAs other work (`wgrad_return.py`). A tile's sum runs
  whole on one CTA in a fixed order, so which CTA runs it, and when, changes no bit."""
  _, k_out = lhs_gmem.shape
  _, n_out = dout_gmem.shape
  cta_k = _NUM_COMPUTE_WGS * block_m
  k_tiles = k_out // cta_k
  n_tiles = n_out // block_n
  a_transforms = _swizzle_transforms(in_dtype, cta_k)
  b_transforms = _swizzle_transforms(in_dtype, block_n)

  def make_pipeline(compute_context, num_blocks, first_block, start, end):
    def mma_step(idxs, a_smem, b_smem, acc):
      (r,) = idxs
      a_wg = a_smem.at[:, pl.ds(lax.axis_index("wg") * block_m, block_m)]
      row0 = (first_block + r) * block_k

      @pl.when((row0 < start) | (row0 + block_k > end))
      def _mask_rows():  # this warpgroup's own columns only: no cross-wg race
        rows = row0 + plgpu.layout_cast(
            lax.broadcasted_iota(jnp.int32, (block_k, block_m), 0), plgpu.Layout.WGMMA)
        tile = a_wg[...]
        a_wg[...] = jnp.where((rows >= start) & (rows < end), tile, jnp.zeros_like(tile))
        plgpu.commit_smem()

      plgpu.wgmma(acc, a_wg.T, b_smem)
      plgpu.wgmma_wait(0)   # as the row-tiled kernel's mma_step
      return acc

    return plgpu.emit_pipeline_warp_specialized(
        mma_step,
        grid=(num_blocks,),
        memory_registers=_MEMORY_REGISTERS,
        in_specs=[
            plgpu.BlockSpec((block_k, cta_k), lambda r: (first_block + r, 0),
                            transforms=a_transforms),
            plgpu.BlockSpec((block_k, block_n), lambda r: (first_block + r, 0),
                            transforms=b_transforms),
        ],
        wg_axis="wg",
        num_compute_wgs=_NUM_COMPUTE_WGS,
        max_concurrent_steps=stages,
        compute_context=compute_context,
    )

  ignore = lambda *_, **__: None
  alloc_pipeline = make_pipeline(ignore, jnp.int32(1), 0, 0, 0)

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=alloc_pipeline.get_allocations(
          lhs_gmem.at[:, pl.ds(0, cta_k)], dout_gmem.at[:, pl.ds(0, block_n)]),
      epi_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, 1, block_m, _EPI_N), out_gmem.dtype),
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, epi_smem):
    def tile(lin):
      g = lin // (k_tiles * n_tiles)
      within = _raster(lin % (k_tiles * n_tiles), k_tiles, n_tiles, raster_k)
      kt = within // n_tiles
      nt = within % n_tiles
      start = bounds_gmem[g]
      end = bounds_gmem[num_groups + g]
      first_block = start // block_k
      num_blocks = jnp.where(end > start, (end + block_k - 1) // block_k - first_block, 0)

      def compute_context(eval_pipeline):
        def acc_scope(acc):
          eval_pipeline(acc)
          wg = lax.axis_index("wg")
          _store_epilogue([acc[...]], [out_gmem.at[g]], epi_smem, smem_row=0,
                          gmem_row=kt * cta_k + wg * block_m, count=block_m, rows=block_m,
                          col0=nt * block_n, ragged=False)
        pl.run_scoped(acc_scope, plgpu.ACC((block_m, block_n), jnp.float32))

      make_pipeline(compute_context, num_blocks, first_block, start, end)(
          lhs_gmem.at[:, pl.ds(kt * cta_k, cta_k)],
          dout_gmem.at[:, pl.ds(nt * block_n, block_n)],
          allocations=pipeline_allocs)

    total = num_groups * k_tiles * n_tiles
    if num_ctas is None:
      @plgpu.nd_loop((total,), collective_axes="sm")
      def _tile_loop(loop_info):
        (lin,) = loop_info.index
        tile(lin)
    else:
      _cta_subset_loop(total, cta_offset, num_ctas, tile)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


# KernelConfig.wgrad_raster=None: bands of WGRAD_RASTER_AUTO k-tiles. The CTAs running at
# one time then cover ~b k-tiles x (SMs / b) n-tiles of a group, and every 64-row step
# reads b lhs panels (2 block_m = 256 columns each) and SMs / b dout panels (block_n =
# 128 columns): b ~ sqrt(132 * 128 / 256) ~ 8 minimises those bytes. Row-major (b = 1)
# reads one lhs panel and ~132 dout panels per step, so a group whose dout leaves L2
# (mixtral-like dw_gate_up: [8192, 28672], 470 MB) is read from HBM once per k-tile.
# Measured (1x H200, the layer's EP 4 rows, ms for b = 1 / 4 / 8 / 16): mixtral-like
# dw_gate_up 6.31 / 5.50 / 5.61 / 5.76, dw_down 2.60 / 2.53 / 2.69 / 2.61; deepseek-like
# and qwen3-like (groups whose operands stay in L2) level within the run-to-run spread
# (~5% on deepseek-like). Hence 4, not the bytes model's 8.
WGRAD_RASTER_AUTO = 4


def wgrad_launch(config: KernelConfig, in_dtype, out_dtype) -> _Launch:
  """The static shape of a wgrad launch (its SMEM: `_Launch.stage_bytes`, `epilogue_bytes`)."""
  return _Launch(config.block_k, config.block_k, config.block_n // 2, 1, 1, config.block_n,
                 _NUM_COMPUTE_WGS * config.block_m, jnp.dtype(out_dtype).itemsize,
                 jnp.dtype(in_dtype).itemsize)


def wgrad_params(m: int, num_groups: int, in_dtype, out_dtype, config: KernelConfig,
                 smem: int = device_lib.HOPPER_SMEM_BYTES) -> dict:
  """The static keyword arguments of `_wgrad_kernel` for m padded rows (one source of
  truth for the standalone launch and for kernels that embed the body)."""
  launch = wgrad_launch(config, in_dtype, out_dtype)
  stages = launch.stages(config.max_concurrent_steps, m // config.block_k, config.block_m, smem)
  raster_k = WGRAD_RASTER_AUTO if config.wgrad_raster is None else config.wgrad_raster
  return dict(num_groups=num_groups, block_m=config.block_m, block_n=config.block_n,
              block_k=config.block_k, stages=stages, in_dtype=in_dtype, raster_k=raster_k)


def wgrad_bounds(group_sizes, m: int):
  """The wgrad body's first operand: [starts | ends] of every group's rows, int32."""
  starts, ends = _group_bounds(group_sizes, m)
  return jnp.concatenate([starts, ends]).astype(jnp.int32)


def _wgrad_call(lhs, dout, group_sizes, *, out_dtype, config: KernelConfig, interpret):
  """drhs[g] = lhs[rows g]^T @ dout[rows g] on operands padded to the tile grid."""
  m, k_out = lhs.shape
  _, n_out = dout.shape
  g = group_sizes.shape[0]
  block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
  cta_k = _NUM_COMPUTE_WGS * block_m
  if k_out % cta_k:
    raise ValueError(f"{k_out=} must be divisible by the CTA tile {cta_k}")
  if n_out % block_n:
    raise ValueError(f"{n_out=} must be divisible by {block_n=}")
  if m % block_k:
    raise ValueError(f"{m=} must be divisible by {block_k=}")
  in_dtype = lhs.dtype
  if dout.dtype != in_dtype:
    raise ValueError(f"lhs and dout must share one dtype, got {lhs.dtype} and {dout.dtype}")
  body = functools.partial(_wgrad_kernel, **wgrad_params(m, g, in_dtype, out_dtype, config))
  kernel = device_lib.kernel(
      body,
      kernel_name="grouped_gemm_wgrad",
      out_type=jax.ShapeDtypeStruct((g, k_out, n_out), out_dtype),
      grid=(device_lib.num_sms(config.num_sms),),
      grid_names=("sm",),
      num_threads=_NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=resolve_interpret(interpret),
  )
  return kernel(wgrad_bounds(group_sizes, m), lhs, dout)


# ----------------------------------------------------------------------------
# Public kernels (padding + launch)
# ----------------------------------------------------------------------------


def _padded_rows(m: int, config: KernelConfig, wgrad: bool = False) -> int:
  rows = _round_up(m, config.block_m)
  if wgrad:
    rows = _round_up(rows, config.block_k)
  return rows


def gmm(lhs, rhs, group_sizes, *, out_dtype=None, config: KernelConfig = KernelConfig(),
        interpret=None):
  """Forward: out[rows of g] = lhs[rows of g] @ rhs[g]. lhs [M, K], rhs [G, K, N].

  Returns [M, N] in `out_dtype` (default lhs.dtype), float32 accumulation; dead
  rows (past sum(group_sizes)) are zero.
  """
  m, k = lhs.shape
  g, k2, n = rhs.shape
  if k != k2:
    raise ValueError(f"lhs.shape={lhs.shape} and rhs.shape={rhs.shape}: K differs")
  if group_sizes.shape != (g,):
    raise ValueError(f"group_sizes.shape={group_sizes.shape} must be ({g},)")
  k_p = _round_up(k, config.block_k)
  n_p = _round_up(n, _NUM_COMPUTE_WGS * config.block_n)
  m_p = _padded_rows(m, config)
  lhs_p = _pad_axis(_pad_axis(lhs, 1, k_p), 0, m_p)
  rhs_p = _pad_axis(_pad_axis(rhs, 1, k_p), 2, n_p)
  (out,) = _row_tiled_call([lhs_p], [rhs_p], group_sizes, mode="plain", transpose_b=False,
                           out_dtype=out_dtype or lhs.dtype, save_hu=False, config=config,
                           interpret=interpret)
  return out[:m, :n] if (m_p, n_p) != (m, n) else out


def gmm_dgrad(dout, rhs, group_sizes, *, out_dtype=None, config: KernelConfig = KernelConfig(),
              interpret=None):
  """Dgrad: dlhs[rows of g] = dout[rows of g] @ rhs[g]^T. dout [M, N], rhs [G, K, N] -> [M, K].

  rhs is read through a transposed SMEM view (no transposed copy). Dead rows are zero.
  """
  m, n = dout.shape
  g, k, n2 = rhs.shape
  if n != n2:
    raise ValueError(f"dout.shape={dout.shape} and rhs.shape={rhs.shape}: N differs")
  n_p = _round_up(n, config.block_k)
  k_p = _round_up(k, _NUM_COMPUTE_WGS * config.block_n)
  m_p = _padded_rows(m, config)
  dout_p = _pad_axis(_pad_axis(dout, 1, n_p), 0, m_p)
  rhs_p = _pad_axis(_pad_axis(rhs, 2, n_p), 1, k_p)
  (out,) = _row_tiled_call([dout_p], [rhs_p], group_sizes, mode="plain", transpose_b=True,
                           out_dtype=out_dtype or dout.dtype, save_hu=False, config=config,
                           interpret=interpret)
  return out[:m, :k] if (m_p, k_p) != (m, k) else out


def gmm_wgrad(lhs, dout, group_sizes, *, out_dtype=None, config: KernelConfig = KernelConfig(),
              interpret=None):
  """Wgrad: drhs[g] = lhs[rows of g]^T @ dout[rows of g]. lhs [M, K], dout [M, N] -> [G, K, N].

  Empty groups give zeros. The sum over a group's rows runs sequentially over
  its block_k row blocks (fixed order, one CTA per output tile, no atomics).
  dout rows sharing a block_k row block with the group must be finite.
  """
  m, k = lhs.shape
  m2, n = dout.shape
  if m != m2:
    raise ValueError(f"lhs.shape={lhs.shape} and dout.shape={dout.shape}: M differs")
  k_p = _round_up(k, _NUM_COMPUTE_WGS * config.block_m)
  n_p = _round_up(n, config.block_n)
  m_p = _padded_rows(m, config, wgrad=True)
  lhs_p = _pad_axis(_pad_axis(lhs, 1, k_p), 0, m_p)
  dout_p = _pad_axis(_pad_axis(dout, 1, n_p), 0, m_p)
  out = _wgrad_call(lhs_p, dout_p, group_sizes, out_dtype=out_dtype or lhs.dtype, config=config,
                    interpret=interpret)
  return out[:, :k, :n] if (k_p, n_p) != (k, n) else out


# ----------------------------------------------------------------------------
# Differentiable wrappers
# ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _grouped_matmul_fn(config: KernelConfig, interpret):
  kw = dict(config=config, interpret=interpret)

  @jax.custom_vjp
  def f(lhs, rhs, group_sizes):
    return gmm(lhs, rhs, group_sizes, **kw)

  def fwd(lhs, rhs, group_sizes):
    return gmm(lhs, rhs, group_sizes, **kw), (lhs, rhs, group_sizes)

  def bwd(res, dout):
    lhs, rhs, group_sizes = res
    dout = dout.astype(lhs.dtype)
    dlhs = gmm_dgrad(dout, rhs, group_sizes, out_dtype=lhs.dtype, **kw)
    drhs = gmm_wgrad(lhs, dout, group_sizes, out_dtype=rhs.dtype, **kw)
    return dlhs, drhs, None

  f.defvjp(fwd, bwd)
  return f


def grouped_matmul(lhs, rhs, group_sizes, *, config: KernelConfig = KernelConfig(),
                   interpret=None):
  """Differentiable grouped matmul: out[rows of g] = lhs[rows of g] @ rhs[g].

  lhs [M, K], rhs [G, K, N], group_sizes [G] int32 (no gradient) -> [M, N] in
  lhs.dtype (float32 accumulation). Rows past sum(group_sizes) come back zero;
  their cotangents do not reach dlhs or drhs (they must be finite: wgrad
  multiplies them by exact zeros). Gradients: dlhs by the dgrad kernel, drhs by the
  wgrad kernel (empty groups -> zero gradient).
  """
  return _grouped_matmul_fn(config, resolve_interpret(interpret))(lhs, rhs, group_sizes)


def _swiglu_padded_f(f: int, config: KernelConfig) -> int:
  """F padded to every tile it meets: an output dim of the gate/up kernel (CTA tile
  block_n), of the da dgrad (2 block_n) and of the dw_down wgrad (2 block_m); a
  contraction dim (block_k); [dh | du]'s 2F is the dx contraction and the dw_gate_up
  wgrad's N, both multiples of these."""
  return _round_up(f, math.lcm(2 * config.block_n, 2 * config.block_m, config.block_k))


def _pad_gate_up(w_gate_up, f_p: int):
  """[G, H, 2F] -> [G, H, 2 f_p]: each half padded with zero columns (no copy when
  F = f_p, the case of every benchmark shape). Zero columns give h = u = 0, so
  a = silu(0) * 0 = 0 there, and the zero rows of w_down add nothing: the FFN is
  exact in the padded space."""
  g, h, two_f = w_gate_up.shape
  f = two_f // 2
  if f == f_p:
    return w_gate_up
  halves = _pad_axis(w_gate_up.reshape(g, h, 2, f), 3, f_p)
  return halves.reshape(g, h, 2 * f_p)


def _unpad_gate_up(w, f: int):
  """The inverse of `_pad_gate_up` on a [G, H, 2 f_p] gradient."""
  g, h, two_fp = w.shape
  f_p = two_fp // 2
  if f == f_p:
    return w
  return w.reshape(g, h, 2, f_p)[..., :f].reshape(g, h, 2 * f)


def _swiglu_forward(x, w_gate_up, w_down, group_sizes, config, interpret, save: bool,
                    zero_window=None):
  m, h_dim = x.shape
  x_p = _pad_axis(x, 0, _padded_rows(m, config))
  outs = gate_up_projection(x_p, w_gate_up, group_sizes, config=config, interpret=interpret,
                            save_hu=save, zero_window=zero_window)
  y = down_projection(outs[0], w_down, group_sizes, config=config, interpret=interpret,
                      zero_window=zero_window)
  y = y[:m, :h_dim] if y.shape != (m, h_dim) else y
  return y, outs


def gate_up_projection(x, w_gate_up, group_sizes, *, config: KernelConfig, interpret=None,
                       save_hu: bool = True, zero_window: Optional[int] = None):
  """The "swiglu" launch: h = x @ w_gate[g], u = x @ w_up[g], a = silu(h) * u for x
  [m_p, H] (rows already a multiple of block_m), w_gate_up [G, H, 2F] = [w_gate | w_up]
  read twice at column offsets 0 and F_p (no copy). Returns (a,) or (a, h, u) with
  save_hu, each [m_p, F_p]."""
  h_p = _round_up(x.shape[1], config.block_k)
  f_p = _swiglu_padded_f(w_gate_up.shape[2] // 2, config)
  wgu_p = _pad_axis(_pad_gate_up(w_gate_up, f_p), 1, h_p)
  return _row_tiled_call([_pad_axis(x, 1, h_p)], [wgu_p, wgu_p], group_sizes, mode="swiglu",
                         transpose_b=False, out_dtype=x.dtype, save_hu=save_hu, config=config,
                         interpret=resolve_interpret(interpret), zero_window=zero_window,
                         b_col_offsets=(0, f_p))


def down_projection(a, w_down, group_sizes, *, config: KernelConfig, interpret=None,
                    zero_window: Optional[int] = None):
  """y = a @ w_down[g] for a [m_p, F_p] (the gate/up launch's output), w_down [G, F, H]:
  [m_p, H padded to the CTA tile width]."""
  h_out = _round_up(w_down.shape[2], _NUM_COMPUTE_WGS * config.block_n)
  wd_p = _pad_axis(_pad_axis(w_down, 1, a.shape[1]), 2, h_out)
  (y,) = _row_tiled_call([a], [wd_p], group_sizes, mode="plain", transpose_b=False,
                         out_dtype=a.dtype, save_hu=False, config=config,
                         interpret=resolve_interpret(interpret), zero_window=zero_window)
  return y


def swiglu_forward(x, w_gate_up, w_down, group_sizes, *, config: KernelConfig, interpret=None,
                   zero_window: Optional[int] = None):
  """The forward pass of `grouped_swiglu_ffn` with its residuals: (y, (a, h, u)), the
  inputs of `swiglu_backward`."""
  return _swiglu_forward(x, w_gate_up, w_down, group_sizes, config, resolve_interpret(interpret),
                         save=True, zero_window=zero_window)


def swiglu_backward(x, w_gate_up, w_down, group_sizes, a, h, u, dy, *, config: KernelConfig,
                    interpret=None, zero_window: Optional[int] = None, wgrad_dtype=None):
  """The backward pass of `grouped_swiglu_ffn` (formulas in its docstring) from its
  saved residuals a, h, u ([m_p, F_p], the gate/up epilogue's outputs). Returns
  (dx [M, H], dw_gate_up [G, H, 2F], dw_down), the weight gradients in `wgrad_dtype`
  (default: the weights' own; float32 keeps the accumulators unrounded, for sums of
  several groups' gradients)."""
  dhu = swiglu_dhu(x, w_down, group_sizes, h, u, dy, config=config, interpret=interpret,
                   zero_window=zero_window)
  return swiglu_backward_from_dhu(x, w_gate_up, w_down, group_sizes, a, dy, dhu, config=config,
                                  interpret=interpret, zero_window=zero_window,
                                  wgrad_dtype=wgrad_dtype)


def swiglu_dhu(x, w_down, group_sizes, h, u, dy, *, config: KernelConfig, interpret=None,
               zero_window: Optional[int] = None):
  """The first half of `swiglu_backward`: da = dy @ w_down^T and, in the da launch's
  epilogue (mode "dswiglu", da never stored), the SwiGLU derivative [dh | du]
  ([m_p, 2 F_p] in x's dtype; h, u [m_p, F_p] the forward's residuals)."""
  interpret = resolve_interpret(interpret)
  h_dim = x.shape[1]
  kw = dict(config=config, interpret=interpret)
  f_p = _swiglu_padded_f(w_down.shape[1], config)
  wd_p = _pad_axis(w_down, 1, f_p)
  m_p = h.shape[0]
  h_k = _round_up(h_dim, config.block_k)  # H as a contraction dim
  dy_p = _pad_axis(_pad_axis(dy.astype(x.dtype), 1, h_k), 0, m_p)
  # da = dy @ w_down^T (f32 accumulator) and, in its epilogue, [dh | du]: [m_p, 2 f_p]
  (dhu,) = _row_tiled_call([dy_p], [_pad_axis(wd_p, 2, h_k)], group_sizes, mode="dswiglu",
                           transpose_b=True, out_dtype=x.dtype, save_hu=False,
                           zero_window=zero_window, epi_inputs=(h, u), **kw)
  return dhu


def swiglu_backward_from_dhu(x, w_gate_up, w_down, group_sizes, a, dy, dhu, *,
                             config: KernelConfig, interpret=None,
                             zero_window: Optional[int] = None, wgrad_dtype=None):
  """The rest of `swiglu_backward` once [dh | du] ([m_p, 2 F_p], its "dswiglu" launch's
  output) is known: dx and the two weight gradients."""
  kw = dict(config=config, interpret=interpret)
  dx = swiglu_dx_from_dhu(x, w_gate_up, group_sizes, dhu, zero_window=zero_window, **kw)
  m_p = a.shape[0]
  # [dw_gate | dw_up] = x^T [dh | du]: one wgrad over N = 2 f_p
  dw_gate_up = _unpad_gate_up(gmm_wgrad(_pad_axis(x, 0, m_p), dhu, group_sizes,
                                        out_dtype=wgrad_dtype or w_gate_up.dtype, **kw),
                              w_down.shape[1])
  return dx, dw_gate_up, swiglu_dw_down(a, dy, w_down, group_sizes, out_dtype=wgrad_dtype, **kw)


def swiglu_dx_from_dhu(x, w_gate_up, group_sizes, dhu, *, config: KernelConfig, interpret=None,
                       zero_window: Optional[int] = None):
  """dx = [dh | du] @ w_gate_up^T ([m_p, 2 F_p] @ [2 F_p, H]): one plain dgrad launch;
  returns [M, H] for x [M, H]."""
  interpret = resolve_interpret(interpret)
  m, h_dim = x.shape
  f_p = _swiglu_padded_f(w_gate_up.shape[2] // 2, config)
  wgu_p = _pad_gate_up(w_gate_up, f_p)
  h_out = _round_up(h_dim, _NUM_COMPUTE_WGS * config.block_n)  # H as an output dim
  (dx,) = _row_tiled_call([dhu], [_pad_axis(wgu_p, 1, h_out)], group_sizes, mode="plain",
                          transpose_b=True, out_dtype=x.dtype, save_hu=False,
                          zero_window=zero_window, config=config, interpret=interpret)
  return dx[:m, :h_dim]


def swiglu_dw_down(a, dy, w_down, group_sizes, *, config: KernelConfig, interpret=None,
                   out_dtype=None):
  """dw_down = a^T dy for a [m_p, F_p] (the gate/up launch's output) and dy [<= m_p, H],
  in `out_dtype` (default: w_down's)."""
  return gmm_wgrad(a, _pad_axis(dy.astype(a.dtype), 0, a.shape[0]), group_sizes,
                   out_dtype=out_dtype or w_down.dtype, config=config,
                   interpret=resolve_interpret(interpret))[:, :w_down.shape[1], :]


def unpad_dw_gate_up(dw, ffn: int):
  """[G, H, 2 F_p] ([dw_gate | dw_up], F padded as the gate/up launch pads it) -> [G, H, 2F]."""
  return _unpad_gate_up(dw, ffn)


@functools.lru_cache(maxsize=None)
def _swiglu_fn(config: KernelConfig, interpret, zero_dead_rows: bool):
  # the wgrad reads up to block_k rows past a group's end: those stay zero
  zw = None if zero_dead_rows else config.block_k

  @jax.custom_vjp
  def f(x, w_gate_up, w_down, group_sizes):
    y, _ = _swiglu_forward(x, w_gate_up, w_down, group_sizes, config, interpret, save=False,
                           zero_window=zw)
    return y

  def fwd(x, w_gate_up, w_down, group_sizes):
    y, (a, h, u) = _swiglu_forward(x, w_gate_up, w_down, group_sizes, config, interpret,
                                   save=True, zero_window=zw)
    return y, (x, w_gate_up, w_down, group_sizes, a, h, u)

  def bwd(res, dy):
    x, w_gate_up, w_down, group_sizes, a, h, u = res
    return swiglu_backward(x, w_gate_up, w_down, group_sizes, a, h, u, dy, config=config,
                           interpret=interpret, zero_window=zw) + (None,)

  f.defvjp(fwd, bwd)
  return f


def grouped_swiglu_ffn(x, w_gate_up, w_down, group_sizes, *,
                       config: KernelConfig = KernelConfig(), interpret=None,
                       zero_dead_rows: bool = True):
  """SwiGLU expert FFN over grouped rows, differentiable (custom_vjp).

  x [M, H], w_gate_up [G, H, 2F] = [w_gate | w_up], w_down [G, F, H], group_sizes [G]
  -> y [M, H]:
    h = x @ w_gate[g], u = x @ w_up[g]      (one kernel, two f32 accumulators)
    a = (silu(h) * u) in f32, cast to x.dtype
    y = a @ w_down[g] (f32 accumulation), cast to x.dtype.
  Rows past sum(group_sizes) come back zero; with zero_dead_rows=False only the
  first ones, up to round_up(sum(group_sizes), block_k), do (also in dx), and the
  later rows of y and dx are undefined, never written: the MoE layer's receive
  buffer is sized for the worst case (R*T*K rows, ~1/R of them live), and every
  kernel then skips its dead tiles instead of storing zeros (docs/performance.md).
  The backward needs the cotangent dy finite in that
  window (the wgrad multiplies it by zeros). F need not be a multiple of 64.

  Saved for the backward pass: a, h, u (x.dtype, written by the gate/up
  epilogue; no recompute of the gate/up GEMMs). Backward (dh, du are cast to
  x.dtype before the GEMMs that consume them; h and u are the saved x.dtype values):
    da = dy @ w_down^T (f32);  s = sigmoid(h)
    dh = da * u * s * (1 + h (1 - s)),  du = da * h * s   (in da's epilogue, mode
        "dswiglu": da never stored), into one buffer [dh | du]
    dx = [dh | du] @ w_gate_up^T (one plain kernel over K = 2F)
    dw_gate_up = x^T [dh | du] (one wgrad over N = 2F), dw_down = a^T dy.
  """
  two_f = w_gate_up.shape[-1]
  if w_gate_up.ndim != 3 or two_f % 2 or w_down.ndim != 3 or w_down.shape[1] != two_f // 2:
    raise ValueError(f"w_gate_up {w_gate_up.shape} must be [G, H, 2F] and w_down "
                     f"{w_down.shape} [G, F, H]")
  return _swiglu_fn(config, resolve_interpret(interpret), zero_dead_rows)(
      x, w_gate_up, w_down, group_sizes)


# ----------------------------------------------------------------------------
# Pure-JAX references (the test oracle)
# ----------------------------------------------------------------------------


def _dead_row_mask(m: int, group_sizes):
  total = jnp.sum(group_sizes.astype(jnp.int32))
  return (jnp.arange(m) < total)[:, None]


def reference_gmm(lhs, rhs, group_sizes, out_dtype=None):
  """lax.ragged_dot with f32 accumulation; dead rows zero."""
  out = lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                       preferred_element_type=jnp.float32)
  out = jnp.where(_dead_row_mask(lhs.shape[0], group_sizes), out, 0.0)
  return out.astype(out_dtype or lhs.dtype)


def reference_gmm_dgrad(dout, rhs, group_sizes, out_dtype=None):
  return reference_gmm(dout, jnp.swapaxes(rhs, 1, 2), group_sizes, out_dtype)


def reference_gmm_wgrad(lhs, dout, group_sizes, out_dtype=None):
  """drhs[g] = lhs[rows g]^T dout[rows g] via ragged_dot_general (f32 accumulation)."""
  dims = lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())),
      lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[],
  )
  mask = _dead_row_mask(lhs.shape[0], group_sizes)
  lhs = jnp.where(mask, lhs, 0)
  out = lax.ragged_dot_general(lhs, dout, group_sizes.astype(jnp.int32), dims,
                               preferred_element_type=jnp.float32)
  return out.astype(out_dtype or lhs.dtype)


def reference_swiglu_ffn(x, w_gate_up, w_down, group_sizes):
  """The FFN with lax.ragged_dot (f32 accumulation, same casts as the kernel)."""
  gs = group_sizes.astype(jnp.int32)
  w_gate, w_up = split_gate_up(w_gate_up)
  h = lax.ragged_dot(x, w_gate, gs, preferred_element_type=jnp.float32)
  u = lax.ragged_dot(x, w_up, gs, preferred_element_type=jnp.float32)
  a = (jax.nn.silu(h) * u).astype(x.dtype)
  y = lax.ragged_dot(a, w_down, gs, preferred_element_type=jnp.float32)
  y = jnp.where(_dead_row_mask(x.shape[0], group_sizes), y, 0.0)
  return y.astype(x.dtype)
