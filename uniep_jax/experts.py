"""Step 4, experts: the SwiGLU FFN over rows grouped by expert.

Math, exactly (for every backend); w_gate_up[e] = [w_gate[e] | w_up[e]] ([H, 2F],
`uniep_jax.params`):
    [h | u] = x @ w_gate_up[e]                         float32 accumulation
    a = silu(h) * u          in float32, then cast to x.dtype
    y = a @ w_down[e]        float32 accumulation, cast to x.dtype
Three implementations: `swiglu_ragged_dot` ("xla_dropless"), `swiglu_batched`
("xla_capacity": fixed-capacity batches) and `swiglu_pallas` ("pallas", "uniep": the
grouped GEMM of pallas_kernels/grouped_gemm.py, whose SwiGLU derivative runs in the
da GEMM's epilogue with the same formula, `swiglu_grad`; with precision "fp8" the
FP8 GEMMs of pallas_kernels/fp8_gemm.py, same formulas on quantised operands).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.fp8_gemm import (Fp8Config, ffn_zero_window, fp8_grouped_swiglu_ffn,
                                     fp8_swiglu_backward, fp8_swiglu_forward)
from pallas_kernels.grouped_gemm import (grouped_swiglu_ffn, split_gate_up, swiglu_backward,
                                         swiglu_forward, swiglu_grad)
from uniep_jax.rows import int_cotangent, sum_to_type_of


def _precision(dtype):
  """float32 operands get full float32 products (no TF32 on GPUs)."""
  return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def swiglu_activation(h: jax.Array, u: jax.Array, dtype) -> jax.Array:
  return (jax.nn.silu(h) * u).astype(dtype)


# ---------------------------------------------------------------------------
# The XLA experts. Their backward pass is written out (custom_vjp) so that every
# GEMM takes x.dtype operands with float32 accumulation, as the Pallas kernels'
# backward does: JAX's own transpose of a dot with a float32 result feeds the
# float32 cotangents (dh, du) straight into the backward GEMMs, which then run on
# float32 operands (slower, and twice the bytes).
#   da = dy @ w_down^T (f32 out);  s = sigmoid(h)      (h, u: the f32 accumulators)
#   dh = da * u * s * (1 + h (1 - s)),  du = da * h * s,  both cast to x.dtype
#   dx = [dh | du] @ w_gate_up^T (one GEMM over K = 2F, cast);
#   dw_gate_up = x^T [dh | du], dw_down = a^T dy (f32 accumulation, cast to the
#   weights' dtype)
# ---------------------------------------------------------------------------
def _swiglu_grads(x, w_gate_up, w_down, h, u, a, dy, *, mm, mm_t, wgrad, wgrad_dtype=None):
  """The backward pass above; mm(p, w): p @ w, mm_t(p, w): p @ w^T (per group),
  wgrad(p, q): p^T q (per group), all with float32 accumulation; the weight gradients
  in `wgrad_dtype` (default: the weights' own)."""
  dt = x.dtype
  dy = dy.astype(dt)
  da = mm_t(dy, w_down)
  dhu = jnp.concatenate(swiglu_grad(da, h, u), axis=-1).astype(dt)
  dx = sum_to_type_of(mm_t(dhu, w_gate_up).astype(dt), x)
  return (dx, sum_to_type_of(wgrad(x, dhu).astype(wgrad_dtype or w_gate_up.dtype), w_gate_up),
          sum_to_type_of(wgrad(a, dy).astype(wgrad_dtype or w_down.dtype), w_down))


def _ragged_ops(x, group_sizes):
  f32, hi = jnp.float32, _precision(x.dtype)
  wgrad_dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[])
  return dict(
      mm=lambda p, w: jax.lax.ragged_dot(p, w, group_sizes, precision=hi,
                                         preferred_element_type=f32),
      mm_t=lambda p, w: jax.lax.ragged_dot(p, jnp.swapaxes(w, 1, 2), group_sizes, precision=hi,
                                           preferred_element_type=f32),
      wgrad=lambda p, q: jax.lax.ragged_dot_general(p, q, group_sizes, wgrad_dims, precision=hi,
                                                    preferred_element_type=f32))


def _ragged_forward(x, w_gate_up, w_down, group_sizes):
  ops = _ragged_ops(x, group_sizes)
  h, u = split_gate_up(ops["mm"](x, w_gate_up))
  a = swiglu_activation(h, u, x.dtype)
  return ops["mm"](a, w_down).astype(x.dtype), (h, u, a)


@jax.custom_vjp
def swiglu_ragged_dot(x, w_gate_up, w_down, group_sizes):
  """Grouped FFN with `lax.ragged_dot`. x [M, H] rows grouped by expert
  (group_sizes [G] int32, rows past sum(group_sizes) come back zero),
  w_gate_up [G, H, 2F], w_down [G, F, H]."""
  return _ragged_forward(x, w_gate_up, w_down, group_sizes)[0]


def _ragged_fwd(x, w_gate_up, w_down, group_sizes):
  y, (h, u, a) = _ragged_forward(x, w_gate_up, w_down, group_sizes)
  return y, (x, w_gate_up, w_down, group_sizes, h, u, a)


def _ragged_bwd(res, dy):
  x, w_gate_up, w_down, group_sizes, h, u, a = res
  grads = _swiglu_grads(x, w_gate_up, w_down, h, u, a, dy, **_ragged_ops(x, group_sizes))
  return grads + (int_cotangent(group_sizes),)


swiglu_ragged_dot.defvjp(_ragged_fwd, _ragged_bwd)


