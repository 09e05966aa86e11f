"""Step 3, dispatch: token rows to the receive layout of their experts' owners.

Inside `shard_map`, per EP rank (orders in `layout.py`):

    plain:   x [T, H] --sort_rows: one gather--> sorted rows [T*K, H]
             --transport.send_rows--> receive layout [recv_rows, H]
    unique:  x [T, H] --transport.send_unique: each (token, owner) row once, then the
             owner's copy to its experts' rows--> the same receive layout, row for row

    fp8:     x [T, H] --fp8.quantise_rows: each token once--> e4m3 rows and their
             scales, packed in byte rows --the plain or the unique path--> receive
             layout, unpacked and dequantised beside

The backward pass of a dispatch is a return (`transport.return_rows`) followed by the
sum of each token's K slot rows in slot order (`rows.replicate_slots_transpose`); the
unique dispatch's backward is the plain one's, op for op, so both give the same bits,
and so is the FP8 dispatch's (of its dequantised rows' cotangent).

With `precision="fp8"` the experts compute on q(x), each token's row quantised once
per 128 columns (`pallas_kernels/fp8.py`), and the gate/up weight gradient is taken
at q(x) too (the gradient of the quantised forward; x's gradient passes straight
through): `dispatch_fp8` sends q(x) itself (e4m3 and scales packed in one byte row:
about half the bytes) on every transport and path, replica slots included, and the
experts take the received q and s as they are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import device as device_lib
from pallas_kernels import fp8, fp8_gemm, row_gather
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


def _quantise_tokens(x):
  """x [T, H] -> (q [T, Hp] e4m3, s [T, Hp/128] float32): `fp8.quantise_rows`, by the
  quantisation kernel where kernels compile (the same bits)."""
  t = x.shape[0]
  if device_lib.default_interpret() is False:
    q, s_t = fp8_gemm.quantise_rows_for_gemm(x, 64)
    return q[:t], s_t.T[:t]
  return fp8.quantise_rows(x)


def _dequantise(q, s, like):
  """(q, s) rows -> [rows, H] in like's dtype: exact (e4m3 times a power of two)."""
  return fp8.dequantise_rows(q, s)[:, :like.shape[1]].astype(like.dtype)


def _pack(q, s):
  """(q [N, Hp] e4m3, s [N, Hb] float32) -> one uint8 row each: q's bytes, then s's,
  zero-padded to a multiple of `row_gather.ROW_ALIGN_BYTES` (the row size every
  transport, the NVLink transfer included, moves)."""
  n, hp = q.shape
  parts = [jax.lax.bitcast_convert_type(q, jnp.uint8),
           jax.lax.bitcast_convert_type(s, jnp.uint8).reshape(n, -1)]   # [N, Hb * 4]
  width = hp + parts[1].shape[1]
  pad = -width % row_gather.ROW_ALIGN_BYTES
  return jnp.concatenate(parts + [jnp.zeros((n, pad), jnp.uint8)], axis=1)


def _unpack(rows, hp: int):
  """`_pack`'s inverse: uint8 rows -> (q [N, Hp] e4m3, s [N, Hp/128] float32)."""
  hb = hp // fp8.QUANT_BLOCK
  q = jax.lax.bitcast_convert_type(rows[:, :hp], fp8.FP8_DTYPE)
  s = jax.lax.bitcast_convert_type(rows[:, hp:hp + 4 * hb].reshape(-1, hb, 4), jnp.float32)
  return q, s


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def dispatch_fp8(x, plan: DispatchPlan, axis_name, transport: str, transfer=None,
                 dplan: DedupPlan | None = None):
  """x [T, H] -> (rows [recv_rows, H] in x.dtype, q [recv_rows, Hp] e4m3, s [recv_rows,
  Hp/128] float32): each token quantised once, its e4m3 row and scales packed into one
  byte row (`_pack`: H + H/32 bytes, padded; 2H bytes in bf16) and sent like
  `dispatch`'s rows ("nvlink": like `dispatch_unique`'s, with dplan), and rows = their
  dequantisation: the rows `dispatch` delivers of q(x)'s values, bit for bit.
  Backward: `dispatch`'s, of the rows' cotangent (q and s carry none)."""
  q, s = _quantise_tokens(x)
  packed = _pack(q, s)
  if transport == "nvlink":
    recv = send_unique(packed, plan, dplan, axis_name, transfer)
  else:
    recv = send_rows(sort_rows(packed, plan), plan, axis_name, transport, transfer)
  rq, rs = _unpack(recv, q.shape[1])
  return _dequantise(rq, rs, x), rq, rs


def _dispatch_fp8_fwd(x, plan, axis_name, transport, transfer, dplan):
  return dispatch_fp8(x, plan, axis_name, transport, transfer, dplan), (plan, dplan, x[:0])


def _dispatch_fp8_bwd(axis_name, transport, transfer, res, ct):
  plan, dplan, x_like = res
  # the plain dispatch's backward, op for op (for "nvlink" too, as `dispatch_unique`'s)
  rows_sorted = return_rows(ct[0], plan, axis_name, transport, transfer)
  return (sort_rows_transpose(rows_sorted, plan, x_like), zero_cotangent(plan),
          None if dplan is None else zero_cotangent(dplan))


dispatch_fp8.defvjp(_dispatch_fp8_fwd, _dispatch_fp8_bwd)
