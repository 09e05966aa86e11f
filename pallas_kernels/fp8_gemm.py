"""FP8 (e4m3) grouped GEMM with block scales for Hopper, in Pallas Mosaic GPU.

Problem
-------
Both operands are K-major (the contraction dimension contiguous), because
Hopper's wgmma takes 8-bit operands only that way:

  out[r, n] = sum_kb (a[r, kb] . b[g(r), n, kb]) * sa[kb, r] * sb[g(r), kb, n]
  a [M, K] e4m3, sa [K/128, M];  b [G, N, K] e4m3, sb [G, K/128, N] float32

rows ordered by group as in grouped_gemm.py (`group_sizes`; rows past the groups
come back zero, or with a zero window only the first of them). kb runs over blocks
of QUANT_BLOCK = 128 contraction elements: `fp8.py` gives every 128 contraction
elements of a row one power-of-two scale (sa) and every 128 x 128 block of a weight
one (sb, repeated over the block's 128 columns: `fp8.column_scales`). The forward
x @ w uses b = w^T (a K-major copy of the quantised weight, made once per call),
the dgrad dy @ w^T uses b = w as stored.

Accumulation (DeepSeek-V3's recipe): each kb's product runs on the tensor cores
into a fresh float32 accumulator (4 wgmma of k = 32), is scaled on the CUDA cores
by its row's scale times the warpgroup's column-block scale (one multiply-add per
element), and added to the running float32 sum, kb in increasing order. Scales are
powers of two, so the scaling is exact (`fp8.py`); the only roundings are the tensor
cores' within a block (Hopper accumulates e4m3 products at reduced precision: on an
H200 the result is within ~1.3e-4, relative, of the float32 product of the dequantised
operands; the CPU interpret mode's dot is exact float32) and the float32 sum across
blocks, both in a fixed order: bitwise deterministic, and a row's result depends only
on that row, its group's weights and K (row-split invariant).

Tiling
------
CTA = 2 compute warpgroups + 1 memory warpgroup (`emit_pipeline_warp_specialized`).
CTA tile block_m x (2 block_n); compute warpgroup w owns columns
[w block_n, (w + 1) block_n), which lie in one 128-column scale block (block_n
divides 128). Each warpgroup holds two float32 accumulators of block_m x block_n
(the running sum and the current 128-K block's product), so block_m * block_n <=
8192 (64 x 128 or 128 x 64: 64 registers per thread and accumulator); while one
warpgroup promotes its block, the other's wgmma keep the tensor cores busy. Row
tiles come from grouped_gemm's work list (`_row_tile_plan`: a group's rows from its
first row rounded down to 8, only its last tile partial, dead rows as zero tiles
without MMA). A persistent grid of num_sms CTAs walks the live (row tile, column
tile) pairs in grouped_gemm's raster bands (`_raster`, `raster_rows`: the tiles in
flight share weight tiles in L2), CTA c taking pairs c, c + num_sms, ...; then the
dead rows' zero tiles the same way (zeros stored, no MMA, no pipeline). A CTA runs
its live tiles as one pipeline of pipelines (`pipeline_state`): the memory warpgroup
fetches the next tile's first K blocks while the compute warpgroups finish a tile and
store it, so no tile starts on an empty pipeline. That needs the stages to divide
k_blocks (`_stages`: at most one stage fewer than fit, at least two); otherwise, and
for a CTA's lone tile, each tile runs a pipeline of its own.

Buffers (SMEM, per stage, 128-byte swizzle on the operands):
  A [block_m, 128] e4m3, B [2 block_n, 128] e4m3, row scales [1, block_m] f32,
  column scales [1, 2 block_n] f32: 41.25 KiB at 64 x 128;
  epilogue [2 warpgroups, block_m, block_n] in the output dtype (unswizzled: ragged
  row ranges are stored with the power-of-two TMA ladder, `tma.ladder_store`).

Synchronisation: that of grouped_gemm.py's row-tiled kernel (the pipeline's
produced/consumed barriers per stage, 4 operands per stage; a stage is released
after the step's accumulator has been read, i.e. its wgmma are done; each compute
warpgroup waits for its previous TMA stores to have read its epilogue slot before
writing it, then `commit_smem()`). The compute warpgroups meet only in the
pipeline's consumed barriers (2 arrivals); neither waits for the other. Across a
CTA's chained tiles the stage barriers keep counting (k_blocks in whole rounds of the
stages keeps producer and consumers on the same slots); only its last tile's pipeline
waits for the final releases. No atomics.

The FFN (`fp8_grouped_swiglu_ffn`) runs its four row GEMMs (gate/up, down, da, dx)
in FP8 and its two weight gradients with grouped_gemm's bf16 wgrad: an FP8 wgrad needs
token-major quantised copies of x, [dh | du], a and dy, and measured with them it lost
to the bf16 kernel on every shape (docs/decisions.md).
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
from pallas_kernels import fp8_quantise
from pallas_kernels.fp8 import FP8_DTYPE, QUANT_BLOCK
from pallas_kernels.grouped_gemm import (GROUP_TILE_ALIGN, _COMPUTE, _MEMORY_REGISTERS, _ZERO,
                                         _NUM_COMPUTE_WGS, KernelConfig, _pad_axis, _raster,
                                         _round_up, _row_tile_plan, _swizzle_transforms, fit_stages,
                                         gmm_wgrad, num_row_tiles, read_plan,
                                         reference_gmm_wgrad, resolve_interpret, swiglu_grad)
from pallas_kernels.tma import ladder_store

_MAX_ACC_ELEMS = 64 * 128   # per accumulator and warpgroup: 64 registers per thread


@dataclasses.dataclass(frozen=True)
class Fp8Config:
  """Tiling of the FP8 grouped GEMM. The contraction runs in QUANT_BLOCK (the scale
  block) steps in a fixed order whatever the fields, so no field changes a bit of any
  result.

  block_m: rows per tile (a power of two, >= 64); block_n: columns per compute
  warpgroup (64 or 128: a divisor of the 128-column scale block); block_m * block_n
  <= 8192 (64 registers per thread for each float32 accumulator of a warpgroup).
  max_concurrent_steps: pipeline stages (clamped to what fits). num_sms: persistent
  grid size (None: the device's SM count). raster_rows: the tile walk's band height
  (grouped_gemm's `_raster`; 1: row-major). Bands of 4 were measured best or within
  2.5% of 8 on mixtral- and deepseek-like, and of row-major on qwen3-like (one H200,
  docs/decisions.md "FP8 tile walk"), 16-20% faster than row-major where a group's
  weight leaves L2 (mixtral-like).
  """

  block_m: int = 64
  block_n: int = 128
  max_concurrent_steps: int = 4
  num_sms: Optional[int] = None
  raster_rows: int = 4

  def __post_init__(self):
    if self.raster_rows < 1:
      raise ValueError(f"raster_rows={self.raster_rows} must be >= 1")
    if self.block_m < 64 or self.block_m & (self.block_m - 1):
      raise ValueError(f"block_m={self.block_m} must be a power of two >= 64")
    if self.block_n not in (64, 128):
      raise ValueError(f"block_n={self.block_n} must be 64 or 128 (a divisor of the "
                       f"{QUANT_BLOCK}-column scale block)")
    if self.block_m * self.block_n > _MAX_ACC_ELEMS:
      raise ValueError(f"block_m * block_n = {self.block_m * self.block_n} must be <= "
                       f"{_MAX_ACC_ELEMS} (64 registers per thread for each float32 "
                       f"accumulator)")
    if self.max_concurrent_steps < 1:
      raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be >= 1")
    if self.num_sms is not None and self.num_sms < 1:
      raise ValueError(f"num_sms={self.num_sms} must be >= 1")


def _stages(config: Fp8Config, out_itemsize: int, k_blocks: int,
            smem: int = device_lib.HOPPER_SMEM_BYTES) -> tuple[int, bool]:
  """(stages, chained): the pipeline stages of a launch and whether a CTA's tiles run
  as one pipeline of pipelines, which needs k_blocks in whole rounds of the stages.
  Chained on the largest divisor of k_blocks that fits, if that gives up at most one
  stage of what fits and keeps two (6 K blocks: 3 chained stages for 4); else the
  stages that fit, one pipeline per tile (7 K blocks: 4 stages, not 1)."""
  cta_n = _NUM_COMPUTE_WGS * config.block_n
  # per 128-K block: the e4m3 A and B tiles and their float32 scale vectors
  stage = (config.block_m + cta_n) * (QUANT_BLOCK + 4)
  epi = _NUM_COMPUTE_WGS * config.block_m * config.block_n * out_itemsize
  fit = fit_stages(config.max_concurrent_steps, k_blocks, stage, epi, smem)
  divisor = max(d for d in range(1, fit + 1) if k_blocks % d == 0)
  if divisor == fit or divisor >= max(2, fit - 1):
    return divisor, True
  return fit, False


def _fp8_kernel(plan_gmem, a_gmem, as_gmem, b_gmem, bs_gmem, out_gmem, *, num_tiles: int,
                n_tiles: int, k_blocks: int, block_m: int, wg_n: int, stages: int,
                chained: bool, raster_rows: int):
  """The kernel body: the COMPUTE tiles (t, nt) of the row-tile plan (5 x num_tiles
  int32, then the COMPUTE and ZERO tile counts) walked in bands of raster_rows row
  tiles, k_blocks 128-K blocks per tile, one per pipeline step, the CTA's tiles one
  pipeline of pipelines; then the ZERO tiles."""
  cta_n = _NUM_COMPUTE_WGS * wg_n
  transforms = _swizzle_transforms(FP8_DTYPE, QUANT_BLOCK)   # 128-byte swizzle
  acc_layout = plgpu.Layout.WGMMA

  def make_pipeline(compute_context, pipeline_state=None):
    def step(_, a_smem, b_smem, as_smem, bs_smem, carry):
      wg = lax.axis_index("wg")
      b = b_smem.at[pl.ds(wg * wg_n, wg_n), :].transpose((1, 0))   # K-major B

      def mma(acc_ref):
        plgpu.wgmma(acc_ref, a_smem, b)
        return acc_ref[...]   # waits for the wgmma

      part = pl.run_scoped(mma, plgpu.ACC((block_m, wg_n), jnp.float32))
      # this warpgroup's wg_n columns lie in one 128-column scale block: its scale is
      # one scalar, folded into the row scales (exact: powers of two)
      rs = plgpu.load(as_smem.at[0], layout=acc_layout.reduce(1)) * bs_smem[0, wg * wg_n]
      return carry + part * lax.broadcast_in_dim(rs, part.shape, [0])

    return plgpu.emit_pipeline_warp_specialized(
        step,
        grid=(k_blocks,),
        memory_registers=_MEMORY_REGISTERS,
        in_specs=[
            plgpu.BlockSpec((block_m, QUANT_BLOCK), lambda ki: (0, ki), transforms=transforms),
            plgpu.BlockSpec((cta_n, QUANT_BLOCK), lambda ki: (0, ki), transforms=transforms),
            plgpu.BlockSpec((1, block_m), lambda ki: (ki, 0)),
            plgpu.BlockSpec((1, cta_n), lambda ki: (ki, 0)),
        ],
        wg_axis="wg",
        num_compute_wgs=_NUM_COMPUTE_WGS,
        max_concurrent_steps=stages,
        compute_context=compute_context,
        pipeline_state=pipeline_state,
    )

  def views(group, load_row, nt):
    cols = pl.ds(nt * cta_n, cta_n)
    rows = pl.ds(load_row, block_m)
    return (a_gmem.at[rows, :], b_gmem.at[group, cols, :], as_gmem.at[:, rows],
            bs_gmem.at[group, :, cols])

  ignore = lambda *_, **__: None
  alloc_pipeline = make_pipeline(ignore)

  @functools.partial(
      pl.run_scoped,
      pipeline_allocs=alloc_pipeline.get_allocations(*views(0, 0, 0)),
      epi_smem=plgpu.SMEM((_NUM_COMPUTE_WGS, block_m, wg_n), out_gmem.dtype),
      collective_axes="wg",
  )
  def _scope(pipeline_allocs, epi_smem):
    wg = lax.axis_index("wg")
    sm, num_sms = lax.axis_index("sm"), lax.axis_size("sm")
    n_compute, n_zero = plan_gmem[5 * num_tiles], plan_gmem[5 * num_tiles + 1]

    def store(vals, t, nt):
      """This warpgroup's block_m x wg_n of tile (t, nt): its rows [lo, hi) only."""
      _, load_row, lo, hi, _ = read_plan(plan_gmem, t, num_tiles, GROUP_TILE_ALIGN)
      slot = epi_smem.at[wg]
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # slot free again
      slot[...] = vals.astype(slot.dtype)
      plgpu.commit_smem()
      ladder_store(slot, out_gmem.at[:, pl.ds(nt * cta_n + wg * wg_n, wg_n)],
                   lo - load_row, lo, hi - lo, block_m, commit_group=True)

    def tile(j, pipeline_state):
      """The CTA's j-th COMPUTE tile."""
      lin = _raster(sm + j * num_sms, n_compute, n_tiles, raster_rows)
      t, nt = lin // n_tiles, lin % n_tiles
      group, load_row, _, _, _ = read_plan(plan_gmem, t, num_tiles, GROUP_TILE_ALIGN)

      def compute_context(eval_pipeline):
        store(eval_pipeline(
            plgpu.layout_cast(jnp.zeros((block_m, wg_n), jnp.float32), acc_layout)), t, nt)

      make_pipeline(compute_context, pipeline_state)(
          *views(group, load_row, nt), allocations=pipeline_allocs)

    # this CTA's COMPUTE tiles, one pipeline each, chained into a pipeline of pipelines
    # (the memory warpgroup fetches the next tile's first K blocks while the compute
    # warpgroups finish a tile and store it) where `_stages` says so; a lone tile runs
    # a pipeline of its own
    total = n_compute * n_tiles
    count = jnp.maximum(total - sm + num_sms - 1, 0) // num_sms
    assert not chained or k_blocks % stages == 0

    @pl.when((count == 1) | ((count > 1) & (not chained)))
    def _():
      @pl.loop(0, count)
      def _(j):
        tile(j, None)

    if chained:
      @pl.when(count > 1)
      def _():
        @pl.loop(0, count)
        def _(j):
          tile(j, jnp.where(j == 0, plgpu.PipelinePipeline.START,
                            jnp.where(j == count - 1, plgpu.PipelinePipeline.STOP,
                                      plgpu.PipelinePipeline.STEADY)).astype(jnp.int32))

    # the ZERO tiles (dead rows that are written): zeros from the compute warpgroups
    @pl.when(wg < _NUM_COMPUTE_WGS)
    def _():
      # zero tile z goes to CTA (total + z) % num_sms: the CTAs with one live tile
      # fewer take the first ones
      @pl.loop(lax.rem(sm - lax.rem(total, num_sms) + num_sms, num_sms), n_zero * n_tiles,
               step=num_sms)
      def _(s):
        store(plgpu.layout_cast(jnp.zeros((block_m, wg_n), jnp.float32), acc_layout),
              n_compute + s // n_tiles, s % n_tiles)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def check_fp8_hardware(device=None) -> None:
  """e4m3 wgmma needs FP8 tensor cores: compute capability 8.9 or newer (ValueError)."""
  device = device or jax.devices()[0]
  cc = getattr(device, "compute_capability", None)
  try:
    major, minor = (int(v) for v in str(cc).split(".")[:2])
  except ValueError:
    major, minor = 0, 0
  if (major, minor) < (8, 9):
    raise ValueError(f"the FP8 grouped GEMM needs FP8 tensor cores (compute capability "
                     f">= 8.9); device {device.device_kind!r} has {cc}")


def _launch(body_kw, plan, operands, out_type, config: Fp8Config, interpret):
  interpret = resolve_interpret(interpret)
  if interpret is False and not device_lib.lowering_only():
    check_fp8_hardware()
  kernel = device_lib.kernel(
      functools.partial(_fp8_kernel, **body_kw),
      kernel_name="fp8_grouped_gemm",
      out_type=out_type,
      grid=(device_lib.num_sms(config.num_sms),),
      grid_names=("sm",),
      num_threads=_NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      interpret=interpret,
  )
  return kernel(plan, *operands)


def _check_fp8(**arrays):
  for name, x in arrays.items():
    if jnp.dtype(x.dtype) != jnp.dtype(FP8_DTYPE):
      raise ValueError(f"{name}.dtype={x.dtype} must be {jnp.dtype(FP8_DTYPE)}")


def _check_scales(name, s, shape):
  if tuple(s.shape) != tuple(shape) or s.dtype != jnp.float32:
    raise ValueError(f"{name} must be float32 {tuple(shape)}, got {s.dtype} {tuple(s.shape)}")


def fp8_gmm(a, a_scales, b, b_scales, group_sizes, *, out_dtype=jnp.bfloat16,
            config: Fp8Config = Fp8Config(), interpret=None, zero_window: Optional[int] = None):
  """out[rows of g] = sum_kb (a[rows, kb] . b[g, :, kb]) * scales.

  a [M, K] e4m3 with a_scales [M, K/128] (`fp8.quantise_rows`); b [G, N, K] e4m3
  (K-major) with b_scales [G, K/128, N] (per output column, `fp8.column_scales`);
  K a multiple of 128. Returns [M, N] in out_dtype; rows past sum(group_sizes) are 0
  (zero_window W: only those before round_up(sum, W); the later ones are not written,
  see grouped_gemm's `_row_tile_plan`). b_scales must be constant
  over aligned runs of 128 columns (`fp8.column_scales` of 128 x 128 block scales):
  the kernel reads one per warpgroup.
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
  m_p = _round_up(m, config.block_m)
  return _fp8_gmm_t(_pad_axis(a, 0, m_p), _pad_axis(a_scales, 0, m_p).T, b, b_scales,
                    group_sizes, m=m, out_dtype=out_dtype, config=config,
                    interpret=interpret, zero_window=zero_window)


def _fp8_gmm_t(a_p, as_t, b, b_scales, group_sizes, *, m: int, out_dtype, config: Fp8Config,
               interpret, zero_window: Optional[int]):
  """`fp8_gmm` on a_p [m_p, K] (m_p a multiple of block_m, rows past m ignored) with
  transposed row scales as_t [K/128, m_p]: the quantisation kernel's layouts. [m, N]."""
  m_p, k = a_p.shape
  g, n, _ = b.shape
  kb = k // QUANT_BLOCK
  cta_n = _NUM_COMPUTE_WGS * config.block_n
  n_p = _round_up(n, cta_n)
  b_p = _pad_axis(b, 1, n_p)
  bs_p = _pad_axis(b_scales, 2, n_p)
  plan = _row_tile_plan(group_sizes, m_p, config.block_m, zero_window)
  num_tiles = num_row_tiles(m_p, g, config.block_m)
  # the plan's COMPUTE tiles come first, then its ZERO tiles (`_row_tile_plan`)
  kind = plan[4 * num_tiles:]
  plan = jnp.concatenate([plan, jnp.stack([jnp.sum(kind == _COMPUTE, dtype=jnp.int32),
                                           jnp.sum(kind == _ZERO, dtype=jnp.int32)])])
  stages, chained = _stages(config, jnp.dtype(out_dtype).itemsize, kb)
  body_kw = dict(num_tiles=num_tiles, n_tiles=n_p // cta_n, k_blocks=kb,
                 block_m=config.block_m, wg_n=config.block_n, stages=stages,
                 chained=chained, raster_rows=config.raster_rows)
  out = _launch(body_kw, plan, (a_p, as_t, b_p, bs_p),
                jax.ShapeDtypeStruct((m_p, n_p), out_dtype), config, interpret)
  return out[:m, :n] if (m_p, n_p) != (m, n) else out


# ----------------------------------------------------------------------------
# Products of unquantised operands: quantise, lay out, launch
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class QuantisedWeight:
  """A weight w [G, K, N] quantised once per FFN call (`fp8.quantise_blocks`) in both
  layouts the row kernel reads: `fwd` = w^T [G, Np, Kp] (a K-major copy: x @ w) and
  `dgrad` = w [G, Kp, Np] (dy @ w^T), each with its per-column scales."""

  k: int
  n: int
  dtype: str   # the master weight's dtype (its gradient's)
  fwd: tuple
  dgrad: tuple


def quantise_weight(w, *, forward: bool = True, dgrad: bool = True,
                    interpret=None) -> QuantisedWeight:
  """Both layouts in one pass of `fp8_quantise.quantise_weight_t` for 16-bit weights
  (K and N zero-padded to multiples of 128 first); `fp8.quantise_blocks` in XLA for
  other dtypes (the same bits)."""
  g, k, n = w.shape
  if jnp.dtype(w.dtype) in fp8_quantise.WEIGHT_DTYPES:
    wp = _pad_axis(_pad_axis(w, 1, _round_up(k, QUANT_BLOCK)), 2, _round_up(n, QUANT_BLOCK))
    q, q_t, s_fwd, s_dgrad = fp8_quantise.quantise_weight_t(wp, interpret=interpret)
  else:
    q, s, q_t = fp8.quantise_blocks(w, transposed=True)
    s_fwd, s_dgrad = fp8.column_scales(s, 2), fp8.column_scales(s, 1)
  fwd = (q_t, s_fwd) if forward else None
  dg = (q, s_dgrad) if dgrad else None
  return QuantisedWeight(k, n, jnp.dtype(w.dtype).name, fwd, dg)


def quantise_rows_for_gemm(x, block_m: int, *, interpret=None):
  """x [M, K] -> (q [m_p, Kp] e4m3, s^T [Kp/128, m_p] float32), m_p = round_up(M,
  block_m), Kp = round_up(K, 128), zero rows and columns added: the A operand of
  `_fp8_gmm_t`, from `fp8_quantise.quantise_rows_t` in one pass (`fp8.quantise_rows`
  in XLA for other dtypes: the same bits)."""
  m, k = x.shape
  xp = _pad_axis(_pad_axis(x, 0, _round_up(m, block_m)), 1, _round_up(k, QUANT_BLOCK))
  if jnp.dtype(x.dtype) in fp8_quantise.ROW_DTYPES:
    return fp8_quantise.quantise_rows_t(xp, interpret=interpret)
  q, s = fp8.quantise_rows(xp)
  return q, s.T


jax.tree_util.register_dataclass(QuantisedWeight, data_fields=["fwd", "dgrad"],
                                 meta_fields=["k", "n", "dtype"])


def gmm_fp8(x, qw: QuantisedWeight, group_sizes, *, transpose: bool = False,
            out_dtype=jnp.bfloat16, config: Fp8Config = Fp8Config(), interpret=None,
            zero_window: Optional[int] = None, x_quantised=None):
  """x [M, K] @ w[g] (transpose=False) or x [M, N] @ w[g]^T (transpose=True) per row
  group, x quantised per (row, 128 columns) here, or given as x_quantised = (q [M, Kp]
  e4m3, s [M, Kp/128] float32), `fp8.quantise_rows` of x. Returns [M, N] (or [M, K])."""
  b, bs = qw.dgrad if transpose else qw.fwd
  width = qw.k if transpose else qw.n
  if x_quantised is None:
    xq, xs_t = quantise_rows_for_gemm(x, config.block_m, interpret=interpret)
  else:
    q, s = x_quantised
    m, k = x.shape
    kp = _round_up(k, QUANT_BLOCK)
    if (q.shape != (m, kp) or jnp.dtype(q.dtype) != jnp.dtype(FP8_DTYPE)
        or s.shape != (m, kp // QUANT_BLOCK) or s.dtype != jnp.float32):
      raise ValueError(f"x_quantised must be (e4m3 {(m, kp)}, float32 "
                       f"{(m, kp // QUANT_BLOCK)}) for x {x.shape}, got ({q.dtype} {q.shape}, "
                       f"{s.dtype} {s.shape})")
    m_p = _round_up(m, config.block_m)
    xq, xs_t = _pad_axis(q, 0, m_p), _pad_axis(s, 0, m_p).T
  out = _fp8_gmm_t(xq, xs_t, b, bs, group_sizes, m=x.shape[0], out_dtype=out_dtype,
                   config=config, interpret=interpret, zero_window=zero_window)
  return out[:, :width] if out.shape[1] != width else out


# ----------------------------------------------------------------------------
# The SwiGLU expert FFN in FP8, with its VJP
# ----------------------------------------------------------------------------


def fp8_swiglu_forward(x, w_gate_up, w_down, group_sizes, *, config: Fp8Config,
                       interpret=None, zero_window: Optional[int] = None, x_quantised=None):
  """(y, residuals) of the FP8 FFN: grouped_gemm's SwiGLU FFN with the operands of
  its two GEMMs quantised (x, a per row and 128 columns; weights per 128 x 128 block):
    [h | u] = q(x) @ q(w_gate_up)[g]   float32 accumulation, stored in x.dtype
    a = silu(h) * u                    in float32 from the stored h, u, cast to x.dtype
    y = q(a) @ q(w_down)[g]            float32 accumulation, cast to x.dtype.
  x_quantised: q(x) as (q, s) rows (`gmm_fp8`), e.g. from the FP8 dispatch, which
  sends each token's quantised row; x is then its dequantisation."""
  f = w_down.shape[1]
  qw1 = quantise_weight(w_gate_up, interpret=interpret)
  qw2 = quantise_weight(w_down, interpret=interpret)
  kw = dict(config=config, interpret=interpret, zero_window=zero_window)
  hu = gmm_fp8(x, qw1, group_sizes, out_dtype=x.dtype, x_quantised=x_quantised, **kw)
  h, u = hu[:, :f], hu[:, f:]
  a = (jax.nn.silu(h.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype)
  y = gmm_fp8(a, qw2, group_sizes, out_dtype=x.dtype, **kw)
  res = (h, u, a, dataclasses.replace(qw1, fwd=None), dataclasses.replace(qw2, fwd=None))
  return y, res


def fp8_swiglu_backward(x, group_sizes, residuals, dy, *, config: Fp8Config,
                        wgrad_config: KernelConfig, interpret=None,
                        zero_window: Optional[int] = None, wgrad_dtype=None):
  """(dx, dw_gate_up, dw_down) from `fp8_swiglu_forward`'s residuals, the weight
  gradients in `wgrad_dtype` (default: the master weights' own, written by the wgrad
  kernel from its float32 sums):
    da = q(dy) @ q(w_down)[g]^T        (FP8, float32 out; the weights' quantised
                                        copies of the forward)
    dh, du = swiglu_grad(da, h, u)     cast to x.dtype, one buffer [dh | du]
    dx = q([dh | du]) @ q(w_gate_up)[g]^T   (FP8)
    dw_gate_up = x^T [dh | du], dw_down = a^T dy   (grouped_gemm's bf16 wgrad, float32
                                        accumulation)."""
  h, u, a, qw1, qw2 = residuals
  kw = dict(config=config, interpret=interpret, zero_window=zero_window)
  dy = dy.astype(x.dtype)
  da = gmm_fp8(dy, qw2, group_sizes, transpose=True, out_dtype=jnp.float32, **kw)
  dh, du = swiglu_grad(da, h.astype(jnp.float32), u.astype(jnp.float32))
  dhu = jnp.concatenate([dh, du], axis=-1).astype(x.dtype)
  dx = gmm_fp8(dhu, qw1, group_sizes, transpose=True, out_dtype=x.dtype, **kw)
  wkw = dict(config=wgrad_config, interpret=interpret)
  return (dx, gmm_wgrad(x, dhu, group_sizes, out_dtype=wgrad_dtype or jnp.dtype(qw1.dtype), **wkw),
          gmm_wgrad(a, dy, group_sizes, out_dtype=wgrad_dtype or jnp.dtype(qw2.dtype), **wkw))


@functools.lru_cache(maxsize=None)
def _fp8_swiglu_fn(config: Fp8Config, wgrad_config: KernelConfig, interpret, zero_window):
  kw = dict(config=config, interpret=interpret, zero_window=zero_window)

  @jax.custom_vjp
  def f(x, w_gate_up, w_down, group_sizes, x_quantised):
    return fp8_swiglu_forward(x, w_gate_up, w_down, group_sizes, x_quantised=x_quantised,
                              **kw)[0]

  def fwd(x, w_gate_up, w_down, group_sizes, x_quantised):
    y, res = fp8_swiglu_forward(x, w_gate_up, w_down, group_sizes, x_quantised=x_quantised,
                                **kw)
    return y, (x, group_sizes, res)

  def bwd(saved, dy):
    x, group_sizes, res = saved
    dx, dw1, dw2 = fp8_swiglu_backward(x, group_sizes, res, dy, wgrad_config=wgrad_config, **kw)
    # the gradient reaches x (q(x)'s dequantisation); q(x) itself carries none (None:
    # a zero cotangent, so q(x) need not be kept for the backward pass)
    return dx, dw1, dw2, np.zeros(group_sizes.shape, jax.dtypes.float0), None

  f.defvjp(fwd, bwd)
  return f


def fp8_grouped_swiglu_ffn(x, w_gate_up, w_down, group_sizes, *,
                           config: Fp8Config = Fp8Config(),
                           wgrad_config: KernelConfig = KernelConfig(), interpret=None,
                           zero_dead_rows: bool = True, x_quantised=None):
  """`grouped_gemm.grouped_swiglu_ffn` with FP8 row GEMMs (e4m3, block scales,
  float32 accumulation; `fp8_swiglu_forward` / `fp8_swiglu_backward`), differentiable.
  Weights stay in their dtype; their quantised copies are made per call, once for the
  forward and backward. zero_dead_rows=False: rows of y and dx past
  round_up(sum(group_sizes), W) are left undefined (never written), W the larger of
  block_m and the wgrad's block_k (the wgrad reads [dh | du] that far); the
  cotangent dy must then be finite in that window (the dw_down wgrad multiplies its
  rows there by zeros). x_quantised: q(x) as (q, s) rows (`fp8_swiglu_forward`), x its
  dequantisation; the gradient goes to x."""
  two_f = w_gate_up.shape[-1]
  if w_gate_up.ndim != 3 or two_f % 2 or w_down.ndim != 3 or w_down.shape[1] != two_f // 2:
    raise ValueError(f"w_gate_up {w_gate_up.shape} must be [G, H, 2F] and w_down "
                     f"{w_down.shape} [G, F, H]")
  zw = ffn_zero_window(config, wgrad_config, zero_dead_rows)
  return _fp8_swiglu_fn(config, wgrad_config, resolve_interpret(interpret), zw)(
      x, w_gate_up, w_down, group_sizes, x_quantised)


def ffn_zero_window(config: Fp8Config, wgrad_config: KernelConfig,
                    zero_dead_rows: bool) -> Optional[int]:
  """The FP8 FFN's zero window: None (dead rows come back zero) or, with
  zero_dead_rows=False, the rows past the groups that its launches still read or write
  (the FP8 row tiles and the bf16 wgrad's row blocks)."""
  return None if zero_dead_rows else max(config.block_m, wgrad_config.block_k)


# ----------------------------------------------------------------------------
# Pure-JAX reference (the test oracle of the quantised math)
# ----------------------------------------------------------------------------


def reference_fp8_gmm(x, w, group_sizes, *, transpose: bool = False):
  """x @ w[g] (or x @ w[g]^T) per row group with the kernel's quantisation, the
  products of the dequantised operands in float32 at HIGHEST precision (exact
  dequantisation: powers of two). Rows past the groups are zero. float32 out."""
  xq, xs = fp8.quantise_rows(x)
  wq, ws = fp8.quantise_blocks(w)
  wd = fp8.dequantise_blocks(wq, ws)
  if transpose:
    wd = jnp.swapaxes(wd, 1, 2)
  xd = fp8.dequantise_rows(xq, xs)
  out = lax.ragged_dot(xd, wd, group_sizes.astype(jnp.int32), precision=lax.Precision.HIGHEST,
                       preferred_element_type=jnp.float32)
  width = w.shape[1] if transpose else w.shape[2]
  live = jnp.arange(x.shape[0]) < jnp.sum(group_sizes)
  return jnp.where(live[:, None], out[:, :width], 0.0)


def reference_fp8_swiglu_ffn(x, w_gate_up, w_down, group_sizes):
  """The forward of `fp8_grouped_swiglu_ffn` with `reference_fp8_gmm` (same casts)."""
  return reference_fp8_swiglu_vjp(x, w_gate_up, w_down, group_sizes)[0]


def reference_fp8_swiglu_vjp(x, w_gate_up, w_down, group_sizes, dy=None):
  """(y, dx, dw_gate_up, dw_down) of `fp8_grouped_swiglu_ffn` in plain JAX: the same
  quantised operands and casts, products at float32 HIGHEST precision, the weight
  gradients (float32) from `grouped_gemm.reference_gmm_wgrad`. dy None: y only."""
  f = w_down.shape[1]
  hu = reference_fp8_gmm(x, w_gate_up, group_sizes).astype(x.dtype)
  h, u = hu[:, :f], hu[:, f:]
  a = (jax.nn.silu(h.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype)
  y = reference_fp8_gmm(a, w_down, group_sizes).astype(x.dtype)
  if dy is None:
    return y, None, None, None
  dy = dy.astype(x.dtype)
  da = reference_fp8_gmm(dy, w_down, group_sizes, transpose=True)
  dh, du = swiglu_grad(da, h.astype(jnp.float32), u.astype(jnp.float32))
  dhu = jnp.concatenate([dh, du], axis=-1).astype(x.dtype)
  dx = reference_fp8_gmm(dhu, w_gate_up, group_sizes, transpose=True).astype(x.dtype)
  return (y, dx, reference_gmm_wgrad(x, dhu, group_sizes, out_dtype=jnp.float32),
          reference_gmm_wgrad(a, dy, group_sizes, out_dtype=jnp.float32))
