"""The GShard capacity path (`backend="xla_capacity"`), per EP rank.

Each source shard lets expert e take at most
    capacity = ceil(capacity_factor * T * K / E)
of its assignments, first come in the plan's (expert, token, slot) order; the
rest are dropped (output contribution 0) and counted in `aux["dropped"]`.
Dispatch is one dense `all_to_all` of [E, capacity, H] buffers, the experts run
as a batched einsum, and a second `all_to_all` brings the results back.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from uniep_jax.experts import swiglu_batched
from uniep_jax.layout import sort_assignments
from uniep_jax.rows import gather_rows, permute_rows, replicate_slots


def capacity_per_expert(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
  return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


def capacity_moe_shard(x, topk_experts, params, *, top_k, capacity_factor, axis_name):
  """Returns (y_assign [T, K, H] with dropped slots zero, dropped count (local))."""
  t, h = x.shape
  e = params.router.shape[1]
  el = params.w_gate_up.shape[0]
  r = e // el
  cap = capacity_per_expert(t, top_k, e, capacity_factor)
  sort_order, sorted_position, sorted_experts, group_sizes = sort_assignments(topk_experts, e)
  group_start = jnp.cumsum(group_sizes) - group_sizes                # [E]
  pos_in_group = jnp.arange(t * top_k, dtype=jnp.int32) - group_start[sorted_experts]
  keep = pos_in_group < cap                                         # [T*K] sorted order

  rows = replicate_slots(x, top_k)                                  # [T*K, H]
  rows_sorted = permute_rows(rows, sort_order, sorted_position)
  c = jnp.arange(cap, dtype=jnp.int32)
  src = (group_start[:, None] + c[None, :]).reshape(-1)             # [E*cap]
  valid = (c[None, :] < group_sizes[:, None]).reshape(-1)
  flat = sorted_experts * cap + jnp.minimum(pos_in_group, cap - 1)  # [T*K]: its buffer slot
  # sorted rows -> [E, cap] buffers and back are each other's transpose.
  buf = gather_rows(rows_sorted, src, valid, flat, keep).reshape(r, el, cap, h)
  recv = jax.lax.all_to_all(buf, axis_name, 0, 0, tiled=True)       # [R(src), El, cap, H]
  recv = recv.transpose(1, 0, 2, 3).reshape(el, r * cap, h)         # [El, R*cap, H]
  y = swiglu_batched(recv, params.w_gate_up, params.w_down)
  y = y.reshape(el, r, cap, h).transpose(1, 0, 2, 3)                # [R(src), El, cap, H]
  back = jax.lax.all_to_all(y, axis_name, 0, 0, tiled=True)         # [R(dst), El, cap, H]
  back = back.reshape(e * cap, h)
  y_sorted = gather_rows(back, flat, keep, src, valid)              # [T*K, H]
  y_assign = permute_rows(y_sorted, sorted_position, sort_order).reshape(t, top_k, h)
  dropped = jnp.sum(~keep).astype(jnp.int32)
  return y_assign, dropped
