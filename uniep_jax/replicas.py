"""Step 4 with replicas: each replica slot gets its expert's weights from the owner, and
each replica's weight gradient goes back to the owner (`balance.py` plans the slots).

`replicated_swiglu` runs the grouped SwiGLU FFN (`experts.py`) over this rank's El own
experts followed by its S replica slots, the virtual experts of the plan. Its VJP
computes the weight gradients in float32, returns each slot's to the owner, and the
owner adds the pieces of each expert in a fixed order: its own first, then the
replicas' by rank, then by slot (one rank holds at most one slot of an expert), and
rounds once to the weights' dtype. The weight gradient therefore repeats bit for bit
and differs from the unreplicated one only by float32 reassociation (the pieces'
partial sums); the output and dx do not change on a row-split-invariant GEMM.

How the weights move (only slots in use carry a weight; unused slots are zero):
  "nvlink"  (backend "uniep") the in-kernel NVLink transfer
            (`pallas_kernels/ep_transfer.transfer_segments`): the weights viewed as rows
            ([El*H, 2F] and [El*F, H]); one segment of H (or F) rows per (peer, slot)
            whose expert this rank owns, straight into the peer's replica buffer. The
            float32 gradient returns the same way into an [R*S] buffer at the owner.
  otherwise `lax.all_to_all` of an [R, S] grid of weights per rank (a slot's weights
            where this rank owns its expert, zeros elsewhere). XLA moves the zeros too:
            R*S weights per rank and direction, whatever the plan.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import ep_transfer
from uniep_jax.experts import grouped_backward, grouped_forward
from uniep_jax.rows import int_cotangent, sum_to_type_of


def _slot_table(slot_expert: jax.Array, num_local: int, rank):
  """(local index [R, S] (clipped), mine [R, S] bool: used slots whose expert this rank
  owns, my_owner [S]: the owner of each of this rank's slots, -1 if unused)."""
  used = slot_expert >= 0
  owner = jnp.where(used, slot_expert // num_local, -1)
  local = jnp.clip(slot_expert - owner * num_local, 0, num_local - 1)
  my_owner = jax.lax.dynamic_index_in_dim(owner, rank, 0, keepdims=False)
  return local, used & (owner == rank), my_owner


def _send_xla(w, slot_expert, axis_name):
  """[El, A, B] -> [S, A, B]: the weights of this rank's slots (all_to_all)."""
  el = w.shape[0]
  rank = jax.lax.axis_index(axis_name)
  local, mine, my_owner = _slot_table(slot_expert, el, rank)
  grid = jnp.where(mine[:, :, None, None], w[local], jnp.zeros((), w.dtype))   # [R, S, A, B]
  got = jax.lax.all_to_all(grid, axis_name, 0, 0, tiled=False)                # [R(owner), S, ..]
  s = slot_expert.shape[1]
  pick = jnp.maximum(my_owner, 0)
  rep = got[pick, jnp.arange(s)]                                              # [S, A, B]
  return jnp.where((my_owner >= 0)[:, None, None], rep, jnp.zeros((), w.dtype))


def _return_xla(ct_rep, slot_expert, num_local, axis_name):
  """[S, A, B] slot gradients -> [R, S, A, B] at the owners (zeros where not theirs)."""
  r, s = slot_expert.shape
  rank = jax.lax.axis_index(axis_name)
  _, _, my_owner = _slot_table(slot_expert, num_local, rank)
  grid = jnp.where((jnp.arange(r)[:, None] == my_owner[None, :])[:, :, None, None],
                   ct_rep[None], jnp.zeros((), ct_rep.dtype))                 # [R(owner), S, ..]
  return jax.lax.all_to_all(grid, axis_name, 0, 0, tiled=False)               # [R(slot rank), S, ..]


def _send_nvlink(w, slot_expert, axis_name, transfer):
  el, a, b = w.shape
  r, s = slot_expert.shape
  rank = jax.lax.axis_index(axis_name)
  local, mine, my_owner = _slot_table(slot_expert, el, rank)
  slot = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (r, s))
  rows = jnp.where(mine, a, 0).astype(jnp.int32)
  out = ep_transfer.transfer_segments(
      w.reshape(el * a, b), (local * a).astype(jnp.int32), slot * a, rows, out_rows=s * a,
      config=transfer, axis_name=axis_name).reshape(s, a, b)
  # unused slots are never written: zero them
  return jnp.where((my_owner >= 0)[:, None, None], out, jnp.zeros((), w.dtype))


def _return_nvlink(ct_rep, slot_expert, num_local, axis_name, transfer):
  s, a, b = ct_rep.shape
  r = slot_expert.shape[0]
  rank = jax.lax.axis_index(axis_name)
  _, _, my_owner = _slot_table(slot_expert, num_local, rank)
  slot = jnp.arange(s, dtype=jnp.int32)
  to_peer = jnp.arange(r)[:, None] == my_owner[None, :]                       # [R, S]
  rows = jnp.where(to_peer, a, 0).astype(jnp.int32)
  src = jnp.broadcast_to(slot * a, (r, s))
  dst = jnp.broadcast_to((rank * s + slot) * a, (r, s)).astype(jnp.int32)
  got = ep_transfer.transfer_segments(ct_rep.reshape(s * a, b), src, dst, rows,
                                      out_rows=r * s * a, config=transfer,
                                      axis_name=axis_name)
  return got.reshape(r, s, a, b)   # rows of slots that are not this rank's: undefined


def _send(w, slot_expert, axis_name, transport, transfer):
  if transport == "nvlink":
    return _send_nvlink(w, slot_expert, axis_name, transfer)
  return _send_xla(w, slot_expert, axis_name)


def _return(ct_rep, slot_expert, num_local, axis_name, transport, transfer):
  if transport == "nvlink":
    return _return_nvlink(ct_rep, slot_expert, num_local, axis_name, transfer)
  return _return_xla(ct_rep, slot_expert, num_local, axis_name)


def _add_in_order(own, got, slot_expert, axis_name):
  """own [El, A, B] + each of `got` [R, S, A, B] that is this rank's, rank by rank, slot
  by slot (slots not this rank's leave the bits untouched)."""
  el = own.shape[0]
  r, s = slot_expert.shape
  local, mine, _ = _slot_table(slot_expert, el, jax.lax.axis_index(axis_name))
  total = own
  for d in range(r):
    for j in range(s):
      cur = jax.lax.dynamic_index_in_dim(total, local[d, j], 0, keepdims=False)
      new = jnp.where(mine[d, j], cur + got[d, j], cur)
      total = jax.lax.dynamic_update_index_in_dim(total, new, local[d, j], 0)
  return total


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def replicated_swiglu(x, w_gate_up, w_down, slot_expert, group_sizes, kernel_config,
                      zero_dead_rows, axis_name, transport, transfer, precision="bf16",
                      x_quantised=None):
  """The grouped SwiGLU FFN (`experts.grouped_forward`) of x [M, H] over this rank's El
  experts followed by its S replica slots (`slot_expert` [R, S] int32, -1 = unused;
  group_sizes [El + S]), whose weights come from their owners. kernel_config: None for
  "xla_dropless"'s `lax.ragged_dot`, else the Pallas grouped GEMM's tiling (precision:
  `UniEPConfig.precision`; x_quantised: x's e4m3 rows and scales from the FP8 dispatch,
  x their dequantisation)."""
  ext_gu, ext_d = _extend(w_gate_up, w_down, slot_expert, axis_name, transport, transfer)
  return grouped_forward(x, ext_gu, ext_d, group_sizes, kernel_config=kernel_config,
                         zero_dead_rows=zero_dead_rows, precision=precision,
                         x_quantised=x_quantised)[0]


def _extend(w_gate_up, w_down, slot_expert, axis_name, transport, transfer):
  """(w_gate_up [El+S, H, 2F], w_down [El+S, F, H]): own experts, then the slots'."""
  rep_gu = _send(w_gate_up, slot_expert, axis_name, transport, transfer)
  rep_d = _send(w_down, slot_expert, axis_name, transport, transfer)
  return (jnp.concatenate([w_gate_up, rep_gu], axis=0),
          jnp.concatenate([w_down, rep_d], axis=0))


def _fwd(x, w_gate_up, w_down, slot_expert, group_sizes, kernel_config, zero_dead_rows,
         axis_name, transport, transfer, precision, x_quantised):
  ext_gu, ext_d = _extend(w_gate_up, w_down, slot_expert, axis_name, transport, transfer)
  y, res = grouped_forward(x, ext_gu, ext_d, group_sizes, kernel_config=kernel_config,
                           zero_dead_rows=zero_dead_rows, precision=precision,
                           x_quantised=x_quantised)
  # w_gate_up, w_down: kept for their sharding types only
  return y, (x, ext_gu, ext_d, slot_expert, group_sizes, res, w_gate_up, w_down)


def _bwd(kernel_config, zero_dead_rows, axis_name, transport, transfer, precision, saved, dy):
  x, ext_gu, ext_d, slot_expert, group_sizes, res, w_gate_up, w_down = saved
  # float32 weight gradients: each piece unrounded until the owner's fixed-order sum
  dx, dgu, dd = grouped_backward(x, ext_gu, ext_d, group_sizes, res, dy,
                                 kernel_config=kernel_config, zero_dead_rows=zero_dead_rows,
                                 wgrad_dtype=jnp.float32, precision=precision)
  el = w_gate_up.shape[0]
  grads = []
  for g, w in ((dgu, w_gate_up), (dd, w_down)):
    got = _return(g[el:], slot_expert, el, axis_name, transport, transfer)
    total = _add_in_order(g[:el], got, slot_expert, axis_name)
    grads.append(sum_to_type_of(total.astype(w.dtype), w))
  # the gradient reaches x (x_quantised's dequantisation); x_quantised itself carries
  # none (None: a zero cotangent, so it need not be kept for the backward pass)
  return (dx, grads[0], grads[1], int_cotangent(slot_expert), int_cotangent(group_sizes),
          None)


replicated_swiglu.defvjp(_fwd, _bwd)


def expert_bytes(hidden: int, ffn: int, itemsize: int) -> int:
  """Bytes of one expert's weights (gate/up and down)."""
  return 3 * hidden * ffn * itemsize
