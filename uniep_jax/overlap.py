"""Steps 3-5 of backend "uniep" with `UniEPConfig.overlap`: transfers inside GEMM launches.

Per EP rank, inside `shard_map`, from the tokens x to y, one custom_vjp (the overlapped
launches cross the stages' boundaries):

  forward   x --dispatch (each (token, owner) row once, the owner's copy)--> recv
            --gate/up launch--> a, h, u
            --down GEMM + return of each finished chunk, one launch
              (pallas_kernels/down_gemm_return.py; OverlapConfig.down_return_ctas)-->
            y_sorted --unsort, weighted top-k sum--> y
  backward  dy --each (token, owner) pair's dy once, the owner's weighted copy--> dy_recv
            --da launch with the SwiGLU derivative in its epilogue--> [dh | du]
            --dx launch, dw_down launch--> d_recv, dw_down
            --dw_gate_up wgrad + return of d_recv on a few of its CTAs, one launch
              (pallas_kernels/wgrad_return.py; OverlapConfig.wgrad_return_ctas)-->
            d_rows_sorted --sort_rows' transpose--> dx
With a field at 0 that step runs as two launches, the GEMM and then the transfer.

Bits: every launch runs the grouped GEMM's own tile bodies on the same tile plan and
block_k as the stages of `uniep_jax/moe.py` (`experts.swiglu_pallas`, the transports),
and every row lands where those stages put it, so outputs and gradients equal
"uniep" without `overlap` (and "pallas") bit for bit.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels import grouped_gemm as gg
from pallas_kernels.down_gemm_return import down_gemm_return
from pallas_kernels.wgrad_return import gmm_wgrad_with_return
from uniep_jax.combine import unique_dy_rows, weighted_topk_sum
from uniep_jax.config import OverlapConfig
from uniep_jax.dispatch import sort_rows_transpose, unsort_rows
from uniep_jax.layout import DedupPlan, DispatchPlan, return_segments
from uniep_jax.rows import zero_cotangent
from uniep_jax.transport import return_rows, send_unique, zero_dropped_rows


def _forward(x, w_gate_up, w_down, plan: DispatchPlan, dplan: DedupPlan, axis_name, kernel,
             transfer, overlap: OverlapConfig):
  recv_rows = plan.recv_valid.shape[0]
  recv = send_unique(x, plan, dplan, axis_name, transfer)
  # the dead rows: a window of block_k rows zeroed, the rest skipped (every later launch
  # reads no further: `grouped_swiglu_ffn(zero_dead_rows=False)`)
  a, h, u = gg.gate_up_projection(gg._pad_axis(recv, 0, gg._padded_rows(recv_rows, kernel)),
                                  w_gate_up, plan.recv_group_sizes, config=kernel,
                                  save_hu=True, zero_window=kernel.block_k)
  if overlap.down_return_ctas:
    seg = return_segments(plan, jax.lax.axis_index(axis_name))
    _, y_sorted = down_gemm_return(
        a, w_down, plan.recv_group_sizes, seg.src_start, seg.dst_start, seg.rows,
        out_rows=plan.sort_order.shape[0], live_rows=plan.num_received, axis_name=axis_name,
        kernel=kernel, transfer=transfer, chunk_rows=overlap.chunk_rows,
        n_comm=overlap.down_return_ctas, zero_window=kernel.block_k)
    y_sorted = zero_dropped_rows(y_sorted, plan)
  else:
    y_recv = gg.down_projection(a, w_down, plan.recv_group_sizes, config=kernel,
                                zero_window=kernel.block_k)
    y_sorted = return_rows(y_recv[:recv_rows, :w_down.shape[2]], plan, axis_name, "nvlink",
                           transfer)
  return y_sorted, (recv, a, h, u)


def _backward_tail(recv, w_gate_up, w_down, a, dy_recv, dhu, plan, axis_name, kernel,
                   transfer, overlap: OverlapConfig):
  """From [dh | du]: dx's rows back at their sources (sorted order) and the two weight
  gradients."""
  group_sizes = plan.recv_group_sizes
  if not overlap.wgrad_return_ctas:
    d_recv, dw_gate_up, dw_down = gg.swiglu_backward_from_dhu(
        recv, w_gate_up, w_down, group_sizes, a, dy_recv, dhu, config=kernel,
        zero_window=kernel.block_k)
    return return_rows(d_recv, plan, axis_name, "nvlink", transfer), dw_gate_up, dw_down
  d_recv = gg.swiglu_dx_from_dhu(recv, w_gate_up, group_sizes, dhu, config=kernel,
                                 zero_window=kernel.block_k)
  dw_down = gg.swiglu_dw_down(a, dy_recv, w_down, group_sizes, config=kernel)
  seg = return_segments(plan, jax.lax.axis_index(axis_name))
  dw_gate_up, back = gmm_wgrad_with_return(
      gg._pad_axis(recv, 0, a.shape[0]), dhu, group_sizes, d_recv, seg.src_start,
      seg.dst_start, seg.rows, out_rows=plan.sort_order.shape[0], axis_name=axis_name,
      out_dtype=w_gate_up.dtype, config=kernel, transfer=transfer,
      n_comm=overlap.wgrad_return_ctas)
  return (zero_dropped_rows(back, plan), gg.unpad_dw_gate_up(dw_gate_up, w_down.shape[1]),
          dw_down)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _overlapped(x, w_gate_up, w_down, weights, plan, dplan, axis_name, kernel, transfer,
                overlap, out_dtype):
  return _overlapped_fwd(x, w_gate_up, w_down, weights, plan, dplan, axis_name, kernel,
                         transfer, overlap, out_dtype)[0]


def _overlapped_fwd(x, w_gate_up, w_down, weights, plan, dplan, axis_name, kernel, transfer,
                    overlap, out_dtype):
  y_sorted, (recv, a, h, u) = _forward(x, w_gate_up, w_down, plan, dplan, axis_name, kernel,
                                       transfer, overlap)
  y_assign = unsort_rows(y_sorted, plan)
  y = weighted_topk_sum(y_assign, weights, out_dtype=out_dtype)
  return y, (recv, a, h, u, w_gate_up, w_down, plan, dplan, weights, y_assign, x[:0])


def _overlapped_bwd(axis_name, kernel, transfer, overlap, out_dtype, res, dy):
  recv, a, h, u, w_gate_up, w_down, plan, dplan, weights, y_assign, x_like = res
  # each (token, owner) pair's dy once; the owner forms every slot's row w * dy
  dy_recv, d_weights = unique_dy_rows(dy, y_assign, weights, plan, dplan, axis_name=axis_name,
                                      transfer=transfer, out_dtype=out_dtype,
                                      rows_dtype=recv.dtype)
  dhu = gg.swiglu_dhu(recv, w_down, plan.recv_group_sizes, h, u, dy_recv, config=kernel,
                      zero_window=kernel.block_k)
  d_rows, dw_gate_up, dw_down = _backward_tail(recv, w_gate_up, w_down, a, dy_recv, dhu, plan,
                                               axis_name, kernel, transfer, overlap)
  dx = sort_rows_transpose(d_rows, plan, x_like)
  return dx, dw_gate_up, dw_down, d_weights, zero_cotangent(plan), zero_cotangent(dplan)


_overlapped.defvjp(_overlapped_fwd, _overlapped_bwd)


def overlapped_moe_experts(x, w_gate_up, w_down, weights, plan: DispatchPlan, dplan: DedupPlan,
                           *, axis_name: str, kernel, transfer, overlap: OverlapConfig,
                           out_dtype) -> jax.Array:
  """x [T, H] -> y [T, H] in out_dtype (module docstring): dispatch, experts and combine
  of backend "uniep" with the overlapped launches of `overlap`. Differentiable; GPU only."""
  return _overlapped(x, w_gate_up, w_down, weights, plan, dplan, axis_name, kernel, transfer,
                     overlap, out_dtype)
