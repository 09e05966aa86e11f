"""E4M3 quantisation with block scales: the numbers format of the FP8 grouped GEMM.

Format
------
A quantised operand is a pair (q, s): q in float8_e4m3fn, s float32, and the
value it stands for is q * s, s shared by one block of QUANT_BLOCK (128) elements
along the contraction dimension:

  activations  [M, K]     one scale per (row, 128 columns)   s [M, K / 128]
  weights      [G, K, N]  one scale per (128 x 128) block    s [G, K / 128, N / 128]

Scales are powers of two: s = 2^e with e the smallest exponent such that
amax(block) / s <= 448 (E4M3's largest finite value), so

  * q = round_to_nearest_even(x / s) is the only rounding (x / s is exact), and
    saturation never happens: |x / s| <= 448 by construction;
  * dequantisation q * s is exact, and so is applying a scale to a float32
    partial sum inside a kernel (while the products of scales and partial sums stay
    normal float32 numbers, as they do for any data short of 2^-126 or 2^127): the
    FP8 GEMM computes the product of the dequantised operands, its only other
    roundings those of its accumulation;
  * an all-zero block gets s = 1 (q = 0); a block holding inf gets s = NaN, and so
    does one holding NaN where the max propagates NaNs (the GPU; XLA on the CPU may
    drop a NaN from a max), while a NaN element quantises to NaN either way: the
    product is NaN (the training loop then skips the step), nothing non-finite is
    hidden by a scale.
Everything is elementwise or a fixed-order max: bit for bit deterministic.

This module is the format's XLA formulation and the tests' reference; the FP8 FFN
quantises with `fp8_quantise.py`'s kernels, which compute the same bits in one pass
over HBM.

K (and, for weights, N) not a multiple of 128: the operand is zero-padded to the
next multiple first (zeros quantise to zeros and add nothing).
"""

from __future__ import annotations

from jax import lax
import jax.numpy as jnp

from pallas_kernels.grouped_gemm import _pad_axis, _round_up

QUANT_BLOCK = 128
E4M3_MAX = 448.0
FP8_DTYPE = jnp.float8_e4m3fn
# the smallest scale: 2^-126, the smallest normal float32
_MIN_EXP = -126


def scale_and_inverse(amax):
  """(s, 1 / s), float32, elementwise, from a block's amax >= 0: s the smallest power
  of two with amax / s <= E4M3_MAX, at least 2^-126; s = 1 where amax == 0; both NaN
  where amax is inf or NaN.

  Integer operations on amax's bits only (no division, no frexp), so XLA and the
  quantisation kernels (`fp8_quantise.py`) run the same operations and agree bit for
  bit. With amax = 1.f * 2^E: amax / 2^(E - 8) = 1.f * 256 <= 448 exactly when
  1.f <= 1.75 (fraction bits <= 0x600000), else 2^(E - 7) is the smallest; 2^(E - 9)
  never is (1.f * 512 > 448). A finite amax gives E - 7 <= 120: 1 / s is a normal
  float32, so x * (1 / s) is as exact as x / s."""
  bits = lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.int32) & 0x7FFFFFFF
  biased = lax.shift_right_logical(bits, 23)               # E + 127
  over = (bits & 0x7FFFFF) > 0x600000                       # 1.f > 1.75
  field = biased - 8 + jnp.where(over, 1, 0)                # s = 2^(field - 127)
  field = jnp.maximum(field, _MIN_EXP + 127)                # at least 2^-126 (subnormal amax too)
  field = jnp.where(bits == 0, 127, field)                  # amax == 0: s = 1
  finite = biased < 255
  as_float = lambda f: lax.bitcast_convert_type(lax.shift_left(f, 23), jnp.float32)
  nan = jnp.float32(jnp.nan)
  return (jnp.where(finite, as_float(field), nan),
          jnp.where(finite, as_float(254 - field), nan))


