"""Step 5, combine: the expert outputs back home and the weighted top-k sum.

    collect:  receive layout --transport.return_rows--> sorted rows
              --unsort_rows--> [T, K, H] (assignment order)
    sum:      out[t] = sum_{k=0..K-1} weight[t, k] * y[t, k]   accumulated in float32,
                                                                in slot order, cast once.
The order is fixed (a Python loop over K, not a reduction XLA may reorder), so every
backend that produces the same y produces the same bits.

Backward: autodiff's transpose of that loop, with one rule of our own: the output's
cotangent dy is rounded to its dtype and materialised (`optimization_barrier`) before
each slot's row dy_k = dtype(w[t, k] * f32(dy[t])) is formed. Without it XLA's GPU
compiler may drop the f32 -> bf16 -> f32 round trip between dy's producer and this
multiply (excess precision, on by default), so dy_k would depend on what produced dy
and on fusion; the de-duplicated dy dispatch (`combine_unique`), which sends dy itself
and multiplies on the owner, would then differ from the plain combine.

`combine_unique` ("uniep"): the plain combine forward; its backward sends each
(token, owner) pair's dy row once over NVLink and lets the owner form every slot's row
dtype(w * f32(dy)) with the slot's weight, which the plan's all_gather delivered
(`layout.DedupPlan.recv_weights`): the same multiply and rounding, so the same bits.
`combine_sorted_rows` (one rank on the expert axis, Pallas backends): the plain combine
forward; its backward forms each sorted row's dtype(w * f32(dy)) in one pass of the
weighted live-rows copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import row_gather
from uniep_jax.dispatch import unsort_rows
from uniep_jax.layout import DedupPlan, DispatchPlan
from uniep_jax.rows import sum_to_type_of, zero_cotangent
from uniep_jax.transport import return_rows, send_unique


def _weighted_sum(y: jax.Array, weights: jax.Array, out_dtype) -> jax.Array:
  top_k = y.shape[1]
  acc = weights[:, 0, None] * y[:, 0].astype(jnp.float32)
  for k in range(1, top_k):
    acc = acc + weights[:, k, None] * y[:, k].astype(jnp.float32)
  return acc.astype(out_dtype)


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _weighted_topk_sum(y, weights, out_dtype):
  return _weighted_sum(y, weights, out_dtype)


_weighted_topk_sum.defvjp(
    lambda y, weights, out_dtype: (_weighted_sum(y, weights, out_dtype), (y, weights)),
    lambda out_dtype, res, dy: weighted_topk_sum_vjp(*res, round_cotangent(dy), out_dtype))


def weighted_topk_sum(y: jax.Array, weights: jax.Array, out_dtype=None) -> jax.Array:
  """y [T, K, H] (any float dtype), weights [T, K] f32 -> [T, H] in `out_dtype`."""
  return _weighted_topk_sum(y, weights, jnp.dtype(out_dtype or y.dtype))


def combine_cotangent(dy, y_assign, weights, out_dtype):
  """(dy as the combine's backward uses it (`round_cotangent`), d_weights [T, K], the
  plain combine's): the half of the combine's backward that stays at home, for the
  backward passes that form each slot's row dtype(w * f32(dy)) themselves."""
  dy = round_cotangent(dy)
  _, d_weights = weighted_topk_sum_vjp(y_assign, weights, dy, out_dtype)   # slot rows: dead
  return dy, d_weights


def collect(recv, plan: DispatchPlan, *, axis_name, transport: str, transfer=None):
  """Receive layout [recv_rows, H] -> [T, K, H]: each assignment's expert output at home
  (zero for assignments dropped by a receive bound)."""
  return unsort_rows(return_rows(recv, plan, axis_name, transport, transfer), plan)


def combine(recv, weights, plan: DispatchPlan, *, axis_name, transport: str, transfer=None,
            out_dtype=None):
  """Receive layout [recv_rows, H] -> y [T, H]: `collect`, then `weighted_topk_sum`."""
  y_assign = collect(recv, plan, axis_name=axis_name, transport=transport, transfer=transfer)
  return weighted_topk_sum(y_assign, weights, out_dtype=out_dtype)


# ---------------------------------------------------------------------------
# "uniep": the combine whose backward de-duplicates the dy dispatch
# ---------------------------------------------------------------------------
def unique_dy_rows(dy, y_assign, weights, plan: DispatchPlan, dplan: DedupPlan, *, axis_name,
                   transfer, out_dtype, rows_dtype):
  """The combine's backward with the dy dispatch de-duplicated: (d_recv [recv_rows, H] in
  rows_dtype, each slot's row dtype(w * f32(dy)) on its owner; d_weights [T, K], the
  plain combine's)."""
  dy, d_weights = combine_cotangent(dy, y_assign, weights, out_dtype)
  d_recv = send_unique(dy.astype(rows_dtype), plan, dplan, axis_name, transfer,
                       scale=dplan.recv_weights)
  return d_recv, d_weights


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def combine_unique(y_recv, weights, plan: DispatchPlan, dplan: DedupPlan, axis_name, transfer,
                   out_dtype):
  """Receive layout [recv_rows, H] -> y [T, H] in out_dtype over NVLink: `combine`'s bits,
  forward and backward (module docstring)."""
  return _combine_unique_fwd(y_recv, weights, plan, dplan, axis_name, transfer, out_dtype)[0]


def _combine_unique_fwd(y_recv, weights, plan, dplan, axis_name, transfer, out_dtype):
  y_assign = collect(y_recv, plan, axis_name=axis_name, transport="nvlink", transfer=transfer)
  y = weighted_topk_sum(y_assign, weights, out_dtype=out_dtype)
  return y, (y_assign, weights, plan, dplan, y_recv[:0])


def _combine_unique_bwd(axis_name, transfer, out_dtype, res, dy):
  y_assign, weights, plan, dplan, y_recv_like = res
  d_recv, d_weights = unique_dy_rows(dy, y_assign, weights, plan, dplan, axis_name=axis_name,
                                     transfer=transfer, out_dtype=out_dtype,
                                     rows_dtype=y_recv_like.dtype)
  return (sum_to_type_of(d_recv, y_recv_like), d_weights, zero_cotangent(plan),
          zero_cotangent(dplan))


combine_unique.defvjp(_combine_unique_fwd, _combine_unique_bwd)


# ---------------------------------------------------------------------------
# One rank on the expert axis: the backward in one weighted row copy
# ---------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def combine_sorted_rows(y_sorted, weights, plan: DispatchPlan, out_dtype):
  """One rank on the expert axis ("local" transport, no receive bound, Pallas backends):
  the expert outputs in sorted order [T*K, H] -> y [T, H], the plain combine forward. Its
  backward forms each sorted row's cotangent dtype(w * f32(dy)) in one pass of the
  weighted live-rows copy (the plain combine's rounding, as `unique_dy_rows`' owner
  does), where the plain backward writes the [T, K, H] slot rows and then permutes them;
  d_weights as the plain combine's."""
  return weighted_topk_sum(unsort_rows(y_sorted, plan), weights, out_dtype)


def _sorted_fwd(y_sorted, weights, plan, out_dtype):
  return combine_sorted_rows(y_sorted, weights, plan, out_dtype), (y_sorted, weights, plan)


def _sorted_bwd(out_dtype, res, dy):
  y_sorted, weights, plan = res
  dy, d_weights = combine_cotangent(dy, unsort_rows(y_sorted, plan), weights, out_dtype)
  n = plan.sort_order.shape[0]
  scale = jnp.take(weights.reshape(-1), plan.sort_order, axis=0).astype(jnp.float32)
  d_sorted = row_gather.gather_live_rows(dy.astype(y_sorted.dtype), plan.sorted_tokens,
                                         jnp.int32(n), out_rows=n, scale=scale)
  return d_sorted, d_weights, zero_cotangent(plan)


combine_sorted_rows.defvjp(_sorted_fwd, _sorted_bwd)
