"""E4M3 quantisation kernels in Pallas Mosaic GPU: `fp8.py`'s format in one pass over HBM.

Contract
--------
Bit for bit the results of `fp8.quantise_rows` and `fp8.quantise_blocks(transposed=True)`
(the same scale rule, `fp8.scale_and_inverse`: integer operations on amax's bits; the
same rounding: x * (1 / s) is exact, then one round-to-nearest-even to e4m3), in the
layouts the FP8 grouped GEMM reads, so no XLA pass follows them:

  quantise_rows_t    x [M, K] -> q [M, K] e4m3, s^T [K/128, M] float32 (row scales,
                     one contraction block's scales contiguous)
  quantise_weight_t  w [G, K, N] 16-bit -> q [G, K, N], q^T [G, N, K] e4m3 (the
                     K-major copy), column scales [G, K/128, N] and [G, N/128, K]
                     (`fp8.column_scales` of the block scales, axis 2 and axis 1)

One difference: the K-major copy holds +0 where q holds -0 (it comes from a sum,
below, and -0 + 0 = +0). e4m3 +0 and -0 add the same exact zero to every product and
the FP8 GEMM's float32 sums start at +0, so no GEMM result changes (tests/test_fp8.py
checks it in the interpret mode). A NaN or
inf in a block makes its scale NaN (the max is NaN-propagating: max.NaN).

Shapes: K and N multiples of 128, M a multiple of 64 (the wrappers in `fp8_gemm.py`
pad).

Tiling
------
One warpgroup per CTA and one tile per CTA; many CTAs per SM hide the HBM latency
(no persistent loop: the work is a stream).
  rows:    grid (M / R, K / 128), tile [R, 128] (R = 128, or 64 when M is not a
           multiple of 128). A row's 128 values sit on the 4 threads of a quad
           (WGMMA register layout): its amax is a reduction within the quad.
  weights: grid (G, K / 128, N / 128), tile = one 128 x 128 scale block. amax: the
           rows' amax, broadcast and reduced over the rows (across warps, through
           SMEM), so every column holds the block's amax. q^T = I @ q^T: an e4m3
           wgmma of the identity with q's SMEM tile as its K-major B operand, float32
           accumulators (every output is 1 * q plus zeros: exact), converted back to
           e4m3 (exact). Mosaic GPU cannot store an 8-bit register array to a
           transposed SMEM view; the wgmma reads q transposed instead.

Buffers (SMEM, 128-byte swizzle on every tile)
----------------------------------------------
  rows:    input [R, 128], e4m3 [R, 128], scales [1, R] float32 (48.5 KiB at R = 128,
           bf16)
  weights: input 32 KiB, e4m3 identity 16 KiB, q (then q^T: one buffer) 16 KiB,
           column scales 512 B: 64.5 KiB
  plus the 2 KiB Pallas reserves for reductions: about 50.5 and 66.5 KiB (three
  weight CTAs per SM fit)

Synchronisation
---------------
Rows: one TMA barrier, waited for before the input is read. Weights: two (the input,
the identity), each waited for before its first use; q^T overwrites q's buffer only
after q's TMA stores have read it (`wait_smem_to_gmem(read_only)`). `commit_smem()`
before every TMA store; the stores are waited for before the CTA exits.
A CTA reads and writes only its own tile: no atomics, no order between CTAs.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import device as device_lib
from pallas_kernels.fp8 import FP8_DTYPE, QUANT_BLOCK, scale_and_inverse
from pallas_kernels.grouped_gemm import _swizzle_transforms, resolve_interpret


def _transforms(dtype):
  """The swizzle of a [rows, 128] tile of dtype (128 bytes for every dtype here)."""
  return _swizzle_transforms(dtype, QUANT_BLOCK)


def rows_tile(m: int) -> int:
  """The row tile of `quantise_rows_t` for M rows (M a multiple of 64)."""
  return 128 if m % 128 == 0 else 64


def _rows_kernel(x_gmem, q_gmem, s_gmem, x_smem, q_smem, s_smem, barrier, *, rows: int):
  mi, kb = lax.axis_index("m"), lax.axis_index("k")
  rs, cs = pl.ds(mi * rows, rows), pl.ds(kb * QUANT_BLOCK, QUANT_BLOCK)
  plgpu.copy_gmem_to_smem(x_gmem.at[rs, cs], x_smem, barrier)
  plgpu.barrier_wait(barrier)
  x = plgpu.load(x_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
  s, inv = scale_and_inverse(jnp.max(jnp.abs(x), axis=1))
  q_smem[...] = (x * lax.broadcast_in_dim(inv, x.shape, [0])).astype(FP8_DTYPE)
  s_smem[0, :] = s
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_smem, q_gmem.at[rs, cs])
  plgpu.copy_smem_to_gmem(s_smem, s_gmem.at[pl.ds(kb, 1), rs])
  plgpu.wait_smem_to_gmem(0)


ROW_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
WEIGHT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def quantise_rows_t(x, *, interpret=None):
  """x [M, K] (K % 128 == 0, M % 64 == 0; bf16, f16 or f32) -> (q [M, K] e4m3,
  s^T [K/128, M] float32)."""
  m, k = x.shape
  if k % QUANT_BLOCK or m % 64:
    raise ValueError(f"x.shape={x.shape}: K must be a multiple of {QUANT_BLOCK} and M of 64")
  if jnp.dtype(x.dtype) not in ROW_DTYPES:
    raise ValueError(f"x.dtype={x.dtype} must be one of {[d.name for d in ROW_DTYPES]}")
  rows = rows_tile(m)
  kernel = device_lib.kernel(
      functools.partial(_rows_kernel, rows=rows),
      kernel_name="fp8_quantise_rows",
      out_type=(jax.ShapeDtypeStruct((m, k), FP8_DTYPE),
                jax.ShapeDtypeStruct((k // QUANT_BLOCK, m), jnp.float32)),
      grid=(m // rows, k // QUANT_BLOCK),
      grid_names=("m", "k"),
      scratch_types=[plgpu.SMEM((rows, QUANT_BLOCK), x.dtype, transforms=_transforms(x.dtype)),
                     plgpu.SMEM((rows, QUANT_BLOCK), FP8_DTYPE,
                                transforms=_transforms(FP8_DTYPE)),
                     plgpu.SMEM((1, rows), jnp.float32),
                     plgpu.Barrier()],
      interpret=resolve_interpret(interpret),
  )
  return kernel(x)


def _weight_kernel(w_gmem, eye_gmem, q_gmem, qt_gmem, sf_gmem, sd_gmem,
                   w_smem, eye_smem, q_smem, s_smem, barriers):
  g, kb, nb = lax.axis_index("g"), lax.axis_index("kb"), lax.axis_index("nb")
  ks, ns = pl.ds(kb * QUANT_BLOCK, QUANT_BLOCK), pl.ds(nb * QUANT_BLOCK, QUANT_BLOCK)
  plgpu.copy_gmem_to_smem(w_gmem.at[g, ks, ns], w_smem, barriers.at[0])
  plgpu.copy_gmem_to_smem(eye_gmem, eye_smem, barriers.at[1])
  plgpu.barrier_wait(barriers.at[0])
  x = plgpu.load(w_smem, layout=plgpu.Layout.WGMMA).astype(jnp.float32)
  row_amax = jnp.max(jnp.abs(x), axis=1)
  # the max over rows of the rows' amax, in every column: the block's amax
  amax = jnp.max(lax.broadcast_in_dim(row_amax, x.shape, [0]), axis=0)
  s, inv = scale_and_inverse(amax)
  q_smem[...] = (x * lax.broadcast_in_dim(inv, x.shape, [1])).astype(FP8_DTYPE)
  s_smem[0, :] = s
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_smem, q_gmem.at[g, ks, ns])
  plgpu.copy_smem_to_gmem(s_smem, sf_gmem.at[g, pl.ds(kb, 1), ns])
  plgpu.copy_smem_to_gmem(s_smem, sd_gmem.at[g, pl.ds(nb, 1), ks])

  # q^T = I @ q^T: an e4m3 wgmma with q as its K-major B operand, float32 out (every
  # output one product 1 * q plus zeros: exact), converted back to e4m3 (exact)
  plgpu.barrier_wait(barriers.at[1])

  def transpose(acc_ref):
    plgpu.wgmma(acc_ref, eye_smem, q_smem.transpose((1, 0)))
    return acc_ref[...]

  qt = pl.run_scoped(transpose, plgpu.ACC((QUANT_BLOCK, QUANT_BLOCK), jnp.float32))
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # q's store has read q_smem
  q_smem[...] = qt.astype(FP8_DTYPE)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(q_smem, qt_gmem.at[g, ns, ks])
  plgpu.wait_smem_to_gmem(0)


def quantise_weight_t(w, *, interpret=None):
  """w [G, K, N] bf16 or f16 (K, N multiples of 128) -> (q [G, K, N], q^T [G, N, K],
  column scales [G, K/128, N] (B = w^T), column scales [G, N/128, K] (B = w))."""
  g, k, n = w.shape
  if k % QUANT_BLOCK or n % QUANT_BLOCK:
    raise ValueError(f"w.shape={w.shape}: K and N must be multiples of {QUANT_BLOCK}")
  if jnp.dtype(w.dtype) not in WEIGHT_DTYPES:
    raise ValueError(f"w.dtype={w.dtype} must be bfloat16 or float16 (the kernel's input "
                     f"tile; `fp8.quantise_blocks` takes other dtypes)")
  kb, nb = k // QUANT_BLOCK, n // QUANT_BLOCK
  tile = (QUANT_BLOCK, QUANT_BLOCK)
  kernel = device_lib.kernel(
      _weight_kernel,
      kernel_name="fp8_quantise_weight",
      out_type=(jax.ShapeDtypeStruct((g, k, n), FP8_DTYPE),
                jax.ShapeDtypeStruct((g, n, k), FP8_DTYPE),
                jax.ShapeDtypeStruct((g, kb, n), jnp.float32),
                jax.ShapeDtypeStruct((g, nb, k), jnp.float32)),
      grid=(g, kb, nb),
      grid_names=("g", "kb", "nb"),
      scratch_types=[plgpu.SMEM(tile, w.dtype, transforms=_transforms(w.dtype)),
                     plgpu.SMEM(tile, FP8_DTYPE, transforms=_transforms(FP8_DTYPE)),
                     plgpu.SMEM(tile, FP8_DTYPE, transforms=_transforms(FP8_DTYPE)),
                     plgpu.SMEM((1, QUANT_BLOCK), jnp.float32),
                     plgpu.Barrier(num_barriers=2)],
      interpret=resolve_interpret(interpret),
  )
  return kernel(w, jnp.eye(QUANT_BLOCK, dtype=FP8_DTYPE))


__all__ = ["quantise_rows_t", "quantise_weight_t", "rows_tile", "ROW_DTYPES", "WEIGHT_DTYPES"]
