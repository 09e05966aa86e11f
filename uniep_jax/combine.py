"""Step 4 (arithmetic): the weighted top-k sum.

    out[t] = sum_{k=0..K-1} weight[t, k] * y[t, k]     accumulated in float32,
                                                      in slot order, cast once.
The order is fixed (a Python loop over K, not a reduction XLA may reorder), so
every backend that produces the same y produces the same bits.

Backward: autodiff's transpose of that loop, with one rule of our own: the output's
cotangent dy is rounded to its dtype and materialised (`optimization_barrier`) before
each slot's row dy_k = dtype(w[t, k] * f32(dy[t])) is formed. Without it XLA's GPU
compiler may drop the f32 -> bf16 -> f32 round trip between dy's producer and this
multiply (excess precision, on by default), so dy_k would depend on what produced dy
and on fusion; the de-duplicated dy dispatch (`uniep_jax/dedup.py`), which sends dy
itself and multiplies on the owner, would then differ from the plain combine (2x H200,
2026-11-27: `uniep_dd` = `uniep` failed in bench/check_moe_gpu.py without this rule).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _weighted_sum(y: jax.Array, weights: jax.Array, out_dtype) -> jax.Array:
  top_k = y.shape[1]
  acc = weights[:, 0, None] * y[:, 0].astype(jnp.float32)
  for k in range(1, top_k):
    acc = acc + weights[:, k, None] * y[:, k].astype(jnp.float32)
  return acc.astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _weighted_topk_sum(y, weights, out_dtype):
  return _weighted_sum(y, weights, out_dtype)


def _fwd(y, weights, out_dtype):
  return _weighted_sum(y, weights, out_dtype), (y, weights)


def round_cotangent(dy: jax.Array) -> jax.Array:
  """dy rounded to its dtype and materialised (module docstring): every backward of the
  combine forms its slot rows from this, never from dy's wider producer."""
  return jax.lax.optimization_barrier(dy)


def weighted_topk_sum_vjp(y: jax.Array, weights: jax.Array, dy: jax.Array, out_dtype):
  """(dy_slots [T, K, H] in y's dtype, d_weights [T, K]): the backward pass of
  `weighted_topk_sum` at cotangent dy, which the caller has passed through
  `round_cotangent`."""
  _, vjp = jax.vjp(lambda a, w: _weighted_sum(a, w, out_dtype), y, weights)
  return vjp(dy)


def _bwd(out_dtype, res, dy):
  y, weights = res
  return weighted_topk_sum_vjp(y, weights, round_cotangent(dy), out_dtype)


_weighted_topk_sum.defvjp(_fwd, _bwd)


def weighted_topk_sum(y: jax.Array, weights: jax.Array, out_dtype=None) -> jax.Array:
  """y [T, K, H] (any float dtype), weights [T, K] f32 -> [T, H] in `out_dtype`."""
  return _weighted_topk_sum(y, weights, jnp.dtype(out_dtype or y.dtype))
