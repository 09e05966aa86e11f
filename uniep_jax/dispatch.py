"""Step 3, dispatch: token rows to the receive layout of their experts' owners.

Inside `shard_map`, per EP rank (orders in `layout.py`):

    plain:   x [T, H] --sort_rows: one gather--> sorted rows [T*K, H]
             --transport.send_rows--> receive layout [recv_rows, H]
    unique:  x [T, H] --transport.send_unique: each (token, owner) row once, then the
             owner's copy to its experts' rows--> the same receive layout, row for row

The backward pass of a dispatch is a return (`transport.return_rows`) followed by the
sum of each token's K slot rows in slot order (`rows.replicate_slots_transpose`); the
unique dispatch's backward is the plain one's, op for op, so both give the same bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import device as device_lib
from pallas_kernels import row_gather
from uniep_jax.layout import DedupPlan, DispatchPlan
from uniep_jax.rows import (permute_rows, replicate_slots_transpose, sum_to_type_of, take_rows,
                            zero_cotangent)
from uniep_jax.transport import return_rows, send_rows, send_unique


def compiled_row_kernels(hidden: int, dtype) -> bool:
  """Whether the Pallas backends move rows of `hidden` elements of `dtype` with the
  live-rows copy kernel here: where kernels compile for the GPU (a GPU, or
  `device.lowering_for_gpu()`) and the rows meet its alignment (`row_gather.rows_fit`).
  Elsewhere XLA's gather gives the same rows (moved, not computed): on the CPU the
  interpret mode would run the kernel slowly."""
  return (device_lib.default_interpret() is False
          and row_gather.rows_fit(hidden, jnp.dtype(dtype).itemsize))


def sort_rows(x, plan: DispatchPlan, row_kernel: bool = False) -> jax.Array:
  """x [T, H] -> its K slot copies in the plan's sorted order [T*K, H]: one gather of
  x's rows (sorted row i is token sort_order[i] // K). Backward: `sort_rows_transpose`.
  row_kernel: the gather by the Pallas live-rows copy (`row_gather.gather_live_rows`);
  the same rows either way (moved, not computed)."""
  return _gather_token_rows(x, plan, row_kernel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather_token_rows(x, plan: DispatchPlan, row_kernel):
  tokens = plan.sorted_tokens
  if row_kernel:
    n = tokens.shape[0]
    return row_gather.gather_live_rows(x, tokens, jnp.int32(n), out_rows=n)
  return jnp.take(x, tokens, axis=0, mode="clip")


def _gather_token_rows_fwd(x, plan, row_kernel):
  return _gather_token_rows(x, plan, row_kernel), (x[:0], plan)


def _gather_token_rows_bwd(row_kernel, res, ct):
  x_like, plan = res
  return sort_rows_transpose(ct, plan, x_like), zero_cotangent(plan)


_gather_token_rows.defvjp(_gather_token_rows_fwd, _gather_token_rows_bwd)


def sort_rows_transpose(rows_sorted, plan: DispatchPlan, x_like) -> jax.Array:
  """`sort_rows`' backward at cotangent rows_sorted [T*K, H]: the gather by the inverse
  permutation (into assignment order), then each token's K slots summed in slot order in
  float32 (`replicate_slots_transpose`). x_like: an empty slice of x (its type)."""
  every = jnp.ones(plan.sorted_position.shape, bool)
  slots = sum_to_type_of(take_rows(rows_sorted, plan.sorted_position, every), x_like)
  return replicate_slots_transpose(slots, plan.top_k)


def unsort_rows(rows_sorted, plan: DispatchPlan) -> jax.Array:
  """Sorted rows [T*K, H] -> [T, K, H] (assignment order)."""
  rows = permute_rows(rows_sorted, plan.sorted_position, plan.sort_order)
  return rows.reshape(-1, plan.top_k, rows_sorted.shape[-1])


def dispatch(x, plan: DispatchPlan, *, axis_name, transport: str, transfer=None,
             row_kernel: bool = False):
  """x [T, H] -> receive layout [recv_rows, H] (padding rows zero, except "nvlink"'s,
  see uniep_jax/transport.py). row_kernel: `sort_rows`' gather by the live-rows copy."""
  return send_rows(sort_rows(x, plan, row_kernel), plan, axis_name, transport, transfer)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def dispatch_unique(x, plan: DispatchPlan, dplan: DedupPlan, axis_name, transfer):
  """x [T, H] -> receive layout [recv_rows, H], each (token, owner) pair sent once over
  NVLink (`transport.send_unique`): the rows of `dispatch(x, plan, transport="nvlink")`,
  and its backward pass."""
  return send_unique(x, plan, dplan, axis_name, transfer)


def _dispatch_unique_fwd(x, plan, dplan, axis_name, transfer):
  return send_unique(x, plan, dplan, axis_name, transfer), (plan, dplan, x[:0])


def _dispatch_unique_bwd(axis_name, transfer, res, ct):
  plan, dplan, x_like = res
  # the plain dispatch's backward, op for op: the return of every slot's row, then the
  # inverse permutation and each token's K slots summed in slot order
  rows_sorted = return_rows(ct, plan, axis_name, "nvlink", transfer)
  return sort_rows_transpose(rows_sorted, plan, x_like), zero_cotangent(plan), zero_cotangent(dplan)


dispatch_unique.defvjp(_dispatch_unique_fwd, _dispatch_unique_bwd)
