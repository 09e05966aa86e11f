"""Step 4 (arithmetic): the weighted top-k sum.

    out[t] = sum_{k=0..K-1} weight[t, k] * y[t, k]     accumulated in float32,
                                                      in slot order, cast once.
The order is fixed (a Python loop over K, not a reduction XLA may reorder), so
every backend that produces the same y produces the same bits.

Owner partials (`UniEPConfig.slot_reduction="owner_partials"`, EXPERIMENTAL): the
slots of a token that one EP rank owns are summed first, so that a return can carry
one row per (token, owner rank) instead of one per slot:

    term[t, k]    = round(weight[t, k] * f32(y[t, k]))              (activation dtype)
    partial[t, r] = round(fold, in ascending expert order, of f32(term[t, k]) over
                          the slots k whose expert rank r owns)      (activation dtype)
    out[t]        = out_dtype(fold, in rank order, of f32(partial[t, r]) over the
                          ranks r that own at least one of t's slots)
(Expert order, not slot order, inside an owner: the owner's receive layout holds a
token's rows in local-expert order, so its fold reads them in place; a token's experts
are distinct, and rank r owns experts [r * E/R, (r + 1) * E/R), so sorting a token's
slots by expert sorts them by (owner, expert).)
A fold starts from its first term (no + 0.0: the sign of a zero is kept). Every
rounding is explicit (`round_to`: never dropped as excess precision, subnormals kept as
a conversion keeps them), and with 16-bit activations the folds add rounded values only,
so no compiler can contract a multiply into an add: any kernel that rounds and adds in
this order gives these bits (the owner-side pre-sum of uniep_jax/dedup.py, one row per
(token, owner)). With float32 activations the terms are not rounded, and a compiler
may contract w * y into the fold's add (an FMA): bitwise agreement across backends is
then not guaranteed (the Pallas kernels take 16-bit operands). The bits depend on the
EP degree (the owner of expert e at R ranks is e // (E / R)); at one rank the sum is of rounded terms, so not the plain combine's
bits either. The backward treats every rounding as the identity: the plain combine's
backward (d y_k = dtype(w_k * f32(dy)), d w_k = <f32(dy), f32(y_k)>), so the
de-duplicated dy dispatch is unchanged.

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

import flax.struct
import jax
import jax.numpy as jnp

from uniep_jax.dispatch import int_cotangent


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


def combine_cotangent(dy, y_assign, weights, out_dtype):
  """(dy as the combine's backward uses it (`round_cotangent`), d_weights [T, K]: the
  plain combine's): the half of the combine's backward that stays at home, shared by the
  de-duplicated dy dispatch (`dedup.unique_dy_rows`), Kernel D's backward
  (uniep_jax/fused.py) and the one-rank combine (`combine_sorted_rows`), which then form
  each slot's row dtype(w * f32(dy)) themselves."""
  dy = round_cotangent(dy)
  _, d_weights = weighted_topk_sum_vjp(y_assign, weights, dy, out_dtype)   # slot rows: dead
  return dy, d_weights


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def combine_sorted_rows(y_sorted, weights, plan, top_k: int, out_dtype):
  """One rank on the expert axis (transport "local", no receive bound): the expert
  outputs in sorted order [T*K, H] -> y [T, H], the plain combine (`dispatch.collect`,
  then `weighted_topk_sum`) forward. Its backward forms each sorted row's cotangent
  dtype(w * f32(dy)) in one pass of the Pallas weighted live-rows copy
  (`row_gather.gather_live_rows(scale=)`: the plain combine's rounding, as the
  de-duplicated dy dispatch's owner does), where the plain backward writes the [T, K, H]
  slot rows and then permutes them; d_weights as the plain combine's."""
  from uniep_jax.dispatch import unsort_rows
  return weighted_topk_sum(unsort_rows(y_sorted, plan, top_k), weights, out_dtype)


def _sorted_fwd(y_sorted, weights, plan, top_k, out_dtype):
  return combine_sorted_rows(y_sorted, weights, plan, top_k, out_dtype), (y_sorted, weights, plan)


def _sorted_bwd(top_k, out_dtype, res, dy):
  from pallas_kernels.row_gather import gather_live_rows   # GPU kernels, lazy
  from uniep_jax.dispatch import _zero_plan_cotangent, unsort_rows
  y_sorted, weights, plan = res
  dy, d_weights = combine_cotangent(dy, unsort_rows(y_sorted, plan, top_k), weights, out_dtype)
  n = plan.sort_order.shape[0]
  scale = jnp.take(weights.reshape(-1), plan.sort_order, axis=0).astype(jnp.float32)
  d_sorted = gather_live_rows(dy.astype(y_sorted.dtype), plan.sort_order // top_k,
                              jnp.int32(n), out_rows=n, scale=scale)
  return d_sorted, d_weights, _zero_plan_cotangent(plan)


combine_sorted_rows.defvjp(_sorted_fwd, _sorted_bwd)


def round_to(x32: jax.Array, dtype) -> jax.Array:
  """float32 x rounded (to nearest even) to `dtype`, kept in float32: the value of
  x32.astype(dtype).astype(float32), subnormals of `dtype` kept (a kernel's cvt.rn),
  never elided as excess precision. bfloat16 (float32's exponent range):
  `lax.reduce_precision`, an explicit op; other dtypes (float16, whose narrower range
  reduce_precision would flush to zero below 6.1e-5): the conversion, materialised
  (`optimization_barrier`). float32: unchanged."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.float32:
    return x32
  fi = jnp.finfo(dtype)
  if fi.nexp == jnp.finfo(jnp.float32).nexp:
    return jax.lax.reduce_precision(x32, exponent_bits=fi.nexp, mantissa_bits=fi.nmant)
  return jax.lax.optimization_barrier(x32.astype(dtype)).astype(jnp.float32)


def fold_present(acc, have, term, here):
  """One step of a float32 fold over the present terms only: (acc, have) after `term`
  where `here` [T, 1] (the first present term starts the fold: no + 0.0, a zero's sign
  kept). acc None: the first step. The outer fold of `owner_partial_sum` and the home
  fold of the owner-side pre-sum (`dedup.home_fold`) both step with it."""
  if acc is None:
    return term, here
  return jnp.where(here, jnp.where(have, acc + term, term), acc), have | here


def owner_partial_sum(terms: jax.Array, experts: jax.Array, experts_per_owner: int,
                      partial_dtype, out_dtype) -> jax.Array:
  """The two-level sum (module docstring): terms [T, K, H] float32 (already rounded as
  the caller's mode says), experts [T, K] int (each slot's expert, distinct within a
  token), owner rank = expert // experts_per_owner -> [T, H] in out_dtype: per owner a
  fold in ascending expert order rounded to partial_dtype, then a fold of the partials
  in ascending rank order.

  The slots are first sorted by expert (unique keys within a token, so the order is a
  function of `experts` alone); each owner's slots are then a run, folded left to right,
  and each run's rounded sum joins the outer fold at the run's end: K steps whatever the
  EP degree."""
  t, k, h = terms.shape
  order = jnp.argsort(experts.astype(jnp.int32), axis=1)
  own = jnp.take_along_axis(experts.astype(jnp.int32), order, axis=1) // experts_per_owner
  terms = jnp.take_along_axis(terms, order[:, :, None], axis=1)               # [T, K, H]
  inner = outer = have = None
  for j in range(k):
    if j == 0:
      inner = terms[:, 0]
    else:
      starts = (own[:, j] != own[:, j - 1])[:, None]
      inner = jnp.where(starts, terms[:, j], inner + terms[:, j])
    ends = (own[:, j] != own[:, j + 1])[:, None] if j + 1 < k else jnp.ones((t, 1), bool)
    outer, have = fold_present(outer, have, round_to(inner, partial_dtype), ends)
  return outer.astype(out_dtype)


def _owner_weighted_sum(y, weights, experts, experts_per_owner, out_dtype):
  terms = round_to(weights[:, :, None] * y.astype(jnp.float32), y.dtype)
  return owner_partial_sum(terms, experts, experts_per_owner, y.dtype, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _owner_topk_sum(y, weights, experts, experts_per_owner, out_dtype):
  return _owner_weighted_sum(y, weights, experts, experts_per_owner, out_dtype)


def _owner_fwd(y, weights, experts, experts_per_owner, out_dtype):
  return (_owner_weighted_sum(y, weights, experts, experts_per_owner, out_dtype),
          (y, weights, experts))


def _owner_bwd(experts_per_owner, out_dtype, res, dy):
  y, weights, experts = res
  d_y, d_w = weighted_topk_sum_vjp(y, weights, round_cotangent(dy), out_dtype)
  return d_y, d_w, int_cotangent(experts)


_owner_topk_sum.defvjp(_owner_fwd, _owner_bwd)


@flax.struct.dataclass
class SlotOwners:
  """Where a token's slots are reduced first ("owner_partials"): each slot's expert
  [T, K] and the experts per owner rank (E / R, static). presum_on_owner: the
  de-duplicated dispatch's backward sums a token's slots on their owner and returns one
  row per (token, owner) (`dedup.owner_partials`; the same bits as summing at home);
  off with a receive bound, whose dropped slots the home sum adds as zeros."""
  experts: jax.Array
  experts_per_owner: int = flax.struct.field(pytree_node=False)
  presum_on_owner: bool = flax.struct.field(pytree_node=False, default=False)


def weighted_topk_sum(y: jax.Array, weights: jax.Array, out_dtype=None,
                      owners: SlotOwners | None = None) -> jax.Array:
  """y [T, K, H] (any float dtype), weights [T, K] f32 -> [T, H] in `out_dtype`.
  owners: the owner-partials sum (module docstring); None: the plain slot-order sum."""
  out_dtype = jnp.dtype(out_dtype or y.dtype)
  if owners is None:
    return _weighted_topk_sum(y, weights, out_dtype)
  return _owner_topk_sum(y, weights, owners.experts, owners.experts_per_owner, out_dtype)
