"""Rows gathered by index into consecutive output rows, live rows only (one GPU).

The owner-side half of token de-duplication (`uniep_jax/transport.send_unique`, plan
`uniep_jax/layout.DedupPlan`): a source sends each token once per destination rank; the
owner copies it to every receive layout row of its experts that the token selected. XLA's gather would write the
whole worst-case receive layout (R*T*K rows, 2 GiB at qwen3-like); this kernel
writes only rows [0, live), `live` read from memory, so its cost follows the live
rows.

Problem
-------
  src    [Ns, H]   rows to read (the unique receive buffer)
  index  [N] int32 out row p <- src row index[p], for p < live (index[p] in [0, Ns))
  live   int32     rows to write (a device value, <= N)
  scale  [N] f32   optional: out row p <- dtype(scale[p] * f32(src row)), one multiply
                   and one rounding per element, the arithmetic of XLA's
                   `(w * dy.astype(f32)).astype(dtype)` (the backward's weighted dy rows)
  out    [out_rows, H], out_rows >= N; rows >= live are left untouched (undefined)

Tiling
------
Rows are viewed as 3-D, [N, H / ct, ct] with ct <= 256 (the TMA box limit per
dimension), so that one TMA box moves a whole row's column block. A tile is G
consecutive output rows (`rows_per_tile`) x one column block of nb * ct columns
(nb * ct = H unless two stages of a whole row would not fit in shared memory:
then the widest divisor of H / ct that fits). Tiles are numbered row tile major,
column block minor, and dealt round robin: CTA c takes tiles c, c + num_ctas, ...

  GMEM src row index[p] --G TMA loads of [1, nb, ct]--> SMEM stage [G, nb, ct]
        [scale: each row through registers, f32 multiply, rounded, back in place]
        --TMA store ladder (one box per set bit of the tile's live rows)--> GMEM out

Buffers
-------
SMEM: 2 stages of [G, nb, ct] in the src dtype, no swizzle (a store may start at
any row). Default bf16, G = 16, H = 2048: 2 x 64 KiB. scale: 2 stages of
[_metadata_box(G)] float32 (>= G, a multiple of 32), the tile's weights (one TMA box of
the padded weights, 128-byte rows; read as SMEM scalars: with scalar GMEM loads in the
row loop the weighted copy takes 1.58x the plain copy's time in the layer, with the box
1.01x).

Synchronisation contract (one CTA; CTAs share nothing but disjoint output rows)
------------------------
  load_barrier[s] (num_arrivals = G, + 1 with scale): the G row loads of one tile
      into stage s (and the load of its box of weights) each arrive once with their bytes;
      the CTA waits on it before storing the tile.
      Every load group is waited exactly once (phases alternate per stage).
  scale: the warpgroup rewrites stage s in place after its loads landed (the
      barrier wait) and `commit_smem()` (proxy fence + warpgroup barrier) before the
      store reads it; the stage's previous store finished reading before those loads
      were issued (next point), so the rewrite races with no TMA.
  stage reuse (`tma.two_stage_copy_loop`, shared with ep_transfer.py): before loading
      tile i + 1 into stage 1 - s the CTA waits
      `wait_smem_to_gmem(0, wait_read_only=True)`: the store of tile i - 1 (the
      only one issued from that stage) has finished reading it.
  end: `wait_smem_to_gmem(0)`: every store of the CTA has landed before the kernel
      ends, so the next XLA op reads complete rows.
  No semaphores, no atomics: each output row is written by exactly one store of one
  CTA, with the value of its index; the result does not depend on timing.
Rows of a partial last tile past `live` are loaded (from row index[live - 1]) but
never stored. Runs in the CPU interpret mode.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import device as device_lib
from pallas_kernels.tma import ladder_store, load_rows_by_index, two_stage_copy_loop

ROWS_PER_TILE = 16
# Two stages per CTA must fit with room to spare (Hopper: 227 KiB per block).
STAGE_BUDGET_BYTES = 160 * 1024


# A row (or a column block of one) in a TMA box lands at a multiple of its width in the
# stage buffers: on a GPU the rows must be whole multiples of this many bytes (128 16-bit
# elements). Measured on one H200: rows of 16, 24, 40 and 64 bf16 elements fault
# (misaligned addresses) or fail Mosaic GPU's layout inference in the weighted copy; 128
# run. The interpret mode does not model the alignment.
ROW_ALIGN_BYTES = 256


def rows_fit(hidden: int, itemsize: int) -> bool:
  """Whether rows of `hidden` elements of `itemsize` bytes meet `ROW_ALIGN_BYTES` (the
  live-rows copy and the NVLink transfer run on such rows on a GPU)."""
  return (hidden * itemsize) % ROW_ALIGN_BYTES == 0


def check_rows_fit(hidden: int, itemsize: int, what: str) -> None:
  """ValueError naming the constraint unless `rows_fit`."""
  if not rows_fit(hidden, itemsize):
    raise ValueError(f"{what} moves rows of {hidden} x {itemsize} B; on a GPU a row must be a "
                     f"multiple of {ROW_ALIGN_BYTES} B ({ROW_ALIGN_BYTES // itemsize} elements "
                     f"of {itemsize} B)")


def column_blocking(hidden: int, itemsize: int, rows_per_tile: int,
                    budget: int = STAGE_BUDGET_BYTES, *,
                    max_col_tile: int = 256, stages: int = 2) -> tuple[int, int]:
  """(ct, nb): columns per TMA box and boxes per column block. ct is the widest
  multiple of 8 <= max_col_tile (<= 256, the TMA box limit) dividing `hidden`; nb the
  most boxes (a divisor of hidden / ct) whose `stages` stages (default two) of
  `rows_per_tile` rows fit in `budget` bytes. Shared with ep_transfer.py's gathered loads."""
  ct = next((t for t in range(min(max_col_tile, 256, hidden), 7, -1)
             if hidden % t == 0 and t % 8 == 0), None)
  if ct is None:
    raise ValueError(f"hidden={hidden} has no divisor that is a multiple of 8 and <= "
                     f"{min(max_col_tile, 256)} (the TMA box limit, col_tile)")
  boxes = hidden // ct
  for nb in range(boxes, 0, -1):
    if boxes % nb == 0 and stages * rows_per_tile * nb * ct * itemsize <= budget:
      return ct, nb
  raise ValueError(f"rows_per_tile={rows_per_tile} rows of {ct} columns x {itemsize} B do "
                   f"not fit {stages} times in {budget} B of shared memory; lower "
                   f"rows_per_tile")