def _batched_ops(x):
  f32, hi = jnp.float32, _precision(x.dtype)
  return dict(
      mm=lambda p, w: jnp.einsum("gcf,gfh->gch", p, w, precision=hi, preferred_element_type=f32),
      mm_t=lambda p, w: jnp.einsum("gch,gfh->gcf", p, w, precision=hi,
                                   preferred_element_type=f32),
      wgrad=lambda p, q: jnp.einsum("gcf,gch->gfh", p, q, precision=hi,
                                    preferred_element_type=f32))


def _batched_forward(x, w_gate_up, w_down):
  mm = _batched_ops(x)["mm"]
  h, u = split_gate_up(mm(x, w_gate_up))
  a = swiglu_activation(h, u, x.dtype)
  return mm(a, w_down).astype(x.dtype), (h, u, a)


@jax.custom_vjp
def swiglu_batched(x, w_gate_up, w_down):
  """Per-expert FFN over a fixed-capacity batch. x [G, C, H] -> [G, C, H];
  w_gate_up [G, H, 2F], w_down [G, F, H]."""
  return _batched_forward(x, w_gate_up, w_down)[0]


def _batched_fwd(x, w_gate_up, w_down):
  y, (h, u, a) = _batched_forward(x, w_gate_up, w_down)
  return y, (x, w_gate_up, w_down, h, u, a)


def _batched_bwd(res, dy):
  x, w_gate_up, w_down, h, u, a = res
  return _swiglu_grads(x, w_gate_up, w_down, h, u, a, dy, **_batched_ops(x))


swiglu_batched.defvjp(_batched_fwd, _batched_bwd)


# ---------------------------------------------------------------------------
# The grouped FFN as a forward/backward pair, for callers that wrap it in their own VJP
# (uniep_jax/replicas.py sums the weight gradients of several groups in float32):
# kernel_config None is "xla_dropless"'s `swiglu_ragged_dot`, a KernelConfig the Pallas
# grouped GEMM of "pallas" and "uniep" (`swiglu_pallas`), the same math and bits as those.
# ---------------------------------------------------------------------------
def fp8_config(kernel_config) -> Fp8Config:
  """The FP8 GEMM's tiling (pallas_kernels/fp8_gemm.py: its defaults) on the layer's
  persistent grid (KernelConfig.num_sms)."""
  return Fp8Config(num_sms=kernel_config.num_sms)


def _fp8_zero_window(kernel_config, zero_dead_rows: bool):
  return ffn_zero_window(fp8_config(kernel_config), kernel_config, zero_dead_rows)


def grouped_forward(x, w_gate_up, w_down, group_sizes, *, kernel_config=None,
                    zero_dead_rows: bool = True, precision: str = "bf16", x_quantised=None):
  """(y, residuals) of the grouped SwiGLU FFN (see `grouped_backward`); x_quantised
  (precision "fp8"): x's e4m3 rows and scales, x their dequantisation (`swiglu_pallas`)."""
  if kernel_config is None:
    return _ragged_forward(x, w_gate_up, w_down, group_sizes)
  if precision == "fp8":
    return fp8_swiglu_forward(x, w_gate_up, w_down, group_sizes,
                              config=fp8_config(kernel_config),
                              zero_window=_fp8_zero_window(kernel_config, zero_dead_rows),
                              x_quantised=x_quantised)
  zw = None if zero_dead_rows else kernel_config.block_k
  return swiglu_forward(x, w_gate_up, w_down, group_sizes, config=kernel_config, zero_window=zw)


def grouped_backward(x, w_gate_up, w_down, group_sizes, residuals, dy, *, kernel_config=None,
                     zero_dead_rows: bool = True, wgrad_dtype=None, precision: str = "bf16"):
  """(dx, dw_gate_up, dw_down) of the grouped SwiGLU FFN from `grouped_forward`'s
  residuals, the weight gradients in `wgrad_dtype` (default: the weights' own)."""
  if kernel_config is None:
    h, u, a = residuals
    return _swiglu_grads(x, w_gate_up, w_down, h, u, a, dy, wgrad_dtype=wgrad_dtype,
                         **_ragged_ops(x, group_sizes))
  if precision == "fp8":
    return fp8_swiglu_backward(
        x, group_sizes, residuals, dy, config=fp8_config(kernel_config),
        wgrad_config=kernel_config, wgrad_dtype=wgrad_dtype,
        zero_window=_fp8_zero_window(kernel_config, zero_dead_rows))
  zw = None if zero_dead_rows else kernel_config.block_k
  a, h, u = residuals
  return swiglu_backward(x, w_gate_up, w_down, group_sizes, a, h, u, dy, config=kernel_config,
                         zero_window=zw, wgrad_dtype=wgrad_dtype)


def swiglu_pallas(x, w_gate_up, w_down, group_sizes, *, kernel_config,
                  zero_dead_rows: bool = True, precision: str = "bf16", x_quantised=None):
  """Grouped FFN with our Pallas Mosaic GPU grouped GEMM (interpret mode on the CPU).
  zero_dead_rows=False: rows of the output (and of dx) past the groups' rows plus a
  block_k window are left undefined (see `grouped_swiglu_ffn`). precision "fp8": the
  FP8 row GEMMs (`fp8_grouped_swiglu_ffn`; its weight gradients on kernel_config);
  x_quantised: x's e4m3 rows and scales as the FP8 dispatch delivered them (x their
  dequantisation), used instead of quantising x again."""
  if precision == "fp8":
    return fp8_grouped_swiglu_ffn(x, w_gate_up, w_down, group_sizes,
                                  config=fp8_config(kernel_config), wgrad_config=kernel_config,
                                  zero_dead_rows=zero_dead_rows, x_quantised=x_quantised)
  return grouped_swiglu_ffn(x, w_gate_up, w_down, group_sizes, config=kernel_config,
                            zero_dead_rows=zero_dead_rows)
