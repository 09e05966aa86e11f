"""FP8 (e4m3) grouped GEMM with block scales for Hopper, in Pallas Mosaic GPU.

Problem
-------
Both operands are K-major (the contraction dimension contiguous), because
Hopper's wgmma takes 8-bit operands only that way:

  rows   out[r, n] = sum_kb (a[r, kb] . b[g(r), n, kb]) * sa[kb, r] * sb[g(r), kb, n]
         a [M, K] e4m3, sa [K/128, M];  b [G, N, K] e4m3, sb [G, K/128, N]
         rows ordered by group as in grouped_gemm.py (group_sizes, dead rows zero)
  tokens out[g, r, n] = sum_kb over g's token blocks (a[r, kb] . b[n, kb]) sa[kb, r] sb[kb, n]
         a [C, Mt] e4m3, sa [Mt/128, C];  b [N, Mt] e4m3, sb [Mt/128, N]
         (the wgrad: contraction over tokens; group g owns the 128-aligned token
         blocks [first_g, first_g + count_g), see `token_layout`)

kb runs over blocks of QUANT_BLOCK = 128 contraction elements: `fp8.py` gives
every 128 contraction elements of a row (a) or of an output column (b) one
power-of-two scale. The forward x @ w uses b = w^T (a K-major copy of the weight,
made once per step), the dgrad dy @ w^T uses b = w as stored, the wgrad uses
transposed copies of both activations laid out by `token_layout`.

Accumulation (DeepSeek-V3's recipe): each kb's product runs on the tensor cores
into a fresh float32 accumulator (4 wgmma of k = 32), is scaled by its row and
column scales on the CUDA cores, and added to the running float32 sum, kb in
increasing order. Scales are powers of two, so the scaling is exact; the result's
only roundings are the tensor cores' within a block and the float32 sum across
blocks, both in a fixed order: bitwise deterministic, and a row's result depends
only on that row, its group's weights and K (row-split invariant).

Tiling
------
CTA = 2 compute warpgroups + 1 memory warpgroup (`emit_pipeline_warp_specialized`).
CTA tile block_m x (2 block_n); compute warpgroup w owns columns
[w block_n, (w + 1) block_n). Each warpgroup holds two float32 accumulators of
block_m x block_n (the running sum and the block product), so
block_m * block_n <= 8192 (64 x 128 or 128 x 64: 128 registers per thread).
Row tiles come from grouped_gemm's work list (`_row_tile_plan`: a group's rows from
its first row rounded down to 8, only its last tile partial); token tiles are
(g, row tile, column tile) with a dynamic pipeline length count_g (0 for an empty
group: the tile is stored as zeros). A persistent grid of num_sms CTAs walks the
tiles with `plgpu.nd_loop`.

Buffers (SMEM, per stage, 128-byte swizzle on the operands):
  A [block_m, 128] e4m3, B [2 block_n, 128] e4m3, row scales [1, block_m] f32,
  column scales [1, 2 block_n] f32: 40 KiB + 1.3 KiB at 64 x 128;
  epilogue [2 warpgroups, block_m, block_n] in the output dtype (unswizzled: ragged
  row ranges are stored with the power-of-two TMA ladder, `tma.ladder_store`).

Synchronisation: that of grouped_gemm.py's row-tiled kernel (the pipeline's
produced/consumed barriers per stage, 4 operands per stage; a stage is released
after the step's accumulator has been read, i.e. its wgmma are done; each
compute warpgroup waits for its previous TMA stores to have read its epilogue
slot before writing it, then `commit_smem()`). No atomics; no barrier shared by
the two compute warpgroups.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
from jax import lax
import numpy as np
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import device as device_lib
from pallas_kernels import fp8
from pallas_kernels.fp8 import FP8_DTYPE, QUANT_BLOCK
from pallas_kernels.grouped_gemm import (GROUP_TILE_ALIGN, _COMPUTE, _NONE, _group_bounds,
                                         _row_tile_plan, num_row_tiles, resolve_interpret,
                                         swiglu_grad)
from pallas_kernels.tma import ladder_store

_NUM_COMPUTE_WGS = 2
_MEMORY_REGISTERS = 40
_SMEM_RESERVE = 1024
_MAX_ACC_ELEMS = 64 * 128   # per accumulator and warpgroup: 64 registers per thread


@dataclasses.dataclass(frozen=True)
class Fp8Config:
  """Tiling of the FP8 grouped GEMM. The contraction step is fixed at QUANT_BLOCK
  (the scale block), so no field changes a bit of any result.

  block_m: rows per tile (a power of two, >= 64); block_n: columns per compute
  warpgroup (a multiple of 64); block_m * block_n <= 8192 (two float32
  accumulators per warpgroup). max_concurrent_steps: pipeline stages (clamped to
  what fits). num_sms: persistent grid size (None: the device's SM count).
  """

  block_m: int = 64
  block_n: int = 128
  max_concurrent_steps: int = 4
  num_sms: Optional[int] = None

  def __post_init__(self):
    if self.block_m < 64 or self.block_m & (self.block_m - 1):
      raise ValueError(f"block_m={self.block_m} must be a power of two >= 64")
    if self.block_n < 64 or self.block_n % 64:
      raise ValueError(f"block_n={self.block_n} must be a positive multiple of 64")
    if self.block_m * self.block_n > _MAX_ACC_ELEMS:
      raise ValueError(f"block_m * block_n = {self.block_m * self.block_n} must be <= "
                       f"{_MAX_ACC_ELEMS} (two float32 accumulators per warpgroup)")
    if self.max_concurrent_steps < 1:
      raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be >= 1")
    if self.num_sms is not None and self.num_sms < 1:
      raise ValueError(f"num_sms={self.num_sms} must be >= 1")


def _stages(config: Fp8Config, out_itemsize: int, k_blocks: int,
            smem: int = device_lib.HOPPER_SMEM_BYTES) -> int:
  cta_n = _NUM_COMPUTE_WGS * config.block_n
  stage = (config.block_m + cta_n) * QUANT_BLOCK + 4 * (config.block_m + cta_n)
  epi = _NUM_COMPUTE_WGS * config.block_m * config.block_n * out_itemsize
  fit = (smem - _SMEM_RESERVE - epi) // stage
  stages = min(config.max_concurrent_steps, max(k_blocks, 1), fit)
  if stages < 1:
    raise ValueError(f"FP8 tile {config} does not fit in {smem} bytes of shared memory")
  return int(stages)


def _fp8_kernel(meta_gmem, a_gmem, as_gmem, b_gmem, bs_gmem, out_gmem, *, variant: str,
                total_tiles: int, n_tiles: int, row_tiles: int, k_blocks: int, num_groups: int,
                block_m: int, wg_n: int, stages: int):
  """variant "rows": meta = the row-tile plan (5 x row_tiles); tiles (t, nt), t over
  the plan's row_tiles. variant "tokens": meta = [first block | block count] per
  group; tiles (g, rt, nt) with rt over the row_tiles of out[g]. k_blocks: the
  contraction blocks of the "rows" variant (the largest pipeline either way)."""
  cta_n = _NUM_COMPUTE_WGS * wg_n
  transforms = (plgpu.TilingTransform((8, QUANT_BLOCK)), plgpu.SwizzleTransform(128))
  acc_layout = plgpu.Layout.WGMMA

  def step(_, a_smem, b_smem, as_smem, bs_smem, carry):
    wg = lax.axis_index("wg")
    b = plgpu.transpose_ref(b_smem.at[pl.ds(wg * wg_n, wg_n), :], (1, 0))

    def mma(acc_ref):
      plgpu.wgmma(acc_ref, a_smem, b)
      return acc_ref[...]

    part = pl.run_scoped(mma, plgpu.ACC((block_m, wg_n), jnp.float32))
    rs = plgpu.load(as_smem.at[0], layout=acc_layout.reduce(1))
    cs = plgpu.load(bs_smem.at[0, pl.ds(wg * wg_n, wg_n)], layout=acc_layout.reduce(0))
    part = part * lax.broadcast_in_dim(rs, part.shape, [0])
    part = part * lax.broadcast_in_dim(cs, part.shape, [1])
    return carry + part

  def make_pipeline(compute_context, k_steps, first):
    idx_rows = lambda ki: (0, first + ki)     # operand tiles: [rows, 128] at block first + ki
    idx_scales = lambda ki: (first + ki, 0)   # scale vectors: [1, rows] at block first + ki
    return plgpu.emit_pipeline_warp_specialized(
        step,
        grid=(k_steps,),
        memory_registers=_MEMORY_REGISTERS,
        in_specs=[
            plgpu.BlockSpec((block_m, QUANT_BLOCK), idx_rows, transforms=transforms),
            plgpu.BlockSpec((cta_n, QUANT_BLOCK), idx_rows, transforms=transforms),
            plgpu.BlockSpec((1, block_m), idx_scales),
            plgpu.BlockSpec((1, cta_n), idx_scales),
        ],
        wg_axis="wg",
        num_compute_wgs=_NUM_COMPUTE_WGS,
        max_concurrent_steps=stages,
        compute_context=compute_context,
    )

  def views(group, row0, nt):
    cols = pl.ds(nt * cta_n, cta_n)
    rows = pl.ds(row0, block_m)
    if variant == "rows":
      return (a_gmem.at[rows, :], b_gmem.at[group, cols, :],
              as_gmem.at[:, rows], bs_gmem.at[group, :, cols])
    return (a_gmem.at[rows, :], b_gmem.at[cols, :], as_gmem.at[:, rows], bs_gmem.at[:, cols])

  ignore = lambda *_, **__: None
  alloc_pipeline = make_pipeline(ignore, jnp.int32(max(k_blocks, 1)), 0)

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=alloc_pipeline.get_allocations(*views(0, 0, 0)),
      epi_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, block_m, wg_n), out_gmem.dtype),
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, epi_smem):
    def run_tile(group, row0, nt, k_steps, first, store):
      def compute_context(eval_pipeline):
        zeros = plgpu.layout_cast(jnp.zeros((block_m, wg_n), jnp.float32), acc_layout)
        acc = eval_pipeline(zeros)
        wg = lax.axis_index("wg")
        slot = epi_smem.at[wg]
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # slot free again
        slot[...] = acc.astype(slot.dtype)
        plgpu.commit_smem()
        store(slot, nt * cta_n + wg * wg_n)

      make_pipeline(compute_context, k_steps, first)(
          *views(group, row0, nt), allocations=pipeline_allocs)

    def tile(lin):
      if variant == "rows":
        t = lin // n_tiles
        nt = lin % n_tiles
        group = meta_gmem[t]
        load_row = pl.multiple_of(meta_gmem[row_tiles + t], GROUP_TILE_ALIGN)
        lo = meta_gmem[2 * row_tiles + t]
        hi = meta_gmem[3 * row_tiles + t]
        kind = meta_gmem[4 * row_tiles + t]

        def store(slot, col0):
          ladder_store(slot, out_gmem.at[:, pl.ds(col0, wg_n)], lo - load_row, lo, hi - lo,
                       block_m, commit_group=True)

        @pl.when(kind != _NONE)
        def _():
          run_tile(group, load_row, nt, jnp.where(kind == _COMPUTE, k_blocks, 0), 0, store)
      else:
        per_group = row_tiles * n_tiles
        g = lin // per_group
        rt = (lin % per_group) // n_tiles
        nt = lin % n_tiles
        row0 = pl.multiple_of(rt * block_m, block_m)

        def store(slot, col0):
          plgpu.copy_smem_to_gmem(slot, out_gmem.at[g, pl.ds(row0, block_m), pl.ds(col0, wg_n)],
                                  commit_group=True)

        run_tile(g, row0, nt, meta_gmem[num_groups + g], meta_gmem[g], store)

    @plgpu.nd_loop((total_tiles,), collective_axes="sm")
    def _tile_loop(loop_info):
      (s,) = loop_info.index
      tile(s)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _launch(body_kw, meta, operands, out_type, config: Fp8Config, interpret, name: str):
  kernel = device_lib.kernel(
      functools.partial(_fp8_kernel, **body_kw),
      kernel_name=name,
      out_type=out_type,
      grid=(device_lib.num_sms(config.num_sms),),
      grid_names=("sm",),
      num_threads=_NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      interpret=resolve_interpret(interpret),
  )
  return kernel(meta, *operands)


def _check_fp8(**arrays):
  for name, x in arrays.items():
    if jnp.dtype(x.dtype) != jnp.dtype(FP8_DTYPE):
      raise ValueError(f"{name}.dtype={x.dtype} must be {jnp.dtype(FP8_DTYPE)}")


def _check_scales(name, s, shape):
  if tuple(s.shape) != tuple(shape) or s.dtype != jnp.float32:
    raise ValueError(f"{name} must be float32 {tuple(shape)}, got {s.dtype} {tuple(s.shape)}")


def _pad(x, axis, size):
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def fp8_gmm(a, a_scales, b, b_scales, group_sizes, *, out_dtype=jnp.bfloat16,
            config: Fp8Config = Fp8Config(), interpret=None, zero_window: Optional[int] = None):
  """Rows variant: out[rows of g] = sum_kb (a[rows, kb] . b[g, :, kb]) * scales.

  a [M, K] e4m3 with a_scales [M, K/128] (`fp8.quantise_rows`); b [G, N, K] e4m3
  (K-major) with b_scales [G, K/128, N] (per output column, `fp8.column_scales`);
  K a multiple of 128. Returns [M, N] in out_dtype; rows past sum(group_sizes) are 0
  (zero_window W: only those before round_up(sum, W); the later ones are not written,
  see grouped_gemm's `_row_tile_plan`).
  """
  _check_fp8(a=a, b=b)
  m, k = a.shape
  g, n, k2 = b.shape
  if k != k2 or k % QUANT_BLOCK:
    raise ValueError(f"a.shape={a.shape}, b.shape={b.shape}: K must agree and be a "
                     f"multiple of {QUANT_BLOCK}")
  if group_sizes.shape != (g,):
    raise ValueError(f"group_sizes.shape={group_sizes.shape} must be ({g},)")
  kb = k // QUANT_BLOCK
  _check_scales("a_scales", a_scales, (m, kb))
  _check_scales("b_scales", b_scales, (g, kb, n))
  cta_n = _NUM_COMPUTE_WGS * config.block_n
  m_p, n_p = _round_up(m, config.block_m), _round_up(n, cta_n)
  a_p = _pad(a, 0, m_p)
  as_t = _pad(a_scales, 0, m_p).T           # [K/128, M]: one block's scales contiguous
  b_p = _pad(b, 1, n_p)
  bs_p = _pad(b_scales, 2, n_p)
  plan = _row_tile_plan(group_sizes, m_p, config.block_m, zero_window)
  num_tiles = num_row_tiles(m_p, g, config.block_m)
  body_kw = dict(variant="rows", total_tiles=num_tiles * (n_p // cta_n), n_tiles=n_p // cta_n,
                 row_tiles=num_tiles, k_blocks=kb, num_groups=g, block_m=config.block_m,
                 wg_n=config.block_n,
                 stages=_stages(config, jnp.dtype(out_dtype).itemsize, kb))
  out = _launch(body_kw, plan, (a_p, as_t, b_p, bs_p),
                jax.ShapeDtypeStruct((m_p, n_p), out_dtype), config, interpret, "fp8_gemm_rows")
  return out[:m, :n] if (m_p, n_p) != (m, n) else out


def token_layout(group_sizes, m: int):
  """Where the wgrad's transposed operands put each row: group g's rows at token
  slots [128 first_g, 128 first_g + size_g), each group starting a fresh 128-slot
  block, so no scale block or contraction block mixes two groups.

  Returns (blocks [2G] int32 = [first_g | count_g] in 128-slot blocks, slot_row
  [Mt] int32: the source row of each slot, m for an empty slot), with the static
  Mt = round_up(m + G * 127, 128) >= sum_g round_up(size_g, 128)."""
  g = group_sizes.shape[0]
  starts, ends = _group_bounds(group_sizes, m)
  sizes = ends - starts
  count = (sizes + QUANT_BLOCK - 1) // QUANT_BLOCK
  first = jnp.cumsum(count) - count
  mt = _round_up(m + g * (QUANT_BLOCK - 1), QUANT_BLOCK)
  slot = jnp.arange(mt, dtype=jnp.int32)
  # the group of each slot block: the last group whose first block is <= it
  blk = slot // QUANT_BLOCK
  gi = jnp.clip(jnp.searchsorted(first, blk, side="right") - 1, 0, g - 1)
  within = slot - first[gi] * QUANT_BLOCK
  live = (blk < first[gi] + count[gi]) & (within < sizes[gi])
  slot_row = jnp.where(live, starts[gi] + within, m)
  return jnp.concatenate([first, count]).astype(jnp.int32), slot_row.astype(jnp.int32)


def to_token_major(x, slot_row):
  """x [M, C] -> [C, Mt]: slot j holds row slot_row[j] of x (zeros where it is M)."""
  xz = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])
  return jnp.take(xz, slot_row, axis=0).T


def fp8_gmm_tokens(a, a_scales, b, b_scales, blocks, *, out_dtype=jnp.float32,
                   config: Fp8Config = Fp8Config(), interpret=None):
  """Tokens variant (the wgrad): out[g] = sum over g's token blocks of a . b^T, scaled.

  a [C, Mt] e4m3 with a_scales [Mt/128, C]; b [N, Mt] e4m3 with b_scales [Mt/128, N]
  (`fp8.quantise_columns` of `to_token_major` copies); blocks [2G] from
  `token_layout`. Returns [G, C, N] in out_dtype; an empty group gives zeros.
  """
  _check_fp8(a=a, b=b)
  c, mt = a.shape
  n, mt2 = b.shape
  if mt != mt2 or mt % QUANT_BLOCK:
    raise ValueError(f"a.shape={a.shape}, b.shape={b.shape}: the token axis must agree and "
                     f"be a multiple of {QUANT_BLOCK}")
  if blocks.ndim != 1 or blocks.shape[0] % 2:
    raise ValueError(f"blocks.shape={blocks.shape} must be [2 G] (`token_layout`)")
  g = blocks.shape[0] // 2
  _check_scales("a_scales", a_scales, (mt // QUANT_BLOCK, c))
  _check_scales("b_scales", b_scales, (mt // QUANT_BLOCK, n))
  cta_n = _NUM_COMPUTE_WGS * config.block_n
  c_p, n_p = _round_up(c, config.block_m), _round_up(n, cta_n)
  row_tiles, n_tiles = c_p // config.block_m, n_p // cta_n
  body_kw = dict(variant="tokens", total_tiles=g * row_tiles * n_tiles, n_tiles=n_tiles,
                 row_tiles=row_tiles, k_blocks=mt // QUANT_BLOCK, num_groups=g,
                 block_m=config.block_m, wg_n=config.block_n,
                 stages=_stages(config, jnp.dtype(out_dtype).itemsize, mt // QUANT_BLOCK))
  operands = (_pad(a, 0, c_p), _pad(a_scales, 1, c_p), _pad(b, 0, n_p), _pad(b_scales, 1, n_p))
  out = _launch(body_kw, blocks, operands, jax.ShapeDtypeStruct((g, c_p, n_p), out_dtype),
                config, interpret, "fp8_gemm_tokens")
  return out[:, :c, :n] if (c_p, n_p) != (c, n) else out


# ----------------------------------------------------------------------------
# Products of unquantised operands: quantise, lay out, launch
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QuantisedWeight:
  """A weight w [G, K, N] quantised once per step (`fp8.quantise_blocks`) in both
  layouts the row kernel reads: `fwd` = w^T [G, Np, Kp] (a K-major copy: x @ w) and
  `dgrad` = w [G, Kp, Np] (dy @ w^T), each with its per-column scales."""

  k: int
  n: int
  dtype: str   # the master weight's dtype (its gradient's)
  fwd: tuple
  dgrad: tuple


def quantise_weight(w, *, forward: bool = True, dgrad: bool = True) -> QuantisedWeight:
  q, s = fp8.quantise_blocks(w)
  fwd = (jnp.swapaxes(q, 1, 2), fp8.column_scales(s, 2)) if forward else None
  dg = (q, fp8.column_scales(s, 1)) if dgrad else None
  return QuantisedWeight(w.shape[1], w.shape[2], jnp.dtype(w.dtype).name, fwd, dg)


jax.tree_util.register_dataclass(QuantisedWeight, data_fields=["fwd", "dgrad"],
                                 meta_fields=["k", "n", "dtype"])


def gmm_fp8(x, qw: QuantisedWeight, group_sizes, *, transpose: bool = False,
            out_dtype=jnp.bfloat16, config: Fp8Config = Fp8Config(), interpret=None,
            zero_window: Optional[int] = None):
  """x [M, K] @ w[g] (transpose=False) or x [M, N] @ w[g]^T (transpose=True) per row
  group, x quantised per (row, 128 columns) here. Returns [M, N] (or [M, K])."""
  b, bs = qw.dgrad if transpose else qw.fwd
  width = qw.k if transpose else qw.n
  xq, xs = fp8.quantise_rows(x)
  out = fp8_gmm(xq, xs, b, bs, group_sizes, out_dtype=out_dtype, config=config,
                interpret=interpret, zero_window=zero_window)
  return out[:, :width] if out.shape[1] != width else out


def wgrad_fp8(lhs, dout, group_sizes, *, out_dtype=jnp.float32,
              config: Fp8Config = Fp8Config(), interpret=None):
  """[G, K, N]: lhs[rows of g]^T @ dout[rows of g], both quantised per (channel,
  128 tokens of one group) in the token-major layout of `token_layout`."""
  m = lhs.shape[0]
  blocks, slot_row = token_layout(group_sizes, m)
  aq, as_ = fp8.quantise_columns(to_token_major(lhs, slot_row))
  bq, bs = fp8.quantise_columns(to_token_major(dout, slot_row))
  return fp8_gmm_tokens(aq, as_, bq, bs, blocks, out_dtype=out_dtype, config=config,
                        interpret=interpret)


# ----------------------------------------------------------------------------
# The SwiGLU expert FFN in FP8, with its VJP
# ----------------------------------------------------------------------------


def fp8_swiglu_forward(x, w_gate_up, w_down, group_sizes, *, config: Fp8Config,
                       interpret=None, zero_window: Optional[int] = None):
  """(y, residuals) of the FP8 FFN: the math of grouped_gemm's SwiGLU FFN with every
  GEMM operand quantised (x, a per row and 128 columns; weights per 128 x 128 block)."""
  f = w_down.shape[1]
  qw1 = quantise_weight(w_gate_up)
  qw2 = quantise_weight(w_down)
  kw = dict(config=config, interpret=interpret, zero_window=zero_window)
  hu = gmm_fp8(x, qw1, group_sizes, out_dtype=jnp.float32, **kw)
  h, u = hu[:, :f], hu[:, f:]
  a = (jax.nn.silu(h) * u).astype(x.dtype)
  y = gmm_fp8(a, qw2, group_sizes, out_dtype=x.dtype, **kw)
  res = (h.astype(x.dtype), u.astype(x.dtype), a,
         dataclasses.replace(qw1, fwd=None), dataclasses.replace(qw2, fwd=None))
  return y, res


def fp8_swiglu_backward(x, group_sizes, residuals, dy, *, config: Fp8Config, interpret=None,
                        zero_window: Optional[int] = None, wgrad_dtype=jnp.float32):
  """(dx, dw_gate_up, dw_down) from `fp8_swiglu_forward`'s residuals: the
  derivative of grouped_gemm's SwiGLU FFN with the backward GEMMs' operands
  quantised the same way (dy, [dh | du] per row; a, x, dy, [dh | du] token-major
  for the weight gradients), the quantised weights reused from the forward."""
  h, u, a, qw1, qw2 = residuals
  kw = dict(config=config, interpret=interpret)
  dy = dy.astype(x.dtype)
  da = gmm_fp8(dy, qw2, group_sizes, transpose=True, out_dtype=jnp.float32,
               zero_window=zero_window, **kw)
  dh, du = swiglu_grad(da, h.astype(jnp.float32), u.astype(jnp.float32))
  dhu = jnp.concatenate([dh, du], axis=-1).astype(x.dtype)
  dx = gmm_fp8(dhu, qw1, group_sizes, transpose=True, out_dtype=x.dtype,
               zero_window=zero_window, **kw)
  dw1 = wgrad_fp8(x, dhu, group_sizes, out_dtype=wgrad_dtype, **kw)
  dw2 = wgrad_fp8(a, dy, group_sizes, out_dtype=wgrad_dtype, **kw)
  return dx, dw1, dw2


@functools.lru_cache(maxsize=None)
def _fp8_swiglu_fn(config: Fp8Config, interpret, zero_window):
  kw = dict(config=config, interpret=interpret, zero_window=zero_window)

  @jax.custom_vjp
  def f(x, w_gate_up, w_down, group_sizes):
    return fp8_swiglu_forward(x, w_gate_up, w_down, group_sizes, **kw)[0]

  def fwd(x, w_gate_up, w_down, group_sizes):
    y, res = fp8_swiglu_forward(x, w_gate_up, w_down, group_sizes, **kw)
    return y, (x, group_sizes, res)

  def bwd(saved, dy):
    x, group_sizes, res = saved
    dx, dw1, dw2 = fp8_swiglu_backward(x, group_sizes, res, dy, **kw)
    return dx, dw1.astype(res[3].dtype), dw2.astype(res[4].dtype), _int_zero(group_sizes)

  f.defvjp(fwd, bwd)
  return f


def _int_zero(x):
  return np.zeros(x.shape, jax.dtypes.float0)


def fp8_grouped_swiglu_ffn(x, w_gate_up, w_down, group_sizes, *,
                           config: Fp8Config = Fp8Config(), interpret=None,
                           zero_dead_rows: bool = True):
  """`grouped_gemm.grouped_swiglu_ffn` with FP8 GEMMs (e4m3, block scales, float32
  accumulation), differentiable. Weights stay in their dtype; their quantised
  copies are made per call. zero_dead_rows=False: rows of y and dx past
  round_up(sum(group_sizes), block_m) are left undefined (never written)."""
  two_f = w_gate_up.shape[-1]
  if w_gate_up.ndim != 3 or two_f % 2 or w_down.ndim != 3 or w_down.shape[1] != two_f // 2:
    raise ValueError(f"w_gate_up {w_gate_up.shape} must be [G, H, 2F] and w_down "
                     f"{w_down.shape} [G, F, H]")
  zw = None if zero_dead_rows else config.block_m
  return _fp8_swiglu_fn(config, resolve_interpret(interpret), zw)(
      x, w_gate_up, w_down, group_sizes)
