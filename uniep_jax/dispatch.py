"""Steps 2 and 4 (transport): move token rows to their experts and back.

Inside `shard_map`, per EP rank. See `layout.py` for the orders involved.

    dispatch:  x [T, H] --replicate_slots--> [T*K, H] (assignment order)
               --gather sort_order--> sorted rows --send_rows--> receive layout [R*T*K, H]
    combine:   receive layout --return_rows--> sorted rows
               --gather sorted_position--> [T, K, H] --weighted_topk_sum--> [T, H]

`send_rows` and `return_rows` are each other's transpose: the backward pass of
dispatch is a combine (of the cotangents) and vice versa. They are wired as
`custom_vjp` pairs so that this is explicit and no scatter-add with colliding
indices (atomics on GPU) ever appears: every backward is a permutation, and
the one reduction (over the K slots of a token) runs in slot order k=0..K-1.

Transports (`transport=`):
  "ragged"  `lax.ragged_all_to_all` into a packed source-major buffer (GPU).
  "padded"  `lax.all_to_all` of [R, T*K, H] per-peer buffers (one fixed slot per
            peer, the dropless worst case) plus a gather. Used on the CPU, where
            ragged_all_to_all does not compile, and between processes on GPUs.
  "nvlink"  Pallas kernels (`pallas_kernels/ep_transfer.py`) push each
            contiguous (peer, local expert) segment straight into the peer's
            buffer (GPU only). Padding rows are not written, except a window of
            `ZERO_WINDOW_ROWS` rows after the live ones, which is zeroed (the grouped
            GEMM's wgrad reads up to block_k rows past a group's end).
  "local"   one rank on the expert axis only: no peer, so nothing moves. Without a
            receive bound the receive layout (local expert, source 0, token, slot) IS
            the sorted order: send and return are the identity, no copy; with one, a
            gather (send) and its transpose (return) drop the tail.
All transports put exactly the same rows in the same places.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from uniep_jax.layout import DispatchPlan

from uniep_jax.config import TRANSPORTS, TransferConfig  # noqa: F401


def default_transport(platform: str, process_count: int = 1) -> str:
  """"ragged" on GPUs driven by one process; "padded" elsewhere: the CPU cannot compile
  ragged_all_to_all, and across processes its NCCL send/recv fallback hangs in jaxlib
  0.11.2 (4 processes x 1 H200, 2026-11-26: the first step never returned)."""
  if platform in ("gpu", "cuda", "rocm") and process_count == 1:
    return "ragged"
  return "padded"


# ---------------------------------------------------------------------------
# Token -> slots. Forward: copy each token row to its K slots. Backward: the K
# slot cotangents of a token summed in slot order, in float32 (with owners, the
# owner-partials sum of uniep_jax/combine.py: each owner rank's slots first).
# ---------------------------------------------------------------------------
def replicate_slots(x: jax.Array, top_k: int, owners=None) -> jax.Array:
  """x [T, H] -> [T*K, H], each row copied to its K slots. Backward: the slot
  cotangents summed in slot order in float32 (owners None), or by
  `combine.owner_partial_sum` (owners: a `combine.SlotOwners`)."""
  if owners is None:
    return _replicate_slots(x, top_k)
  return _replicate_slots_owners(x, owners.experts, top_k, owners.experts_per_owner)


def replicate_slots_transpose(ct: jax.Array, top_k: int, owners=None) -> jax.Array:
  """`replicate_slots`' backward at cotangent ct [T*K, H]: [T, H] in ct's dtype."""
  if owners is None:
    return _replicate_bwd(top_k, None, ct)[0]
  return _owner_slot_sum(ct, top_k, owners.experts, owners.experts_per_owner)


def _owner_slot_sum(ct, top_k, experts, experts_per_owner):
  from uniep_jax.combine import owner_partial_sum
  t = ct.shape[0] // top_k
  terms = ct.reshape(t, top_k, -1).astype(jnp.float32)
  return owner_partial_sum(terms, experts, experts_per_owner, ct.dtype, ct.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _replicate_slots(x: jax.Array, top_k: int) -> jax.Array:
  t, h = x.shape
  return jnp.broadcast_to(x[:, None, :], (t, top_k, h)).reshape(t * top_k, h)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _replicate_slots_owners(x: jax.Array, experts: jax.Array, top_k: int,
                            experts_per_owner: int) -> jax.Array:
  return _replicate_slots(x, top_k)


def _replicate_owners_fwd(x, experts, top_k, experts_per_owner):
  return _replicate_slots(x, top_k), experts


def _replicate_owners_bwd(top_k, experts_per_owner, experts, ct):
  return (_owner_slot_sum(ct, top_k, experts, experts_per_owner), int_cotangent(experts))


_replicate_slots_owners.defvjp(_replicate_owners_fwd, _replicate_owners_bwd)


def _replicate_fwd(x, top_k):
  return _replicate_slots(x, top_k), None


def _replicate_bwd(top_k, _, ct):
  t = ct.shape[0] // top_k
  ct = ct.reshape(t, top_k, -1)
  acc = ct[:, 0].astype(jnp.float32)
  for k in range(1, top_k):
    acc = acc + ct[:, k].astype(jnp.float32)
  return (acc.astype(ct.dtype),)


_replicate_slots.defvjp(_replicate_fwd, _replicate_bwd)


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


def _zeros_varying_like(ref: jax.Array, shape) -> jax.Array:
  """Zeros of `shape` with the varying mesh axes of `ref` (a collective's output
  buffer must carry the operand's type inside a type-checked shard_map)."""
  return widen_varying(jnp.zeros(shape, ref.dtype), varying_axes(ref))


def _take_rows(rows: jax.Array, index: jax.Array, valid: jax.Array) -> jax.Array:
  """rows[index] with invalid rows zeroed. `index` is a permutation of the valid rows."""
  out = jnp.take(rows, index, axis=0, mode="clip")
  return jnp.where(valid[:, None], out, jnp.zeros((), rows.dtype))


def sum_to_type_of(grad: jax.Array, primal: jax.Array) -> jax.Array:
  """A cotangent summed over the mesh axes it varies over and its primal does not.

  Inside a type-checked shard_map, a value that is the same on every shard of an
  axis (a weight, with tokens sharded over that axis) gets the sum of the shards'
  gradients: what autodiff's transpose of the implicit broadcast does, and what a
  custom_vjp's backward rule must do itself."""
  extra = tuple(sorted(varying_axes(grad) - varying_axes(primal)))
  return jax.lax.psum(grad, extra) if extra else grad


def int_cotangent(a: jax.Array):
  """The (float0) cotangent of an integer or boolean input of a custom_vjp."""
  return jnp.zeros(a.shape, jax.dtypes.float0)


@jax.custom_vjp
def gather_rows(rows: jax.Array, index: jax.Array, valid: jax.Array, index_t: jax.Array,
                valid_t: jax.Array) -> jax.Array:
  """out[i] = rows[index[i]] if valid[i] else 0, differentiable without a scatter.

  The map i -> index[i] must be one-to-one on the valid rows, and (index_t,
  valid_t) must be its transpose: source row j is read by output row
  index_t[j] when valid_t[j], and by none otherwise. The backward pass is then
  the gather d_rows[j] = d_out[index_t[j]] (or 0): no scatter-add, which XLA
  would otherwise emit for the transpose of a gather (atomics on the GPU, and
  slow: it dominated the backward pass of the capacity path).
  """
  return _take_rows(rows, index, valid)


def _gather_rows_fwd(rows, index, valid, index_t, valid_t):
  # an empty slice of rows: its type (varying mesh axes) for the backward pass
  return _take_rows(rows, index, valid), (rows[:0], index, valid, index_t, valid_t)


def _gather_rows_bwd(res, ct):
  rows_like, index, valid, index_t, valid_t = res
  return (sum_to_type_of(_take_rows(ct, index_t, valid_t), rows_like), int_cotangent(index),
          int_cotangent(valid), int_cotangent(index_t), int_cotangent(valid_t))


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def permute_rows(rows: jax.Array, perm: jax.Array, inverse_perm: jax.Array) -> jax.Array:
  """rows[perm] for a permutation `perm` whose inverse is `inverse_perm`; its
  backward pass is the gather by the inverse (see `gather_rows`)."""
  every = jnp.ones(perm.shape, bool)
  return gather_rows(rows, perm, every, inverse_perm, every)


def _put_rows(num_rows: int, values: jax.Array, index: jax.Array, valid: jax.Array) -> jax.Array:
  """zeros[num_rows].at[index].set(values) for valid rows; indices are unique."""
  spill = num_rows + jnp.arange(index.shape[0], dtype=index.dtype)   # distinct, out of range
  index = jnp.where(valid, index, spill)                             # dropped by mode="drop"
  out = jnp.zeros((num_rows,) + values.shape[1:], values.dtype)
  return out.at[index].set(values, mode="drop", unique_indices=True)


# ---------------------------------------------------------------------------
# Sorted rows <-> receive layout.
# ---------------------------------------------------------------------------
def _dest_of_sorted(plan: DispatchPlan, num_local_experts: int) -> jax.Array:
  return plan.sorted_experts // num_local_experts                   # [T*K]


def _send_padded(rows_sorted, plan: DispatchPlan, axis_name, num_local_experts):
  n, h = rows_sorted.shape
  r = plan.send_counts.shape[0]
  q = jnp.arange(n, dtype=jnp.int32)
  # buf[d, q] = sorted row send_offsets[d] + q, for q < send_counts[d]
  src_idx = plan.send_offsets[:, None] + q[None, :]                 # [R, n]
  valid = q[None, :] < plan.send_counts[:, None]
  buf = _take_rows(rows_sorted, src_idx.reshape(-1), valid.reshape(-1)).reshape(r, n, h)
  got = jax.lax.all_to_all(buf, axis_name, 0, 0, tiled=True)       # [R(src), n, H]
  flat = plan.recv_source * n + plan.recv_index_in_source
  return _take_rows(got.reshape(r * n, h), flat, plan.recv_valid)   # [R*n, H]


def _return_padded(recv, plan: DispatchPlan, axis_name, num_local_experts):
  _, h = recv.shape
  r = plan.send_counts.shape[0]
  n = plan.sort_order.shape[0]
  flat = plan.recv_source * n + plan.recv_index_in_source
  buf = _put_rows(r * n, recv, flat, plan.recv_valid).reshape(r, n, h)  # [R(src), n, H]
  back = jax.lax.all_to_all(buf, axis_name, 0, 0, tiled=True)      # [R(dst), n, H]
  dest = _dest_of_sorted(plan, num_local_experts)                   # [n]
  pos = jnp.arange(n, dtype=jnp.int32) - plan.send_offsets[dest]
  return _take_rows(back.reshape(r * n, h), dest * n + pos, jnp.ones((n,), bool))


def _send_ragged(rows_sorted, plan: DispatchPlan, axis_name, num_local_experts):
  n, h = rows_sorted.shape
  cap = plan.recv_valid.shape[0]
  packed = jax.lax.ragged_all_to_all(
      rows_sorted, _zeros_varying_like(rows_sorted, (cap, h)),
      plan.send_offsets, plan.send_counts, plan.output_offsets, plan.recv_counts,
      axis_name=axis_name)                                          # [R*n, H] source-major
  flat = plan.recv_offsets[plan.recv_source] + plan.recv_index_in_source
  return _take_rows(packed, flat, plan.recv_valid)


def _return_ragged(recv, plan: DispatchPlan, axis_name, num_local_experts):
  cap, h = recv.shape
  n = plan.sort_order.shape[0]
  flat = plan.recv_offsets[plan.recv_source] + plan.recv_index_in_source
  packed = _put_rows(cap, recv, flat, plan.recv_valid)
  return jax.lax.ragged_all_to_all(
      packed, _zeros_varying_like(packed, (n, h)),
      plan.recv_offsets, plan.recv_counts, plan.return_offsets, plan.send_counts,
      axis_name=axis_name)                                          # [n, H] sorted order


ZERO_WINDOW_ROWS = 256


def _zero_rows_from(buf, start, window: int):
  """Zeroes rows [start, start + window) of buf (clipped to its end), in place."""
  rows = buf.shape[0]
  window = min(window, rows)
  at = jnp.clip(start, 0, rows - window)
  win = jax.lax.dynamic_slice_in_dim(buf, at, window, axis=0)
  keep = (at + jnp.arange(window)) < start
  win = jnp.where(keep[:, None], win, jnp.zeros((), buf.dtype))
  return jax.lax.dynamic_update_slice_in_dim(buf, win, at, axis=0)


def as_received(buf, plan: DispatchPlan):
  """A receive buffer that peers wrote only the live rows of (the Pallas transfers, the
  fused kernels' outputs, possibly padded past the layout) as the nvlink transport leaves
  it: the layout's rows, the window after the live ones zeroed."""
  return _zero_rows_from(buf[:plan.recv_valid.shape[0]], plan.num_received, ZERO_WINDOW_ROWS)


def _send_nvlink(rows_sorted, plan: DispatchPlan, axis_name, num_local_experts, transfer):
  from pallas_kernels.ep_transfer import transfer_segments  # GPU kernels, lazy
  from uniep_jax.layout import dispatch_segments
  rank = jax.lax.axis_index(axis_name)
  seg = dispatch_segments(plan, rank)
  recv = transfer_segments(rows_sorted, seg.src_start, seg.dst_start, seg.rows,
                           out_rows=plan.recv_valid.shape[0], config=transfer,
                           axis_name=axis_name)
  return as_received(recv, plan)


def _return_nvlink(recv, plan: DispatchPlan, axis_name, num_local_experts, transfer):
  from pallas_kernels.ep_transfer import transfer_segments
  from uniep_jax.layout import return_segments
  rank = jax.lax.axis_index(axis_name)
  seg = return_segments(plan, rank)
  out = transfer_segments(recv, seg.src_start, seg.dst_start, seg.rows,
                          out_rows=plan.sort_order.shape[0], config=transfer,
                          axis_name=axis_name)
  return zero_dropped_rows(out, plan, num_local_experts)


def zero_dropped_rows(rows_sorted, plan: DispatchPlan, num_local_experts):
  """Rows dropped by a receive bound are never written back: zero them (only
  plans with a bound, which is static: a receive layout shorter than R*T*K)."""
  if plan.recv_valid.shape[0] < plan.send_counts.shape[0] * plan.sort_order.shape[0]:
    dropped_rows = _dropped_sorted_rows(plan, num_local_experts)
    rows_sorted = jnp.where(dropped_rows[:, None], jnp.zeros((), rows_sorted.dtype), rows_sorted)
  return rows_sorted


def _dropped_sorted_rows(plan: DispatchPlan, num_local_experts):
  """[T*K] bool: sorted rows that a receive bound dropped (all False without one)."""
  n = plan.sort_order.shape[0]
  dest = _dest_of_sorted(plan, num_local_experts)
  pos = jnp.arange(n, dtype=jnp.int32) - plan.send_offsets[dest]
  return pos >= plan.send_counts[dest]


def _check_one_rank(plan: DispatchPlan) -> None:
  if plan.send_counts.shape[0] != 1:
    raise ValueError(f"transport='local' moves no row between ranks: it needs an expert axis "
                     f"of size 1, got {plan.send_counts.shape[0]} ranks")


def _send_local(rows_sorted, plan: DispatchPlan, axis_name, num_local_experts):
  _check_one_rank(plan)
  if plan.recv_valid.shape[0] == rows_sorted.shape[0]:   # no bound: layout = sorted order
    return rows_sorted
  return _take_rows(rows_sorted, plan.recv_index_in_source, plan.recv_valid)


def _return_local(recv, plan: DispatchPlan, axis_name, num_local_experts):
  _check_one_rank(plan)
  n = plan.sort_order.shape[0]
  if recv.shape[0] == n:
    return recv
  return _put_rows(n, recv, plan.recv_index_in_source, plan.recv_valid)   # dropped: zero


def _with_transfer(fn):
  return lambda rows, plan, axis_name, el, transfer: fn(rows, plan, axis_name, el)


_SEND = {"padded": _with_transfer(_send_padded), "ragged": _with_transfer(_send_ragged),
         "nvlink": _send_nvlink, "local": _with_transfer(_send_local)}
_RETURN = {"padded": _with_transfer(_return_padded), "ragged": _with_transfer(_return_ragged),
           "nvlink": _return_nvlink, "local": _with_transfer(_return_local)}


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def send_rows(rows_sorted, plan, axis_name, num_local_experts, transport, transfer):
  """Sorted rows [T*K, H] of this rank -> receive layout [R*T*K, H] on the owners."""
  return _SEND[transport](rows_sorted, plan, axis_name, num_local_experts, transfer)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def return_rows(recv, plan, axis_name, num_local_experts, transport, transfer):
  """Receive layout [R*T*K, H] -> rows back at their sources, sorted order [T*K, H]."""
  return _RETURN[transport](recv, plan, axis_name, num_local_experts, transfer)


def _zero_plan_cotangent(plan):
  return jax.tree.map(lambda a: int_cotangent(a)
                      if jnp.issubdtype(a.dtype, jnp.integer) or a.dtype == bool
                      else jnp.zeros_like(a), plan)


def _send_fwd(rows_sorted, plan, axis_name, num_local_experts, transport, transfer):
  return send_rows(rows_sorted, plan, axis_name, num_local_experts, transport, transfer), plan


def _send_bwd(axis_name, num_local_experts, transport, transfer, plan, ct):
  # The transpose of a dispatch is a combine (without the weighting).
  return (_RETURN[transport](ct, plan, axis_name, num_local_experts, transfer),
          _zero_plan_cotangent(plan))


def _return_fwd(recv, plan, axis_name, num_local_experts, transport, transfer):
  return return_rows(recv, plan, axis_name, num_local_experts, transport, transfer), plan


def _return_bwd(axis_name, num_local_experts, transport, transfer, plan, ct):
  # The transpose of a combine is a dispatch.
  return (_SEND[transport](ct, plan, axis_name, num_local_experts, transfer),
          _zero_plan_cotangent(plan))


send_rows.defvjp(_send_fwd, _send_bwd)
return_rows.defvjp(_return_fwd, _return_bwd)


def compiled_row_kernels() -> bool:
  """Whether the Pallas backends move rows with the live-rows copy kernel here: where
  kernels compile for the GPU (a GPU, or `device.lowering_for_gpu()`). On the CPU the
  interpret mode would run it slowly; XLA's gather there gives the same rows (moved, not
  computed; tests/test_one_rank.py checks the kernel forms against it bit for bit)."""
  from pallas_kernels import device as device_lib   # GPU kernels' helpers, lazy
  return device_lib.default_interpret() is False


def sort_rows(x, plan: DispatchPlan, top_k: int, row_kernel: bool = False) -> jax.Array:
  """x [T, H] -> its K slot copies in the plan's sorted order [T*K, H]: one gather of
  x's rows (sorted row i is token sort_order[i] // K). Backward: `sort_rows_transpose`
  (the same ops as the slot copies and their permutation would transpose to: the
  gather by sorted_position, then each token's slots summed). row_kernel: the gather
  by the Pallas live-rows copy (`row_gather.gather_live_rows`, the Pallas backends:
  one H200, qwen3-like's 131k rows of 4 KiB, 0.27 ms where XLA's gather fusion took
  ~0.6); the same rows either way (moved, not computed)."""
  if plan.slot_owners is not None:   # owner_partials' backward sums per owner first
    return permute_rows(replicate_slots(x, top_k, plan.slot_owners), plan.sort_order,
                        plan.sorted_position)
  return _gather_token_rows(x, plan, top_k, row_kernel)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _gather_token_rows(x, plan: DispatchPlan, top_k, row_kernel):
  tokens = plan.sort_order // top_k
  if row_kernel:
    from pallas_kernels.row_gather import gather_live_rows   # GPU kernels, lazy
    n = tokens.shape[0]
    return gather_live_rows(x, tokens, jnp.int32(n), out_rows=n)
  return jnp.take(x, tokens, axis=0, mode="clip")


def _gather_token_rows_fwd(x, plan, top_k, row_kernel):
  return _gather_token_rows(x, plan, top_k, row_kernel), (x[:0], plan)


def _gather_token_rows_bwd(top_k, row_kernel, res, ct):
  x_like, plan = res
  return sort_rows_transpose(ct, plan, top_k, x_like), _zero_plan_cotangent(plan)


_gather_token_rows.defvjp(_gather_token_rows_fwd, _gather_token_rows_bwd)


def sort_rows_transpose(rows_sorted, plan: DispatchPlan, top_k: int, x_like) -> jax.Array:
  """`sort_rows`' backward pass at cotangent rows_sorted [T*K, H], op for op: the gather
  by the inverse permutation (`permute_rows`), then each token's K slots summed
  (`replicate_slots`). x_like: an empty slice of x (its type)."""
  every = jnp.ones(plan.sorted_position.shape, bool)
  slots = sum_to_type_of(_take_rows(rows_sorted, plan.sorted_position, every), x_like)
  return replicate_slots_transpose(slots, top_k, plan.slot_owners)


def unsort_rows(rows_sorted, plan: DispatchPlan, top_k: int) -> jax.Array:
  """Sorted rows [T*K, H] -> [T, K, H] (assignment order)."""
  rows = permute_rows(rows_sorted, plan.sorted_position, plan.sort_order)
  return rows.reshape(-1, top_k, rows_sorted.shape[-1])


def dispatch(x, plan: DispatchPlan, *, top_k, axis_name, num_local_experts, transport,
             transfer=TransferConfig(), row_kernel: bool = False):
  """x [T, H] -> receive layout [recv_rows, H] (padding rows zero, see "nvlink").
  row_kernel: `sort_rows`' gather by the Pallas live-rows copy."""
  return send_rows(sort_rows(x, plan, top_k, row_kernel), plan, axis_name, num_local_experts,
                   transport, transfer)


def collect(recv, plan: DispatchPlan, *, top_k, axis_name, num_local_experts, transport,
            transfer=TransferConfig()):
  """Receive layout [recv_rows, H] -> [T, K, H]: each assignment's expert output at
  home (zero for assignments dropped by a receive bound)."""
  rows_sorted = return_rows(recv, plan, axis_name, num_local_experts, transport, transfer)
  return unsort_rows(rows_sorted, plan, top_k)
