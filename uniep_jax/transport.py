"""Transports: how rows move between the EP ranks of the expert axis (inside shard_map).

A transport moves the sorted rows of every rank into the owners' receive layout
(`send`) and the receive layout's rows back to their sources (`ret`); the two are each
other's transpose, wired as the `custom_vjp` pair `send_rows` / `return_rows`, so the
backward pass of a dispatch is a return and vice versa, and no scatter-add with
colliding indices ever appears. Every transport lands every row at the same place
(`uniep_jax/layout.py` computes it from the routing alone).

  "ragged"  `lax.ragged_all_to_all` into a packed source-major buffer, then a gather
            (GPUs driven by one process).
  "padded"  `lax.all_to_all` of [R, T*K, H] per-peer worst-case buffers, then a gather:
            the CPU (where ragged_all_to_all does not compile) and multi-process runs.
  "local"   one rank on the expert axis: nothing moves. Without a receive bound the
            receive layout IS the sorted order (send and return are the identity, no
            copy); with one, a gather (send) and its transpose (return).
  "nvlink"  Pallas kernels (pallas_kernels/ep_transfer.py) push each contiguous
            (peer, local expert) segment straight into the peer's buffer (GPUs driven by
            one process). It also carries the de-duplicated dispatch (`send_unique`):
            each (token, owner) row once into the owner's unique receive buffer, then
            the owner's live-rows copy into the receive layout
            (pallas_kernels/row_gather.py). Rows of the receive layout past the live
            ones are not written, except a window of `ZERO_WINDOW_ROWS` rows after
            them, which is zeroed (the grouped GEMM's wgrad reads up to block_k rows
            past a group).

`resolve_transport` is the one place where a transport is chosen.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import ep_transfer, row_gather
from uniep_jax.config import TRANSPORTS, UniEPConfig
from uniep_jax.layout import DedupPlan, DispatchPlan, dispatch_segments, return_segments
from uniep_jax.rows import put_rows, take_rows, zero_cotangent, zeros_varying_like

ZERO_WINDOW_ROWS = 256


def resolve_transport(config: UniEPConfig, *, platform: str, ep: int,
                      process_count: int = 1) -> str:
  """The transport of `config`'s backend on an expert axis of `ep` ranks on `platform`
  devices driven by `process_count` processes; ValueError where the backend or the
  transport cannot run there."""
  if ep == 1:
    config = config.one_rank_form()
  if config.transport == "local":
    if ep != 1:
      raise ValueError(f"config.transport='local' moves no row between ranks: it needs an "
                       f"expert axis of size 1, got {ep}")
    return "local"
  if config.backend == "uniep":
    if process_count > 1:
      raise ValueError(f"backend='uniep' (in-kernel NVLink transfers) is unsupported in "
                       f"multi-process runs ({process_count} processes): its kernels write "
                       f"into peer GPUs' memory, which across processes needs NVSHMEM, and "
                       f"this jaxlib ({jax.__version__}) has no NVSHMEM mode; use backend "
                       f"'pallas' (the same kernels and bits, XLA collectives between "
                       f"processes) or 'xla_dropless'")
    if platform != "gpu":
      raise ValueError(f"backend='uniep' (in-kernel NVLink transfers) needs GPUs; the mesh "
                       f"holds {platform} devices: use backend 'pallas' (the same bits)")
    return "nvlink"
  if config.transport == "ragged":
    if process_count > 1:
      raise ValueError(f"config.transport='ragged' hangs in multi-process runs "
                       f"({process_count} processes): lax.ragged_all_to_all between "
                       f"processes goes through XLA's NCCL send/recv fallback, whose first "
                       f"call never returns with jaxlib 0.11.2; use 'padded' or None")
    if platform != "gpu":
      raise ValueError(f"config.transport='ragged' (lax.ragged_all_to_all) does not compile "
                       f"on {platform}; use 'padded' or None")
  if config.transport is not None:
    return config.transport
  return "ragged" if platform == "gpu" and process_count == 1 else "padded"


# ---------------------------------------------------------------------------
# The transports: send (sorted rows -> receive layout) and ret (the transpose)
# ---------------------------------------------------------------------------
def _dest_of_sorted(plan: DispatchPlan) -> jax.Array:
  return plan.sorted_experts // plan.num_local_experts              # [T*K]


def _send_padded(rows_sorted, plan: DispatchPlan, axis_name, transfer):
  n, h = rows_sorted.shape
  r = plan.send_counts.shape[0]
  q = jnp.arange(n, dtype=jnp.int32)
  # buf[d, q] = sorted row send_offsets[d] + q, for q < send_counts[d]
  src_idx = plan.send_offsets[:, None] + q[None, :]                 # [R, n]
  valid = q[None, :] < plan.send_counts[:, None]
  buf = take_rows(rows_sorted, src_idx.reshape(-1), valid.reshape(-1)).reshape(r, n, h)
  got = jax.lax.all_to_all(buf, axis_name, 0, 0, tiled=True)       # [R(src), n, H]
  flat = plan.recv_source * n + plan.recv_index_in_source
  return take_rows(got.reshape(r * n, h), flat, plan.recv_valid)    # [R*n, H]


def _return_padded(recv, plan: DispatchPlan, axis_name, transfer):
  _, h = recv.shape
  r = plan.send_counts.shape[0]
  n = plan.sort_order.shape[0]
  flat = plan.recv_source * n + plan.recv_index_in_source
  buf = put_rows(r * n, recv, flat, plan.recv_valid).reshape(r, n, h)  # [R(src), n, H]
  back = jax.lax.all_to_all(buf, axis_name, 0, 0, tiled=True)      # [R(dst), n, H]
  dest = _dest_of_sorted(plan)                                      # [n]
  pos = jnp.arange(n, dtype=jnp.int32) - plan.send_offsets[dest]
  return take_rows(back.reshape(r * n, h), dest * n + pos, jnp.ones((n,), bool))


def _send_ragged(rows_sorted, plan: DispatchPlan, axis_name, transfer):
  n, h = rows_sorted.shape
  cap = plan.recv_valid.shape[0]
  packed = jax.lax.ragged_all_to_all(
      rows_sorted, zeros_varying_like(rows_sorted, (cap, h)),
      plan.send_offsets, plan.send_counts, plan.output_offsets, plan.recv_counts,
      axis_name=axis_name)                                          # [R*n, H] source-major
  flat = plan.recv_offsets[plan.recv_source] + plan.recv_index_in_source
  return take_rows(packed, flat, plan.recv_valid)


def _return_ragged(recv, plan: DispatchPlan, axis_name, transfer):
  cap, h = recv.shape
  n = plan.sort_order.shape[0]
  flat = plan.recv_offsets[plan.recv_source] + plan.recv_index_in_source
  packed = put_rows(cap, recv, flat, plan.recv_valid)
  return jax.lax.ragged_all_to_all(
      packed, zeros_varying_like(packed, (n, h)),
      plan.recv_offsets, plan.recv_counts, plan.return_offsets, plan.send_counts,
      axis_name=axis_name)                                          # [n, H] sorted order


def _check_one_rank(plan: DispatchPlan) -> None:
  if plan.send_counts.shape[0] != 1:
    raise ValueError(f"transport='local' moves no row between ranks: it needs an expert axis "
                     f"of size 1, got {plan.send_counts.shape[0]} ranks")


def _send_local(rows_sorted, plan: DispatchPlan, axis_name, transfer):
  _check_one_rank(plan)
  if plan.recv_valid.shape[0] == rows_sorted.shape[0]:   # no bound: layout = sorted order
    return rows_sorted
  return take_rows(rows_sorted, plan.recv_index_in_source, plan.recv_valid)


def _return_local(recv, plan: DispatchPlan, axis_name, transfer):
  _check_one_rank(plan)
  n = plan.sort_order.shape[0]
  if recv.shape[0] == n:
    return recv
  return put_rows(n, recv, plan.recv_index_in_source, plan.recv_valid)   # dropped: zero


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
  """A receive buffer whose live rows peers wrote (the Pallas transfers, the overlapped
  kernels' outputs, possibly padded past the layout) as the "nvlink" transport leaves
  it: the layout's rows, the window after the live ones zeroed."""
  return _zero_rows_from(buf[:plan.recv_valid.shape[0]], plan.num_received, ZERO_WINDOW_ROWS)


def zero_dropped_rows(rows_sorted, plan: DispatchPlan):
  """Rows dropped by a receive bound are never written back: zero them (only plans with
  a bound, which is static: a receive layout shorter than R*T*K)."""
  if plan.recv_valid.shape[0] < plan.send_counts.shape[0] * plan.sort_order.shape[0]:
    n = plan.sort_order.shape[0]
    dest = _dest_of_sorted(plan)
    pos = jnp.arange(n, dtype=jnp.int32) - plan.send_offsets[dest]
    dropped = pos >= plan.send_counts[dest]
    rows_sorted = jnp.where(dropped[:, None], jnp.zeros((), rows_sorted.dtype), rows_sorted)
  return rows_sorted


def _send_nvlink(rows_sorted, plan: DispatchPlan, axis_name, transfer):
  seg = dispatch_segments(plan, jax.lax.axis_index(axis_name))
  recv = ep_transfer.transfer_segments(rows_sorted, seg.src_start, seg.dst_start, seg.rows,
                                       out_rows=plan.recv_valid.shape[0], config=transfer,
                                       axis_name=axis_name)
  return as_received(recv, plan)


def _return_nvlink(recv, plan: DispatchPlan, axis_name, transfer):
  seg = return_segments(plan, jax.lax.axis_index(axis_name))
  out = ep_transfer.transfer_segments(recv, seg.src_start, seg.dst_start, seg.rows,
                                      out_rows=plan.sort_order.shape[0], config=transfer,
                                      axis_name=axis_name)
  return zero_dropped_rows(out, plan)


def send_unique(x, plan: DispatchPlan, dplan: DedupPlan, axis_name, transfer, scale=None):
  """The de-duplicated dispatch over NVLink: x [T, H] -> the receive layout
  [recv_rows, H]. Each (token, owner) row crosses once, read by index from x by the
  transfer's own loads (`src_index`), into the owner's packed unique receive buffer
  [R*T, H]; the owner then copies each receive row from it with the live-rows copy
  (weighted by `scale` [recv_rows] f32 if given: dtype(scale * f32(row)), the plain
  combine's backward multiply). The same rows as `send_rows(sort_rows(x))`."""
  t, _ = x.shape
  r = plan.send_counts.shape[0]
  column = lambda a: a[:, None]  # noqa: E731  one segment per destination
  unique = ep_transfer.transfer_segments(
      x, column(dplan.unique_send_offsets), column(dplan.unique_output_offsets),
      column(dplan.unique_send_counts), out_rows=r * t, config=transfer, axis_name=axis_name,
      src_index=dplan.unique_tokens)                                  # [R*T, H] packed
  recv = row_gather.gather_live_rows(unique, dplan.packed_index(plan), plan.num_received,
                                     out_rows=plan.recv_valid.shape[0], scale=scale)
  return as_received(recv, plan)


_SEND = {"padded": _send_padded, "ragged": _send_ragged, "local": _send_local,
         "nvlink": _send_nvlink}
_RETURN = {"padded": _return_padded, "ragged": _return_ragged, "local": _return_local,
           "nvlink": _return_nvlink}
assert set(_SEND) == set(_RETURN) == set(TRANSPORTS)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def send_rows(rows_sorted, plan, axis_name, transport, transfer):
  """Sorted rows [T*K, H] of this rank -> receive layout [recv_rows, H] on the owners."""
  return _SEND[transport](rows_sorted, plan, axis_name, transfer)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def return_rows(recv, plan, axis_name, transport, transfer):
  """Receive layout [recv_rows, H] -> rows back at their sources, sorted order [T*K, H]
  (rows a receive bound dropped are zero)."""
  return _RETURN[transport](recv, plan, axis_name, transfer)


def _send_fwd(rows_sorted, plan, axis_name, transport, transfer):
  return send_rows(rows_sorted, plan, axis_name, transport, transfer), plan


def _send_bwd(axis_name, transport, transfer, plan, ct):
  # the transpose of a dispatch is a return
  return _RETURN[transport](ct, plan, axis_name, transfer), zero_cotangent(plan)


def _return_fwd(recv, plan, axis_name, transport, transfer):
  return return_rows(recv, plan, axis_name, transport, transfer), plan


def _return_bwd(axis_name, transport, transfer, plan, ct):
  # the transpose of a return is a dispatch
  return _SEND[transport](ct, plan, axis_name, transfer), zero_cotangent(plan)


send_rows.defvjp(_send_fwd, _send_bwd)
return_rows.defvjp(_return_fwd, _return_bwd)
