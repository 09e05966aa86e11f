"""Row movement with explicit transposes, and the sharding helpers they need.

Every step of the layer moves rows by index: a gather, or its transpose. XLA would
transpose a gather into a scatter-add (atomics on the GPU, whose float order changes
from run to run when indices collide). Here every movement is a `custom_vjp` whose
backward pass is again a gather (the inverse map is known from the plan), and the one
reduction, over a token's K slots, runs in slot order k = 0..K-1 in float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


# ---------------------------------------------------------------------------
# Sharding types inside shard_map
# ---------------------------------------------------------------------------
def varying_axes(x: jax.Array) -> frozenset:
  """The manual mesh axes `x` varies over inside a shard_map (empty outside)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()) or ())


def widen_varying(x: jax.Array, axes) -> jax.Array:
  """`x` typed as varying over `axes` too (`pcast` over those it does not vary over yet;
  `x` itself where none are missing)."""
  missing = tuple(sorted(frozenset(axes) - varying_axes(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def zeros_varying_like(ref: jax.Array, shape) -> jax.Array:
  """Zeros of `shape` with the varying mesh axes of `ref` (a collective's output buffer
  must carry the operand's type inside a type-checked shard_map)."""
  return widen_varying(jnp.zeros(shape, ref.dtype), varying_axes(ref))


def sum_to_type_of(grad: jax.Array, primal: jax.Array) -> jax.Array:
  """A cotangent summed over the mesh axes it varies over and its primal does not.

  Inside a type-checked shard_map, a value that is the same on every shard of an axis
  (a weight, with tokens sharded over that axis) gets the sum of the shards' gradients:
  what autodiff's transpose of the implicit broadcast does, and what a custom_vjp's
  backward rule must do itself."""
  extra = tuple(sorted(varying_axes(grad) - varying_axes(primal)))
  return jax.lax.psum(grad, extra) if extra else grad


def int_cotangent(a: jax.Array):
  """The (float0) cotangent of an integer or boolean input of a custom_vjp."""
  return jnp.zeros(a.shape, jax.dtypes.float0)


def zero_cotangent(tree):
  """Zero cotangents of a pytree of index arrays (a plan): float0 for integers and
  booleans, zeros for floats."""
  return jax.tree.map(lambda a: int_cotangent(a)
                      if jnp.issubdtype(a.dtype, jnp.integer) or a.dtype == bool
                      else jnp.zeros_like(a), tree)


# ---------------------------------------------------------------------------
# Gathers and their transposes
# ---------------------------------------------------------------------------
def take_rows(rows: jax.Array, index: jax.Array, valid: jax.Array) -> jax.Array:
  """rows[index] with invalid rows zeroed."""
  out = jnp.take(rows, index, axis=0, mode="clip")
  return jnp.where(valid[:, None], out, jnp.zeros((), rows.dtype))


def put_rows(num_rows: int, values: jax.Array, index: jax.Array, valid: jax.Array) -> jax.Array:
  """zeros[num_rows].at[index].set(values) for valid rows; indices are unique."""
  spill = num_rows + jnp.arange(index.shape[0], dtype=index.dtype)   # distinct, out of range
  index = jnp.where(valid, index, spill)                             # dropped by mode="drop"
  out = jnp.zeros((num_rows,) + values.shape[1:], values.dtype)
  return out.at[index].set(values, mode="drop", unique_indices=True)


@jax.custom_vjp
def gather_rows(rows: jax.Array, index: jax.Array, valid: jax.Array, index_t: jax.Array,
                valid_t: jax.Array) -> jax.Array:
  """out[i] = rows[index[i]] if valid[i] else 0, differentiable without a scatter.

  The map i -> index[i] must be one-to-one on the valid rows, and (index_t, valid_t)
  its transpose: source row j is read by output row index_t[j] when valid_t[j], and by
  none otherwise. The backward pass is then the gather d_rows[j] = d_out[index_t[j]]
  (or 0)."""
  return take_rows(rows, index, valid)


def _gather_rows_fwd(rows, index, valid, index_t, valid_t):
  # an empty slice of rows: its type (varying mesh axes) for the backward pass
  return take_rows(rows, index, valid), (rows[:0], index, valid, index_t, valid_t)


def _gather_rows_bwd(res, ct):
  rows_like, index, valid, index_t, valid_t = res
  return (sum_to_type_of(take_rows(ct, index_t, valid_t), rows_like), int_cotangent(index),
          int_cotangent(valid), int_cotangent(index_t), int_cotangent(valid_t))


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def permute_rows(rows: jax.Array, perm: jax.Array, inverse_perm: jax.Array) -> jax.Array:
  """rows[perm] for a permutation `perm` whose inverse is `inverse_perm`; its backward
  pass is the gather by the inverse (see `gather_rows`)."""
  every = jnp.ones(perm.shape, bool)
  return gather_rows(rows, perm, every, inverse_perm, every)


# ---------------------------------------------------------------------------
# Token -> slots: forward, copy each token row to its K slots; backward, the K slot
# cotangents of a token summed in slot order in float32.
# ---------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def replicate_slots(x: jax.Array, top_k: int) -> jax.Array:
  """x [T, H] -> [T*K, H], each row copied to its K slots."""
  t, h = x.shape
  return jnp.broadcast_to(x[:, None, :], (t, top_k, h)).reshape(t * top_k, h)


def replicate_slots_transpose(ct: jax.Array, top_k: int) -> jax.Array:
  """`replicate_slots`' backward at cotangent ct [T*K, H]: each token's K slots summed in
  slot order in float32, rounded once to ct's dtype: [T, H]."""
  t = ct.shape[0] // top_k
  ct = ct.reshape(t, top_k, -1)
  acc = ct[:, 0].astype(jnp.float32)
  for k in range(1, top_k):
    acc = acc + ct[:, k].astype(jnp.float32)
  return acc.astype(ct.dtype)


replicate_slots.defvjp(lambda x, top_k: (replicate_slots(x, top_k), None),
                       lambda top_k, _, ct: (replicate_slots_transpose(ct, top_k),))
