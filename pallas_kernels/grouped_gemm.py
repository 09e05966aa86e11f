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

plus the SwiGLU expert FFN's gate/up launch, mode "gu": the rhs is
w_gu = `interleave_gate_up(w_gate, w_up)` [G, K, 2F], whose 64-column blocks
alternate gate, up, gate, up (gate block j at columns [128 j, 128 j + 64), up
block j right after it). A plain tile of 128 columns thus holds h and u of the
same 64 F columns in ONE accumulator, and the epilogue writes a = silu(h) * u
(F columns), optionally the accumulator itself as hu (the backward's residual).
Why not two accumulators against w_gate and w_up (v1, modes "swiglu"/"sum2")?
Each then had to be 128 x 64 per warpgroup to fit the registers, and wgmma
m64n64k16 with both operands in SMEM is shared-memory bound: 4 KiB read per
131 kFLOP, about what an SM's SMEM delivers in the MMA's own time, so those
kernels ran at 51-62% of the plain kernel's rate in the MoE layer (H100
profile, NOTES). The backward is plain launches in the same layout: dx = dhu @
w_gu^T (one dgrad over K = 2F) and [dw_gate | dw_up] = x^T dhu (one wgrad whose
epilogue sends the chunks alternately to the two outputs).

All products accumulate in float32 (wgmma); outputs are cast once at the end.

Row-tiled kernel (forward, dgrad, gu)
-------------------------------------
Work list. Before the launch, plain JAX turns `group_sizes` into a static-size
list of T = cdiv(M, block_m) + G row tiles (`_row_tile_plan`). A row tile is the
intersection of one group (or of the dead rows, treated as a pseudo-group
G) with one block_m-aligned row block: fields
  group     which rhs[g] to use,
  load_row  first row of the block_m rows loaded (the block start; M is
            padded to a multiple of block_m, so a load never leaves the array),
  lo, hi    the rows [lo, hi) this tile stores,
  kind      0 none (list padding), 1 compute, 2 zero (dead rows).
There is no Python loop over groups: compile time does not depend on G.

Persistent grid. num_sms CTAs ("sm") walk the linear space T x n_tiles
(n fastest) with `plgpu.nd_loop`; CTA i takes tiles i, i + num_sms, ... Kind-0
tiles are skipped; kind-2 tiles run a pipeline of 0 steps, so their epilogue
stores a zero accumulator (no MMA, no operand loads).

CTA = 3 warpgroups ("wg"): 2 compute warpgroups and 1 memory (TMA) warpgroup
(`emit_pipeline_warp_specialized`). The CTA tile is block_m x (2 * wg_n);
compute warpgroup w owns output columns [w * wg_n, (w + 1) * wg_n), wg_n = block_n
(a multiple of 128 in mode "gu": whole gate/up pairs per warpgroup).

SMEM (bf16, defaults block_m = block_n = 128, block_k = 64, 4 stages):
  per stage  A [block_m, block_k] (16 KiB) and B [block_k, 2 wg_n] (32 KiB),
             128B swizzle: 48 KiB;
  epilogue   [2 warpgroups, block_m, 64] in the output dtype, unswizzled so a
             row range can start anywhere (16 KiB per warpgroup in bf16).
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
               until its previous TMA stores have read the slot; then
               `commit_smem()` (proxy fence) before the TMA store. No barrier is
               shared between warpgroups in the epilogue.
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
over its row blocks in one CTA.

Padding (the cost is a copy of the padded operand, measured in NOTES):
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
from pallas_kernels.tma import ladder_store
from uniep_jax.config import KernelConfig
from uniep_jax.ragged import block_pieces, enumerate_runs

_NONE, _COMPUTE, _ZERO = 0, 1, 2
_EPI_N = 64  # epilogue chunk width (columns)
_NUM_COMPUTE_WGS = 2
_MEMORY_REGISTERS = 40
_SMEM_RESERVE = 1024  # barriers and alignment slack
_PLAN_FIELDS = 5


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

  def stage_bytes(self) -> int:
    return self.in_itemsize * (
        self.num_a * self.block_m * self.a_cols + self.num_b * self.block_k * self.b_cols)

  def epilogue_bytes(self, epi_rows: int) -> int:
    return _NUM_COMPUTE_WGS * epi_rows * _EPI_N * self.out_itemsize

  def stages(self, requested: int, k_iters: int, epi_rows: int, smem: int) -> int:
    fit = (smem - _SMEM_RESERVE - self.epilogue_bytes(epi_rows)) // self.stage_bytes()
    stages = min(requested, max(k_iters, 1), fit)
    if stages < 1:
      raise ValueError(f"tile does not fit in {smem} bytes of shared memory: "
                       f"stage {self.stage_bytes()} B + epilogue {self.epilogue_bytes(epi_rows)} B")
    return int(stages)


