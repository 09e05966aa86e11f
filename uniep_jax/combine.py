"""Step 4 (arithmetic): the weighted top-k sum.

    out[t] = sum_{k=0..K-1} weight[t, k] * y[t, k]     accumulated in float32,
                                                      in slot order, cast once.
The order is fixed (a Python loop over K, not a reduction XLA may reorder), so
every backend that produces the same y produces the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def weighted_topk_sum(y: jax.Array, weights: jax.Array, out_dtype=None) -> jax.Array:
  """y [T, K, H] (any float dtype), weights [T, K] f32 -> [T, H] in `out_dtype`."""
  out_dtype = out_dtype or y.dtype
  top_k = y.shape[1]
  acc = weights[:, 0, None] * y[:, 0].astype(jnp.float32)
  for k in range(1, top_k):
    acc = acc + weights[:, k, None] * y[:, k].astype(jnp.float32)
  return acc.astype(out_dtype)
