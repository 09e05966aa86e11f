"""Step 3: the expert FFN (SwiGLU) over rows grouped by expert.

Math, exactly (for every backend):
    h = x @ w_gate[e]        u = x @ w_up[e]           float32 accumulation
    a = silu(h) * u          in float32, then cast to x.dtype
    y = a @ w_down[e]        float32 accumulation, cast to x.dtype
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _precision(dtype):
  """float32 operands get full float32 products (no TF32 on GPUs)."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def swiglu_activation(h: jax.Array, u: jax.Array, dtype) -> jax.Array:
  return (jax.nn.silu(h) * u).astype(dtype)


def swiglu_ragged_dot(x, w_gate, w_up, w_down, group_sizes):
  """Grouped FFN with `lax.ragged_dot`. x [M, H] rows grouped by expert
  (group_sizes [G] int32, rows past sum(group_sizes) come back zero)."""
  f32, hi = jnp.float32, _precision(x.dtype)
  h = jax.lax.ragged_dot(x, w_gate, group_sizes, precision=hi, preferred_element_type=f32)
  u = jax.lax.ragged_dot(x, w_up, group_sizes, precision=hi, preferred_element_type=f32)
  a = swiglu_activation(h, u, x.dtype)
  y = jax.lax.ragged_dot(a, w_down, group_sizes, precision=hi, preferred_element_type=f32)
  return y.astype(x.dtype)


def swiglu_batched(x, w_gate, w_up, w_down):
  """Per-expert FFN over a fixed-capacity batch. x [G, C, H] -> [G, C, H]."""
  f32, hi = jnp.float32, _precision(x.dtype)
  h = jnp.einsum("gch,ghf->gcf", x, w_gate, precision=hi, preferred_element_type=f32)
  u = jnp.einsum("gch,ghf->gcf", x, w_up, precision=hi, preferred_element_type=f32)
  a = swiglu_activation(h, u, x.dtype)
  y = jnp.einsum("gcf,gfh->gch", a, w_down, precision=hi, preferred_element_type=f32)
  return y.astype(x.dtype)


def swiglu_pallas(x, w_gate, w_up, w_down, group_sizes, *, kernel_config):
  """Grouped FFN with our Pallas Mosaic GPU grouped GEMM (interpret mode on CPU)."""
  from pallas_kernels.grouped_gemm import grouped_swiglu_ffn  # heavy import, lazy
  return grouped_swiglu_ffn(x, w_gate, w_up, w_down, group_sizes, config=kernel_config)