def smem_bytes(config: KernelConfig, dtype=jnp.bfloat16, out_dtype=None, mode: str = "plain") -> int:
  """Shared memory of one CTA of the row-tiled kernel for `config` (all stages);
  "plain" and "gu" launches have the same stages and epilogue."""
  out_dtype = out_dtype or dtype
  launch = _Launch(config.block_m, config.block_k, config.block_n, 1, 1, 2 * config.block_n,
                   config.block_k, jnp.dtype(out_dtype).itemsize, jnp.dtype(dtype).itemsize)
  return (config.max_concurrent_steps * launch.stage_bytes()
          + launch.epilogue_bytes(config.block_m) + _SMEM_RESERVE)


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
  ends = jnp.minimum(jnp.cumsum(sizes), m)
  starts = jnp.minimum(ends - sizes, m)
  starts = jnp.maximum(starts, 0)
  return starts, ends


def num_row_tiles(m: int, num_groups: int, block_m: int) -> int:
  """Static length of the row-tile work list: every row block once, plus one
  extra tile per group boundary (G groups + the dead pseudo-group)."""
  return -(-m // block_m) + num_groups


def _row_tile_plan(group_sizes, m: int, block_m: int, zero_window: Optional[int] = None):
  """Flat int32 [5 * T] work list: group, load_row, lo, hi, kind (see module doc).
  zero_window=None: every dead row gets a ZERO tile. zero_window=W: only the dead
  row blocks starting before round_up(sum(group_sizes), W) do; the later ones are
  NONE, so those rows of the outputs are left undefined (not written at all)."""
  g = group_sizes.shape[0]
  starts, ends = _group_bounds(group_sizes, m)
  total = ends[-1]
  starts_x = jnp.concatenate([starts, total[None]])  # [G + 1]; G = dead rows
  ends_x = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
  sizes = ends_x - starts_x
  first, count = block_pieces(starts_x, sizes, block_m)
  gi, piece, valid = enumerate_runs(count, num_row_tiles(m, g, block_m))   # gi in [0, G]
  row0 = (first[gi] + piece) * block_m
  lo = jnp.maximum(starts_x[gi], row0)
  hi = jnp.minimum(ends_x[gi], row0 + block_m)
  load_row = row0  # m is a multiple of block_m (the wrapper pads), so loads stay inside
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


def _store_chunks(chunks, epi_smem, *, smem_row, gmem_row, count, rows: int, ragged: bool):
  """Each compute warpgroup stores [rows, _EPI_N] chunks through its own SMEM slot
  (see the module doc, "epilogue"). chunks: (make_value, out_gmem [*, N], col) in
  store order; make_value() is traced just before its store (registers)."""
  wg = lax.axis_index("wg")
  slot = epi_smem.at[wg]
  for make_value, out_gmem, col in chunks:
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # slot free again
    slot[...] = make_value().astype(slot.dtype)
    plgpu.commit_smem()
    dst = out_gmem.at[:, pl.ds(col, _EPI_N)]
    if ragged:
      ladder_store(slot, dst, smem_row, gmem_row, count, rows)
    else:
      plgpu.copy_smem_to_gmem(slot, dst.at[pl.ds(gmem_row, rows)])


def _column_chunks(val, out_gmem, col0):
  """[rows, n] -> its _EPI_N-column chunks stored at columns col0, col0 + 64, ..."""
  return [(lambda c=c: val[:, c * _EPI_N:(c + 1) * _EPI_N], out_gmem, col0 + c * _EPI_N)
          for c in range(val.shape[1] // _EPI_N)]


def _store_epilogue(vals, out_gmems, epi_smem, *, col0, **kw):
  """Each value [rows, wg_n] to its output at columns [col0, col0 + wg_n)."""
  chunks = [ch for val, out in zip(vals, out_gmems) for ch in _column_chunks(val, out, col0)]
  _store_chunks(chunks, epi_smem, **kw)


def _gate_up_chunks(val, a_gmem, hu_gmem, col0):
  """The "gu" epilogue: val [rows, wg_n] holds gate/up-interleaved columns
  [col0, col0 + wg_n) (pairs of 64: gate, then up, of the same 64 F columns).
  a = silu(h) * u goes to a_gmem at F columns col0 / 2 + ...; hu_gmem (if given)
  gets val itself."""
  chunks = []
  for p in range(val.shape[1] // (2 * _EPI_N)):
    h = lambda p=p: val[:, 2 * p * _EPI_N:(2 * p + 1) * _EPI_N]
    u = lambda p=p: val[:, (2 * p + 1) * _EPI_N:(2 * p + 2) * _EPI_N]
    chunks.append((lambda h=h, u=u: _silu_mul(h(), u()), a_gmem, col0 // 2 + p * _EPI_N))
    if hu_gmem is not None:
      chunks += [(h, hu_gmem, col0 + 2 * p * _EPI_N), (u, hu_gmem, col0 + (2 * p + 1) * _EPI_N)]
  return chunks


def _silu_mul(h, u):
  return h * jax.nn.sigmoid(h) * u


# ----------------------------------------------------------------------------
# Row-tiled kernel: forward / dgrad / gate-up ("gu")
# ----------------------------------------------------------------------------


def _row_tiled_kernel(plan_gmem, *refs, mode: str, transpose_b: bool, save_hu: bool,
                      m: int, k: int, n: int, num_tiles: int, block_m: int, block_k: int,
                      wg_n: int, stages: int, in_dtype, cta_offset: int = 0,
                      num_ctas: Optional[int] = None,
                      before_tile: Optional[Callable[[Any], None]] = None,
                      walk: Optional[Callable[[Callable[..., None]], None]] = None):
  """The row-tiled body. Hooks for kernels that embed it (all default off, and
  then the traced program is exactly that of the standalone kernel):
    cta_offset, num_ctas  walk the tiles on CTAs [cta_offset, cta_offset +
        num_ctas) of the "sm" grid axis only (same interleaved order as
        `plgpu.nd_loop`: local CTA i takes tiles i, i + num_ctas, ...); the
        caller must run this body only on those CTAs. None: every CTA.
    before_tile(load_row)  called by all three warpgroups before the pipeline of
        every COMPUTE tile, i.e. before the first TMA load of its block_m rows
        [load_row, load_row + block_m) of the lhs operands. When it returns, the
        caller guarantees those rows are readable (e.g. a semaphore wait).
    walk(tile)  replaces the tile loop (cta_offset/num_ctas are then ignored):
        called once by all three warpgroups inside the SMEM scope, it must call
        `tile(lin, out_gmems=None, gmem_row=None)` for the linear tile indices
        lin = t * n_tiles + nt this CTA runs, identically on every warpgroup.
        out_gmems replaces the outputs the epilogue stores into (e.g. a peer's
        `remote_ref`), gmem_row the first output row of the tile's rows
        [lo, hi) (default lo). Used by `fused_gemm_return.py`.
  """
  if mode not in ("plain", "gu"):
    raise ValueError(f"{mode=} must be 'plain' or 'gu'")
  a_gmem, b_gmem, *out_gmems = refs
  cta_n = _NUM_COMPUTE_WGS * wg_n
  k_iters = k // block_k
  n_tiles = n // cta_n

  a_transforms = _swizzle_transforms(in_dtype, block_k)
  b_transforms = _swizzle_transforms(in_dtype, block_k if transpose_b else cta_n)

  def mma_step(_, a_smem, b_smem, acc):
    wg_cols = pl.ds(lax.axis_index("wg") * wg_n, wg_n)
    b = b_smem.at[wg_cols, :].T if transpose_b else b_smem.at[:, wg_cols]
    plgpu.wgmma(acc, a_smem, b)
    plgpu.wgmma_wait(0)  # the stage is released (consumed) after this step
    return acc

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
        in_specs=[a_spec, b_spec],
        wg_axis="wg",
        num_compute_wgs=_NUM_COMPUTE_WGS,
        max_concurrent_steps=stages,
        compute_context=compute_context,
    )

  def operand_views(group, load_row, nt):
    cols = pl.ds(nt * cta_n, cta_n)
    b_view = b_gmem.at[group, cols, :] if transpose_b else b_gmem.at[group, :, cols]
    return a_gmem.at[pl.ds(load_row, block_m), :], b_view

  a0, b0 = operand_views(0, 0, 0)
  ignore = lambda *_, **__: None
  # Dynamic grid (k_steps is traced) so the allocation matches every tile's pipeline.
  alloc_pipeline = make_pipeline(ignore, jnp.int32(k_iters))

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=alloc_pipeline.get_allocations(a0, b0),
      epi_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, block_m, _EPI_N), out_gmems[0].dtype),
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, epi_smem):
    def tile(lin, out_gmems_=None, gmem_row=None):
      t = lin // n_tiles
      nt = lin % n_tiles
      group = plan_gmem[t]
      load_row = pl.multiple_of(plan_gmem[num_tiles + t], block_m)
      lo = plan_gmem[2 * num_tiles + t]
      hi = plan_gmem[3 * num_tiles + t]
      kind = plan_gmem[4 * num_tiles + t]

      @pl.when(kind != _NONE)
      def _live_tile():
        if before_tile is not None:
          @pl.when(kind == _COMPUTE)
          def _wait_rows():
            before_tile(load_row)

        k_steps = jnp.where(kind == _COMPUTE, k_iters, 0)

        def compute_context(eval_pipeline):
          def acc_scope(acc):
            eval_pipeline(acc)
            val = acc[...]
            outs = out_gmems if out_gmems_ is None else out_gmems_
            col0 = nt * cta_n + lax.axis_index("wg") * wg_n
            if mode == "gu":
              chunks = _gate_up_chunks(val, outs[0], outs[1] if save_hu else None, col0)
            else:
              chunks = _column_chunks(val, outs[0], col0)
            _store_chunks(chunks, epi_smem, smem_row=lo - load_row,
                          gmem_row=lo if gmem_row is None else gmem_row, count=hi - lo,
                          rows=block_m, ragged=True)
          pl.run_scoped(acc_scope, plgpu.ACC((block_m, wg_n), jnp.float32))

        a_view, b_view = operand_views(group, load_row, nt)
        make_pipeline(compute_context, k_steps)(a_view, b_view, allocations=pipeline_allocs)

    if walk is not None:
      walk(lambda lin, out_gmems=None, gmem_row=None: tile(lin, out_gmems, gmem_row))
    elif num_ctas is None:
      @plgpu.nd_loop((num_tiles * n_tiles,), collective_axes="sm")
      def _tile_loop(loop_info):
        (lin,) = loop_info.index
        tile(lin)
    else:
      _cta_subset_loop(num_tiles * n_tiles, cta_offset, num_ctas, tile)

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
                     smem: int = device_lib.HOPPER_SMEM_BYTES) -> dict:
  """Validates one row-tiled launch on operands padded to the tile grid and
  returns the static keyword arguments of `_row_tiled_kernel` (one source of
  truth for the standalone launch and for kernels that embed the body).
  Raises ValueError if the tile does not fit in `smem` bytes."""
  if mode not in ("plain", "gu"):
    raise ValueError(f"{mode=} must be 'plain' or 'gu'")
  wg_n = config.block_n
  if wg_n % (2 * _EPI_N if mode == "gu" else _EPI_N):
    raise ValueError(f"block_n={wg_n} must be a multiple of {2 * _EPI_N if mode == 'gu' else _EPI_N}"
                     f" in mode {mode!r} (the epilogue's {_EPI_N}-column chunks"
                     f"{', in gate/up pairs' if mode == 'gu' else ''})")
  cta_n = _NUM_COMPUTE_WGS * wg_n
  block_m, block_k = config.block_m, config.block_k
  if block_m & (block_m - 1):
    raise ValueError(f"{block_m=} must be a power of two (ragged TMA store ladder)")
  if k % block_k:
    raise ValueError(f"{k=} must be divisible by {block_k=}")
  if n % cta_n:
    raise ValueError(f"{n=} must be divisible by the CTA tile width {cta_n}")
  if m % block_m:
    raise ValueError(f"{m=} must be divisible by {block_m=}")
  launch = _Launch(block_m, block_k, wg_n, 1, 1, cta_n, block_k,
                   jnp.dtype(out_dtype).itemsize, jnp.dtype(in_dtype).itemsize)
  stages = launch.stages(config.max_concurrent_steps, k // block_k, block_m, smem)
  return dict(mode=mode, transpose_b=transpose_b, save_hu=save_hu, m=m, k=k, n=n,
              num_tiles=num_row_tiles(m, g, block_m), block_m=block_m, block_k=block_k,
              wg_n=wg_n, stages=stages, in_dtype=in_dtype)


def _row_tiled_call(lhs, rhs, group_sizes, *, mode: str, transpose_b: bool, out_dtype,
                    save_hu: bool, config: KernelConfig, interpret,
                    zero_window: Optional[int] = None):
  """Launch the row-tiled kernel on operands already padded to the tile grid.
  zero_window: see `_row_tile_plan` (None: dead rows come back zero).

  lhs [M, K]; rhs [G, K, N] (or [G, N, K] with transpose_b). Returns a tuple:
  "plain": (out [M, N],); "gu" (rhs = `interleave_gate_up(w_gate, w_up)`, N = 2F):
  (a [M, F],) or, with save_hu, (a [M, F], hu [M, N]).
  """
  m, k = lhs.shape
  g = rhs.shape[0]
  n = rhs.shape[1] if transpose_b else rhs.shape[2]
  in_dtype = lhs.dtype
  if rhs.dtype != in_dtype:
    raise ValueError(f"lhs and rhs must share one dtype, got {lhs.dtype} and {rhs.dtype}")
  params = row_tiled_params(m, k, n, g, mode=mode, transpose_b=transpose_b, out_dtype=out_dtype,
                            in_dtype=in_dtype, save_hu=save_hu, config=config)
  plan = _row_tile_plan(group_sizes, m, config.block_m, zero_window)
  if mode == "gu":
    out_shapes = [(m, n // 2)] + ([(m, n)] if save_hu else [])
  else:
    out_shapes = [(m, n)]
  body = functools.partial(_row_tiled_kernel, **params)
  kernel = plgpu.kernel(
      body,
      out_type=tuple(jax.ShapeDtypeStruct(shape, out_dtype) for shape in out_shapes),
      grid=(device_lib.num_sms(config.num_sms),),
      grid_names=("sm",),
      num_threads=_NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=resolve_interpret(interpret),
  )
  return kernel(plan, lhs, rhs)


# ----------------------------------------------------------------------------
# Wgrad kernel
# ----------------------------------------------------------------------------


def _wgrad_kernel(bounds_gmem, lhs_gmem, dout_gmem, *out_gmems, num_groups: int,
                  block_m: int, block_n: int, block_k: int, stages: int, in_dtype):
  """out_gmems: (drhs,) or, for gate/up-interleaved dout, (drhs_gate, drhs_up): the
  epilogue sends the 64-column chunks alternately to the two (`split_gate_up`)."""
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
      plgpu.wgmma_wait(0)
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
      epi_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, block_m, _EPI_N), out_gmems[0].dtype),
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, epi_smem):
    @plgpu.nd_loop((num_groups * k_tiles * n_tiles,), collective_axes="sm")
    def _tile_loop(loop_info):
      (lin,) = loop_info.index
      g = lin // (k_tiles * n_tiles)
      kt = (lin // n_tiles) % k_tiles
      nt = lin % n_tiles
      start = bounds_gmem[g]
      end = bounds_gmem[num_groups + g]
      first_block = start // block_k
      num_blocks = jnp.where(end > start, (end + block_k - 1) // block_k - first_block, 0)

      def compute_context(eval_pipeline):
        def acc_scope(acc):
          eval_pipeline(acc)
          wg = lax.axis_index("wg")
          val = acc[...]
          if len(out_gmems) == 1:
            chunks = _column_chunks(val, out_gmems[0].at[g], nt * block_n)
          else:   # chunk c of the tile: gate if c is even, up if odd (block_n % 128 == 0)
            chunks = [(make, out_gmems[c % 2].at[g], nt * block_n // 2 + (c // 2) * _EPI_N)
                      for c, (make, _, _) in enumerate(_column_chunks(val, None, 0))]
          _store_chunks(chunks, epi_smem, smem_row=0, gmem_row=kt * cta_k + wg * block_m,
                        count=block_m, rows=block_m, ragged=False)
        pl.run_scoped(acc_scope, plgpu.ACC((block_m, block_n), jnp.float32))

      make_pipeline(compute_context, num_blocks, first_block, start, end)(
          lhs_gmem.at[:, pl.ds(kt * cta_k, cta_k)],
          dout_gmem.at[:, pl.ds(nt * block_n, block_n)],
          allocations=pipeline_allocs)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _wgrad_call(lhs, dout, group_sizes, *, out_dtype, config: KernelConfig, interpret,
                split_gate_up: bool = False):
  """drhs[g] = lhs[rows g]^T @ dout[rows g] on operands padded to the tile grid.
  split_gate_up: dout is gate/up-interleaved ([M, 2F], `interleave_gate_up`'s column
  order); returns (drhs_gate, drhs_up) [G, K, F] each instead of one [G, K, 2F]."""
  m, k_out = lhs.shape
  _, n_out = dout.shape
  g = group_sizes.shape[0]
  block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
  cta_k = _NUM_COMPUTE_WGS * block_m
  if k_out % cta_k:
    raise ValueError(f"{k_out=} must be divisible by the CTA tile {cta_k}")
  if n_out % block_n:
    raise ValueError(f"{n_out=} must be divisible by {block_n=}")
  if split_gate_up and block_n % (2 * _EPI_N):
    raise ValueError(f"{block_n=} must be a multiple of {2 * _EPI_N} to split gate/up columns")
  if m % block_k:
    raise ValueError(f"{m=} must be divisible by {block_k=}")
  in_dtype = lhs.dtype
  if dout.dtype != in_dtype:
    raise ValueError(f"lhs and dout must share one dtype, got {lhs.dtype} and {dout.dtype}")
  launch = _Launch(block_k, block_k, block_n // 2, 1, 1, block_n, cta_k,
                   jnp.dtype(out_dtype).itemsize, jnp.dtype(in_dtype).itemsize)
  stages = launch.stages(config.max_concurrent_steps, m // block_k, block_m,
                         device_lib.HOPPER_SMEM_BYTES)
  starts, ends = _group_bounds(group_sizes, m)
  bounds = jnp.concatenate([starts, ends]).astype(jnp.int32)
  body = functools.partial(_wgrad_kernel, num_groups=g, block_m=block_m, block_n=block_n,
                           block_k=block_k, stages=stages, in_dtype=in_dtype)
  kernel = plgpu.kernel(
      body,
      out_type=(tuple(jax.ShapeDtypeStruct((g, k_out, n_out // 2), out_dtype) for _ in range(2))
                if split_gate_up else jax.ShapeDtypeStruct((g, k_out, n_out), out_dtype)),
      grid=(device_lib.num_sms(config.num_sms),),
      grid_names=("sm",),
      num_threads=_NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=resolve_interpret(interpret),
  )
  return kernel(bounds, lhs, dout)


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
  (out,) = _row_tiled_call(lhs_p, rhs_p, group_sizes, mode="plain", transpose_b=False,
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
  (out,) = _row_tiled_call(dout_p, rhs_p, group_sizes, mode="plain", transpose_b=True,
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


def interleave_gate_up(gate, up):
  """[..., F] x 2 -> [..., 2F], F a multiple of 64: 64-column blocks alternate, gate
  block j at columns [128 j, 128 j + 64), up block j at [128 j + 64, 128 j + 128).
  The "gu" layout: one plain GEMM against it puts each tile's gate and up columns of
  the same F block into one accumulator (see the module doc)."""
  *lead, f = gate.shape
  if f % _EPI_N or up.shape != gate.shape:
    raise ValueError(f"gate {gate.shape} and up {up.shape} must match, last dim a multiple "
                     f"of {_EPI_N}")
  blocks = lambda x: x.reshape(*lead, f // _EPI_N, 1, _EPI_N)  # noqa: E731
  return jnp.concatenate([blocks(gate), blocks(up)], axis=-2).reshape(*lead, 2 * f)


def split_gate_up(gu):
  """The inverse of `interleave_gate_up`: [..., 2F] -> (gate, up) [..., F] each."""
  *lead, n = gu.shape
  blocks = gu.reshape(*lead, n // (2 * _EPI_N), 2, _EPI_N)
  return blocks[..., 0, :].reshape(*lead, n // 2), blocks[..., 1, :].reshape(*lead, n // 2)


def ffn_padded_ffn(f: int, config: KernelConfig) -> int:
  """F padded for the FFN's launches: an output dim of the gate/up kernel (CTA tile
  block_n of F), of the da dgrad (2 block_n) and of the dw_down wgrad (2 block_m),
  a contraction dim (block_k), and 64-column gate/up blocks."""
  return _round_up(f, math.lcm(2 * config.block_n, 2 * config.block_m, config.block_k, _EPI_N))


def ffn_padded_hidden(h: int, config: KernelConfig) -> int:
  """H padded for the FFN's launches: a contraction dim of the gate/up kernel
  (block_k) and an output dim of the down GEMM and of the dx dgrad (2 block_n)."""
  return _round_up(h, math.lcm(config.block_k, _NUM_COMPUTE_WGS * config.block_n))


def gate_up_weights(w_gate, w_up, config: KernelConfig, pad_hidden: bool = True):
  """w_gate, w_up [G, H, F] -> w_gu [G, H_p, 2 F_p] (zero-padded, then
  `interleave_gate_up`): the rhs of the "gu" forward and of the dx dgrad. Zero
  columns give h = u = 0, so a = silu(0) * 0 = 0 in the padded F columns; the zero
  H rows meet zero x columns. pad_hidden=False keeps H (a caller that has checked
  H against block_k). A copy of the gate/up weights per call."""
  h_p = ffn_padded_hidden(w_gate.shape[1], config) if pad_hidden else w_gate.shape[1]
  f_p = ffn_padded_ffn(w_gate.shape[2], config)
  pad = lambda w: _pad_axis(_pad_axis(w, 1, h_p), 2, f_p)  # noqa: E731
  return interleave_gate_up(pad(w_gate), pad(w_up))


def gate_up_forward(x_p, w_gu, group_sizes, *, config: KernelConfig, save: bool, interpret,
                    zero_window: Optional[int] = None):
  """The gate/up kernel: x_p [M_p, H_p] (rows padded to block_m, columns to H_p),
  w_gu from `gate_up_weights` -> (a [M_p, F_p],) or with save (a, hu [M_p, 2 F_p])."""
  return _row_tiled_call(x_p, w_gu, group_sizes, mode="gu", transpose_b=False,
                         out_dtype=x_p.dtype, save_hu=save, config=config, interpret=interpret,
                         zero_window=zero_window)


def _swiglu_grad_interleaved(da, hu, dtype):
  """dhu = interleave(dh, du) from da [M, F] (f32) and hu [M, 2F] in ONE elementwise
  pass over the interleaved shape (a select on the gate/up position, sigmoid
  recomputed per element rather than materialised):
    dh = da * u * s * (1 + h (1 - s)),  du = da * h * s,  s = sigmoid(h)."""
  m, n = hu.shape
  pairs = hu.reshape(m, n // (2 * _EPI_N), 2, _EPI_N).astype(jnp.float32)
  h, u = pairs[:, :, :1, :], pairs[:, :, 1:, :]
  d = da.reshape(m, n // (2 * _EPI_N), 1, _EPI_N)
  s = jax.nn.sigmoid(h)
  is_gate = lax.broadcasted_iota(jnp.int32, pairs.shape, 2) == 0
  dhu = jnp.where(is_gate, d * u * s * (1.0 + h * (1.0 - s)), d * h * s)
  return dhu.astype(dtype).reshape(m, n)


def _swiglu_forward(x, w_gate, w_up, w_down, group_sizes, config, interpret, save: bool,
                    zero_window=None):
  m, h_dim = x.shape
  w_gu = gate_up_weights(w_gate, w_up, config)
  h_p, f_p = w_gu.shape[1], w_gu.shape[2] // 2
  x_p = _pad_axis(_pad_axis(x, 1, h_p), 0, _padded_rows(m, config))
  outs = gate_up_forward(x_p, w_gu, group_sizes, config=config, save=save, interpret=interpret,
                         zero_window=zero_window)
  a = outs[0]  # [m_p, F_p]
  wd_p = _pad_axis(_pad_axis(w_down, 1, f_p), 2, h_p)
  (y,) = _row_tiled_call(a, wd_p, group_sizes, mode="plain", transpose_b=False,
                         out_dtype=x.dtype, save_hu=False, config=config, interpret=interpret,
                         zero_window=zero_window)
  y = y[:m, :h_dim] if y.shape != (m, h_dim) else y
  return y, outs


def swiglu_backward(x, w_gate, w_up, w_down, group_sizes, a, hu, dy, *, config: KernelConfig,
                    interpret=None, zero_window: Optional[int] = None):
  """The backward pass of `grouped_swiglu_ffn` (formulas in its docstring) from its
  saved residuals a [m_p, F_p] and hu [m_p, 2 F_p] (the gate/up epilogue's outputs,
  gate/up-interleaved). Returns (dx [M, H], dw_gate, dw_up, dw_down). Also the
  backward pass of the fused uniep forward (uniep_jax/fused.py), whose Kernel A
  writes the same a, hu."""
  interpret = resolve_interpret(interpret)
  m, h_dim = x.shape
  f_dim = w_gate.shape[2]
  kw = dict(config=config, interpret=interpret)
  w_gu = gate_up_weights(w_gate, w_up, config)   # [G, H_p, 2 F_p]
  h_p, f_p = w_gu.shape[1], w_gu.shape[2] // 2
  m_p = a.shape[0]
  dy_p = _pad_axis(_pad_axis(dy.astype(x.dtype), 1, h_p), 0, m_p)
  # da = dy @ w_down^T, float32 out: [m_p, f_p]
  wd_p = _pad_axis(_pad_axis(w_down, 1, f_p), 2, h_p)
  (da,) = _row_tiled_call(dy_p, wd_p, group_sizes, mode="plain", transpose_b=True,
                          out_dtype=jnp.float32, save_hu=False, zero_window=zero_window, **kw)
  dhu = _swiglu_grad_interleaved(da, hu, x.dtype)  # [m_p, 2 f_p]
  # dx = dh @ w_gate^T + du @ w_up^T = dhu @ w_gu^T: one plain dgrad over K = 2 F_p
  (dx,) = _row_tiled_call(dhu, w_gu, group_sizes, mode="plain", transpose_b=True,
                          out_dtype=x.dtype, save_hu=False, zero_window=zero_window, **kw)
  dx = dx[:m, :h_dim]
  m_w = _round_up(m_p, config.block_k)   # the wgrad walks block_k row blocks
  x_w = _pad_axis(_pad_axis(x, 0, m_w), 1, _round_up(h_dim, _NUM_COMPUTE_WGS * config.block_m))
  dw_gate, dw_up = _wgrad_call(x_w, _pad_axis(dhu, 0, m_w), group_sizes,
                               out_dtype=w_gate.dtype, split_gate_up=True, **kw)
  dw_down = gmm_wgrad(a, _pad_axis(dy.astype(x.dtype), 0, m_p), group_sizes,
                      out_dtype=w_down.dtype, **kw)[:, :f_dim, :]
  return (dx, dw_gate[:, :h_dim, :f_dim], dw_up[:, :h_dim, :f_dim], dw_down)


@functools.lru_cache(maxsize=None)
def _swiglu_fn(config: KernelConfig, interpret, zero_dead_rows: bool):
  # the wgrad reads up to block_k rows past a group's end: those stay zero
  zw = None if zero_dead_rows else config.block_k

  @jax.custom_vjp
  def f(x, w_gate, w_up, w_down, group_sizes):
    y, _ = _swiglu_forward(x, w_gate, w_up, w_down, group_sizes, config, interpret, save=False,
                           zero_window=zw)
    return y

  def fwd(x, w_gate, w_up, w_down, group_sizes):
    y, (a, hu) = _swiglu_forward(x, w_gate, w_up, w_down, group_sizes, config, interpret,
                                 save=True, zero_window=zw)
    return y, (x, w_gate, w_up, w_down, group_sizes, a, hu)

  def bwd(res, dy):
    x, w_gate, w_up, w_down, group_sizes, a, hu = res
    return swiglu_backward(x, w_gate, w_up, w_down, group_sizes, a, hu, dy, config=config,
                           interpret=interpret, zero_window=zw) + (None,)

  f.defvjp(fwd, bwd)
  return f


def grouped_swiglu_ffn(x, w_gate, w_up, w_down, group_sizes, *,
                       config: KernelConfig = KernelConfig(), interpret=None,
                       zero_dead_rows: bool = True):
  """SwiGLU expert FFN over grouped rows, differentiable (custom_vjp).

  x [M, H], w_gate/w_up [G, H, F], w_down [G, F, H], group_sizes [G] -> y [M, H]:
    h = x @ w_gate[g], u = x @ w_up[g]   (one "gu" kernel against the gate/up-
                                          interleaved weights, one f32 accumulator)
    a = (silu(h) * u) in f32, cast to x.dtype
    y = a @ w_down[g] (f32 accumulation), cast to x.dtype.
  Rows past sum(group_sizes) come back zero; with zero_dead_rows=False only the
  first ones, up to round_up(sum(group_sizes), block_k), do (also in dx), and the
  later rows of y and dx are undefined, never written: the MoE layer's receive
  buffer is sized for the worst case (R*T*K rows, ~1/R of them live), and every
  kernel then skips its dead tiles instead of storing zeros. The backward needs
  the cotangent dy finite in that window (the wgrad multiplies it by zeros).
  F need not be a multiple of 64.

  Saved for the backward pass: a and hu (x.dtype, h and u interleaved, written by
  the gate/up epilogue; no recompute of the gate/up GEMMs). Backward (dh, du are
  cast to x.dtype before the GEMMs that consume them; h and u are the saved values):
    da = dy @ w_down^T (f32 output);  s = sigmoid(h)
    dh = da * u * s * (1 + h (1 - s)),  du = da * silu(h)
    dx = dh @ w_gate^T + du @ w_up^T  (one plain dgrad of dhu = interleave(dh, du)
                                       against w_gu over K = 2F)
    dw_gate, dw_up = x^T dhu (one wgrad kernel, its epilogue splitting the columns),
    dw_down = a^T dy.
  The gate/up weights are interleaved by a copy in each direction
  (`gate_up_weights`), the price of N = 128 wgmma tiles (module doc).
  """
  return _swiglu_fn(config, resolve_interpret(interpret), zero_dead_rows)(
      x, w_gate, w_up, w_down, group_sizes)


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


def reference_swiglu_ffn(x, w_gate, w_up, w_down, group_sizes):
  """The FFN with lax.ragged_dot (f32 accumulation, same casts as the kernel)."""
  gs = group_sizes.astype(jnp.int32)
  h = lax.ragged_dot(x, w_gate, gs, preferred_element_type=jnp.float32)
  u = lax.ragged_dot(x, w_up, gs, preferred_element_type=jnp.float32)
  a = (jax.nn.silu(h) * u).astype(x.dtype)
  y = lax.ragged_dot(a, w_down, gs, preferred_element_type=jnp.float32)
  y = jnp.where(_dead_row_mask(x.shape[0], group_sizes), y, 0.0)
  return y.astype(x.dtype)