def quantise_rows(x):
  """x [M, K] -> (q [M, Kp] e4m3, s [M, Kp / 128] float32), Kp = round_up(K, 128):
  one scale per row and 128 consecutive columns."""
  m, k = x.shape
  kp = _round_up(k, QUANT_BLOCK)
  xb = _pad_axis(x, 1, kp).astype(jnp.float32).reshape(m, kp // QUANT_BLOCK, QUANT_BLOCK)
  s, inv = scale_and_inverse(jnp.max(jnp.abs(xb), axis=2))
  q = (xb * inv[:, :, None]).astype(FP8_DTYPE)
  return q.reshape(m, kp), s


def _blocks(w):
  """w [G, K, N] zero-padded to multiples of 128 and viewed as [G, Kb, 128, Nb, 128]."""
  g, k, n = w.shape
  kp, np_ = _round_up(k, QUANT_BLOCK), _round_up(n, QUANT_BLOCK)
  wp = _pad_axis(_pad_axis(w, 1, kp), 2, np_)
  return wp.reshape(g, kp // QUANT_BLOCK, QUANT_BLOCK, np_ // QUANT_BLOCK, QUANT_BLOCK)


def _scaled(wb, inv):
  """e4m3 of the blocks wb [G, Bk, 128, Bn, 128] times inv [G, Bk, Bn] (1 / scale, a
  power of two: exact), as [G, Bk * 128, Bn * 128]."""
  g, bk, _, bn, _ = wb.shape
  q = (wb.astype(jnp.float32) * inv[:, :, None, :, None]).astype(FP8_DTYPE)
  return q.reshape(g, bk * QUANT_BLOCK, bn * QUANT_BLOCK)


def quantise_blocks(w, *, transposed: bool = False):
  """w [G, K, N] -> (q [G, Kp, Np] e4m3, s [G, Kp / 128, Np / 128] float32): one
  scale per 128 x 128 block. The same (q, s) serve w (contraction over K) and its
  transpose (contraction over N). transposed: also q^T [G, Np, Kp] (the K-major copy
  of the contraction over K), quantised from w's transposed blocks, not transposed
  in e4m3 (one pass less over the weight); returns (q, s, q^T)."""
  wb = _blocks(w)
  # |w| and its max are exact in w's dtype; the scale's reciprocal is a power of two
  s, inv = scale_and_inverse(jnp.max(jnp.abs(wb), axis=(2, 4)))
  q = _scaled(wb, inv)
  if not transposed:
    return q, s
  return q, s, _scaled(_blocks(jnp.swapaxes(w, 1, 2)), jnp.swapaxes(inv, 1, 2))


def dequantise_rows(q, s):
  """Inverse of `quantise_rows` (exact): [M, Kp] float32."""
  m, kp = q.shape
  return (q.astype(jnp.float32).reshape(m, kp // QUANT_BLOCK, QUANT_BLOCK)
          * s[:, :, None]).reshape(m, kp)


def dequantise_blocks(q, s):
  """Inverse of `quantise_blocks` (exact): [G, Kp, Np] float32."""
  g, kp, np_ = q.shape
  qb = q.astype(jnp.float32).reshape(g, kp // QUANT_BLOCK, QUANT_BLOCK,
                                     np_ // QUANT_BLOCK, QUANT_BLOCK)
  return (qb * s[:, :, None, :, None]).reshape(g, kp, np_)


def column_scales(block_scales, axis: int):
  """Per-output-column scales of a block-quantised weight, block-major, for the FP8
  GEMM's B operand. block_scales [G, Kb, Nb]:
    axis=2  B = w^T (contraction over K, output columns N): [G, Kb, Nb * 128]
    axis=1  B = w   (contraction over N, output columns K): [G, Nb, Kb * 128]."""
  if axis == 2:
    return jnp.repeat(block_scales, QUANT_BLOCK, axis=2)
  if axis == 1:
    return jnp.repeat(jnp.swapaxes(block_scales, 1, 2), QUANT_BLOCK, axis=2)
  raise ValueError(f"{axis=} must be 1 or 2")


__all__ = ["QUANT_BLOCK", "E4M3_MAX", "FP8_DTYPE", "scale_and_inverse",
           "quantise_rows", "quantise_blocks", "dequantise_rows", "dequantise_blocks",
           "column_scales"]