def _round_robin(tiles, num_ctas: int):
  """(steps, tile): how many of `tiles` (a device value) this CTA c takes when they are
  dealt round robin (c, c + num_ctas, ...), and tile(s), its step s's."""
  c = lax.axis_index("cta")
  steps = jnp.maximum(tiles - c + num_ctas - 1, 0) // num_ctas
  return steps, lambda s: c + s * num_ctas


def _tile_walk(table_gmem, rows_per_tile: int, n_blocks: int, nb: int, num_ctas: int):
  """(live, steps, tile_of): this CTA's share of the tiles over rows [0, live) (live =
  table_gmem[0]), dealt round robin, and tile_of(s) -> (first output row, first box)
  of its step s."""
  live = table_gmem[0]
  steps, tile_at = _round_robin(pl.cdiv(live, rows_per_tile) * n_blocks, num_ctas)

  def tile_of(s):
    tile = tile_at(s)
    return (tile // n_blocks) * rows_per_tile, (tile % n_blocks) * nb

  return live, steps, tile_of


def scale_stage_rows(stage_smem, stage, rows: int, weight):
  """The weighted copy's multiply, in place before the stores: stage row i <-
  (weight(i) * f32(row)).astype(dtype), weight(i) a float32 scalar (the live-rows gather
  reads it from its SMEM box of weights, the transfer's weighted copies from GMEM), one
  multiply and one rounding (the plain combine's backward per slot, `uniep_jax.combine`),
  then `commit_smem` so the TMA stores see it. The live-rows gather and the transfer's
  weighted copies (`ep_transfer.move_items(scale=...)`) both use it, so their bits agree
  by construction."""
  for i in range(rows):
    row = stage_smem[stage, i]
    stage_smem[stage, i] = (row.astype(jnp.float32) * weight(i)).astype(row.dtype)
  plgpu.commit_smem()


def _gather_body(table_gmem, src_gmem, *refs, rows_per_tile: int, n_blocks: int,
                 num_ctas: int, scaled: bool):
  if scaled:
    scale_gmem, out_gmem, stage_smem, scale_smem, load_barrier = refs
  else:
    out_gmem, stage_smem, load_barrier = refs
  g, nb = rows_per_tile, stage_smem.shape[2]            # index[p] at table_gmem[1 + p]
  live, steps, tile_of = _tile_walk(table_gmem, g, n_blocks, nb, num_ctas)

  def load(s, stage):
    p0, b0 = tile_of(s)
    load_rows_by_index(lambda i: table_gmem[1 + jnp.minimum(p0 + i, live - 1)], src_gmem,
                       stage_smem.at[stage], load_barrier.at[stage], rows=g, col=b0, width=nb)
    if scaled:   # the tile's G weights, one TMA on the same barrier (scale is padded)
      plgpu.copy_gmem_to_smem(scale_gmem.at[pl.ds(p0, scale_smem.shape[1])],
                              scale_smem.at[stage], load_barrier.at[stage])

  def store(s, stage):
    p0, b0 = tile_of(s)
    if scaled:
      scale_stage_rows(stage_smem, stage, g, lambda i: scale_smem[stage, i])
    ladder_store(stage_smem.at[stage], out_gmem.at[:, pl.ds(b0, nb)], 0, p0,
                 jnp.minimum(g, live - p0), g)

  two_stage_copy_loop(steps, load, store, load_barrier)
  plgpu.wait_smem_to_gmem(0)


def _metadata_box(entries: int) -> int:
  """4-byte entries per TMA box of per-tile metadata (the weighted copy's weights): a
  multiple of 32, so that each stage's row of the SMEM buffer starts 128-byte aligned (a
  TMA destination must; a [2, 16] float32 buffer's second row at byte 64 faulted on an
  H100)."""
  return pl.cdiv(entries, 32) * 32


def gather_live_rows(src, index, live, *, out_rows: int, scale=None,
                     rows_per_tile: int = ROWS_PER_TILE, num_ctas: int | None = None,
                     stage_budget_bytes: int = STAGE_BUDGET_BYTES, interpret=None):
  """out[p] = src[index[p]] for p < live; a new [out_rows, H] buffer whose rows
  >= live are undefined. src [Ns, H]; index [N] int32 (N <= out_rows) with
  index[p] in [0, Ns) for p < live; live: int32 scalar (traced is fine), <= N.
  scale [N] float32 (optional): out[p] = (scale[p] * src[index[p]].astype(f32))
  .astype(src.dtype) instead."""
  ns, hidden = src.shape
  n = index.shape[0]
  if index.ndim != 1 or n > out_rows:
    raise ValueError(f"index must be [N] with N <= out_rows={out_rows}, got shape {index.shape}")
  if scale is not None and (scale.shape != (n,) or scale.dtype != jnp.float32):
    raise ValueError(f"scale must be float32 [{n}] like index, got {scale.dtype} {scale.shape}")
  if rows_per_tile < 1 or rows_per_tile > 256 or rows_per_tile & (rows_per_tile - 1):
    raise ValueError(f"rows_per_tile={rows_per_tile} must be a power of two in [1, 256] "
                     f"(the store ladder's largest box)")
  itemsize = jnp.dtype(src.dtype).itemsize
  ct, nb = column_blocking(hidden, itemsize, rows_per_tile,
                           min(stage_budget_bytes, device_lib.smem_capacity()))
  boxes = hidden // ct
  num_ctas = device_lib.num_sms(num_ctas)
  table = jnp.concatenate([jnp.minimum(jnp.asarray(live, jnp.int32), n).reshape(1),
                           index.astype(jnp.int32)])
  if interpret is None:
    interpret = device_lib.default_interpret()
  if interpret is False:
    check_rows_fit(hidden, itemsize, "gather_live_rows")
  scaled = scale is not None
  body = functools.partial(_gather_body, rows_per_tile=rows_per_tile, n_blocks=boxes // nb,
                           num_ctas=num_ctas, scaled=scaled)
  kernel = device_lib.kernel(
      body,
      kernel_name="gather_live_rows" + ("_scaled" if scaled else ""),
      out_type=jax.ShapeDtypeStruct((out_rows, boxes, ct), src.dtype),
      scratch_types=[plgpu.SMEM((2, rows_per_tile, nb, ct), src.dtype)]
                    + ([plgpu.SMEM((2, _metadata_box(rows_per_tile)), jnp.float32)]
                       if scaled else [])
                    + [plgpu.Barrier(num_arrivals=rows_per_tile + scaled, num_barriers=2)],
      grid=(num_ctas,),
      grid_names=("cta",),
      interpret=interpret,
  )
  # the weights padded so that each tile's box of weights lies inside them
  operands = (table, src.reshape(ns, boxes, ct)) + (() if not scaled else (
      jnp.pad(scale, (0, _metadata_box(rows_per_tile))),))
  return kernel(*operands).reshape(out_rows, hidden)
