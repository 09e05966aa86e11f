"""Rows gathered by index into consecutive output rows, live rows only (one GPU).

The owner-side half of token de-duplication (`uniep_jax/dedup.py`): a source
sends each token once per destination rank; the owner copies it to every receive
layout row of its experts that the token selected. XLA's gather would write the
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
the padded weights, 128-byte rows; read as SMEM
scalars: with scalar GMEM loads in the row loop it took 1.58x the plain copy's time in
the layer, with this 1.01x alone; NOTES_row_gather.md v5).

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

The fold: `fold_live_rows` (EXPERIMENTAL; built for the owner-side pre-reduction of the
returns, pallas_kernels/NOTES_fused.md, "The next lever"; v4, NOTES_row_gather.md)
------------------------------------------------------------------------------
  out[n] = dtype(acc_n), acc_n = t_0, then acc_n = acc_n + t_j for j = 1 .. count[n] - 1,
  t_j = f32(scale[n, j]) * f32(src[index[n, j]])  (t_j = f32(src[index[n, j]]) unscaled),
  for n < live: up to J (`fold`) rows per output row, summed in float32 in j order,
  rounded once. The same ops in the same order as `fold_rows_reference` (XLA): equal bit
  for bit in the CPU interpret mode; on a GPU only if neither compiler contracts the
  multiply and the add into an FMA differently (v3 on an H200: they differ by an ulp).
Tiling (v4, tiles over slot positions): the live rows' terms are laid out consecutively
(XLA, `fold_tiles`: offsets = the exclusive cumsum of the clipped counts; position
offsets[n] + j holds row n's term j). Tile t is S (`slots_per_tile`) positions, [t*S,
(t+1)*S), and OWNS the output rows whose first term lies in it (first_row[t] ..
first_row[t+1] - 1, at most S rows); it loads their terms, positions offsets[first_row[t]]
.. offsets[first_row[t+1]] - 1: at most S + J - 1 row loads (the last owned row may
reach J - 1 past the tile). So a tile's loads follow the live terms (~S per tile), not
S x J slots, and S need not cover a worst-case row count. x one column block, as the
gather; tiles numbered position tile major, column block minor, dealt round robin.
  GMEM src rows (by the position table) --<= S+J-1 TMA loads--> SMEM stage [S+J-1, nb, ct]
        --fold in registers, row r of the tile written over position r-->
        --TMA store ladder of the owned rows--> GMEM out rows first_row[t] ..
Writing row r over position r is safe: r <= the row's first position (each earlier row
has at least one term), so only terms already folded are overwritten.
SMEM: 2 stages of [S + J - 1, nb, ct]. Barrier: num_arrivals = S + J - 1 per stage; each
unused position arrives without a load (`barrier_arrive`). (The offsets and weights read
as SMEM scalars, as the weighted copy reads its weights, faulted on an H100 with an
illegal instruction: NOTES_row_gather.md v5; the fold reads them from GMEM.)
Synchronisation: the gather's (`load_barrier` per stage, `two_stage_copy_loop`'s stage
reuse, `commit_smem()` after the in-place rewrite, `wait_smem_to_gmem(0)` at the end).
No atomics; each output row is one CTA's fold in a fixed order.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import device as device_lib
from pallas_kernels.grouped_gemm import _SMEM_RESERVE
from pallas_kernels.tma import ladder_store, load_rows_by_index, two_stage_copy_loop
from uniep_jax.ragged import SEARCH_METHOD

ROWS_PER_TILE = 16
# Two stages per CTA must fit with room to spare (Hopper: 227 KiB per block).
STAGE_BUDGET_BYTES = 160 * 1024


def stage_budget(stages: int, smem: int) -> int:
  """The SMEM budget of `stages` copy stages: STAGE_BUDGET_BYTES per two, within the
  block's `smem` less the barriers' reserve (the copy CTAs of transfer_expand and Kernel
  D, `TransferConfig.copy_stages` / `FusedConfig.overlap_copy_stages`)."""
  return min(STAGE_BUDGET_BYTES * stages // 2, smem - _SMEM_RESERVE)


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
  multiply and one rounding (the plain combine's backward per slot, `dedup._scale_rows`),
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


def _fold_body(meta_gmem, first_row_gmem, offsets_gmem, slot_src_gmem, src_gmem, *refs,
               slots_per_tile: int, n_blocks: int, num_ctas: int, scaled: bool):
  scale_gmem, (out_gmem, stage_smem, load_barrier) = (
      (refs[0], refs[1:]) if scaled else (None, refs))
  tile_slots, q_max = slots_per_tile, stage_smem.shape[1]    # stage [2, S + J - 1, nb, ct]
  nb = stage_smem.shape[2]
  steps, tile_at = _round_robin(pl.cdiv(meta_gmem[0], tile_slots) * n_blocks,  # live terms
                                 num_ctas)

  def tile_of(s):
    """(first owned row, end of the owned rows, first position, first box) of step s."""
    tile = tile_at(s)
    t = tile // n_blocks
    n0, n1 = first_row_gmem[t], first_row_gmem[t + 1]
    return n0, n1, offsets_gmem[n0], (tile % n_blocks) * nb

  def load(s, stage):
    n0, n1, p0, b0 = tile_of(s)
    length = offsets_gmem[n1] - p0
    for q in range(q_max):
      @pl.when(q < length)
      def _(q=q):
        row = slot_src_gmem[p0 + q]
        plgpu.copy_gmem_to_smem(src_gmem.at[pl.ds(row, 1), pl.ds(b0, nb)],
                                stage_smem.at[stage, pl.ds(q, 1)], load_barrier.at[stage])
      # position q unused: a plain arrival keeps the barrier's count at S + J - 1
      plgpu.barrier_arrive(load_barrier.at[stage], predicate=q >= length)

  def store(s, stage):
    n0, n1, p0, b0 = tile_of(s)

    def term(q):
      t = stage_smem[stage, q].astype(jnp.float32)
      return t * scale_gmem[p0 + q] if scaled else t

    def fold_row(r, carry):
      first = offsets_gmem[n0 + r] - p0
      end = offsets_gmem[n0 + r + 1] - p0
      acc = lax.fori_loop(first + 1, end, lambda q, a: a + term(q), term(first))
      stage_smem[stage, r] = acc.astype(stage_smem.dtype)
      return carry

    lax.fori_loop(0, n1 - n0, fold_row, 0)
    plgpu.commit_smem()
    ladder_store(stage_smem.at[stage], out_gmem.at[:, pl.ds(b0, nb)], 0, n0, n1 - n0,
                 tile_slots)

  two_stage_copy_loop(steps, load, store, load_barrier)
  plgpu.wait_smem_to_gmem(0)


FOLD_SLOTS_PER_TILE = 8   # the fastest of 8, 16, 32, 64 on an H100 (NOTES_row_gather.md v4)


def fold_tiles(count, live, *, fold: int, slots_per_tile: int):
  """The fold's tables (XLA, int32; module docstring, "The fold"), for count [N]:
  offsets [N + 1]: row n's terms at positions [offsets[n], offsets[n + 1]) (counts
  clipped to [1, J] below `live`, 0 from it); first_row [cdiv(N * J, S) + 1]: the first
  row whose first term is at a position >= t * S (at most `live`)."""
  n = count.shape[0]
  live = jnp.minimum(jnp.asarray(live, jnp.int32), n)
  terms = jnp.where(jnp.arange(n) < live, jnp.clip(count.astype(jnp.int32), 1, fold), 0)
  offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(terms, dtype=jnp.int32)])
  starts = jnp.arange(pl.cdiv(n * fold, slots_per_tile) + 1, dtype=jnp.int32) * slots_per_tile
  first_row = jnp.minimum(jnp.searchsorted(offsets[:n], starts, side="left",
                                           method=SEARCH_METHOD).astype(jnp.int32),
                          live)
  return offsets, first_row


def fold_live_rows(src, index, count, live, *, out_rows: int, scale=None,
                   slots_per_tile: int = FOLD_SLOTS_PER_TILE, num_ctas: int | None = None,
                   stage_budget_bytes: int = STAGE_BUDGET_BYTES, interpret=None):
  """out[n] = dtype(sum over j < count[n], in j order, in float32, of
  f32(scale[n, j]) * f32(src[index[n, j]])) for n < live (module docstring, "The
  fold"); a new [out_rows, H] buffer whose rows >= live are undefined.
  src [Ns, H]; index [N, J] int32 (N <= out_rows), index[n, j] in [0, Ns) for
  j < count[n] (later entries are not read); count [N] int32, clipped to [1, J];
  live: int32 scalar (traced is fine), <= N; scale [N, J] float32 or None (no multiply).
  slots_per_tile: S, the terms a tile owns rows by (a power of two <= 256).
  Bits: `fold_rows_reference`'s in the CPU interpret mode; on a GPU the two compilers may
  contract a multiply and an add into an FMA differently (NOTES_row_gather.md v3)."""
  ns, hidden = src.shape
  if index.ndim != 2 or index.shape[0] > out_rows:
    raise ValueError(f"index must be [N, J] with N <= out_rows={out_rows}, got shape "
                     f"{index.shape}")
  n, fold = index.shape
  if count.shape != (n,):
    raise ValueError(f"count must be [{n}] like index's rows, got shape {count.shape}")
  if scale is not None and (scale.shape != (n, fold) or scale.dtype != jnp.float32):
    raise ValueError(f"scale must be float32 [{n}, {fold}] like index, got {scale.dtype} "
                     f"{scale.shape}")
  if slots_per_tile < 1 or slots_per_tile > 256 or slots_per_tile & (slots_per_tile - 1):
    raise ValueError(f"slots_per_tile={slots_per_tile} must be a power of two in [1, 256] "
                     f"(a tile owns up to that many rows: the store ladder's largest box)")
  itemsize = jnp.dtype(src.dtype).itemsize
  stage_rows = slots_per_tile + fold - 1
  ct, nb = column_blocking(hidden, itemsize, stage_rows,
                           min(stage_budget_bytes, device_lib.smem_capacity()))
  boxes = hidden // ct
  num_ctas = device_lib.num_sms(num_ctas)
  offsets, first_row = fold_tiles(count, live, fold=fold, slots_per_tile=slots_per_tile)
  # each live term's source row (and weight) at its position; unused entries are dropped
  j = jnp.arange(fold, dtype=jnp.int32)
  # (an unused entry goes to its own index past the table and is dropped: the indices
  # stay unique, as the scatters promise)
  unused = n * fold + jnp.arange(n * fold, dtype=jnp.int32).reshape(n, fold)
  position = jnp.where(offsets[:-1, None] + j < offsets[1:, None], offsets[:-1, None] + j,
                       unused).reshape(-1)

  def at_positions(values, dtype):   # [N, J] -> each live term's value at its position
    return jnp.zeros((n * fold,), dtype).at[position].set(
        values.astype(dtype).reshape(-1), mode="drop", unique_indices=True)

  slot_src = at_positions(index, jnp.int32)
  if interpret is None:
    interpret = device_lib.default_interpret()
  body = functools.partial(_fold_body, slots_per_tile=slots_per_tile, n_blocks=boxes // nb,
                           num_ctas=num_ctas, scaled=scale is not None)
  kernel = plgpu.kernel(
      body,
      kernel_name="fold_live_rows" + ("_scaled" if scale is not None else ""),
      out_type=jax.ShapeDtypeStruct((out_rows, boxes, ct), src.dtype),
      scratch_types=[plgpu.SMEM((2, stage_rows, nb, ct), src.dtype),
                     plgpu.Barrier(num_arrivals=stage_rows, num_barriers=2)],
      grid=(num_ctas,),
      grid_names=("cta",),
      interpret=interpret,
  )
  operands = (offsets[n:n + 1], first_row, offsets, slot_src, src.reshape(ns, boxes, ct))
  if scale is not None:
    operands += (at_positions(scale, jnp.float32),)
  return kernel(*operands).reshape(out_rows, hidden)


def _metadata_box(entries: int) -> int:
  """4-byte entries per TMA box of per-tile metadata (the weighted copy's weights): a
  multiple of 32, so that each stage's row of the SMEM buffer starts 128-byte aligned (a
  TMA destination must; a [2, 16] float32 buffer's second row at byte 64 faulted on an
  H100)."""
  return pl.cdiv(entries, 32) * 32


def fold_rows_reference(src, index, count, scale=None):
  """`fold_live_rows`' arithmetic in XLA, for every row (no `live`; count clipped to
  [1, J] likewise): the test oracle and the form the XLA backends would use."""
  count = jnp.clip(count, 1, index.shape[1])

  def term(j):
    t = jnp.take(src, index[:, j], axis=0, mode="clip").astype(jnp.float32)
    return t if scale is None else t * scale[:, j, None]
  acc = term(0)
  for j in range(1, index.shape[1]):
    acc = jnp.where((j < count)[:, None], acc + term(j), acc)
  return acc.astype(src.dtype)


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
  scaled = scale is not None
  body = functools.partial(_gather_body, rows_per_tile=rows_per_tile, n_blocks=boxes // nb,
                           num_ctas=num_ctas, scaled=scaled)
  kernel = plgpu.kernel(
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
