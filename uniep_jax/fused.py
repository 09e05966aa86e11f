"""Backend "uniep" with `UniEPConfig.fused` (EXPERIMENTAL): the v2 fused kernels.

Per EP rank, inside `shard_map`, from the sorted rows to the rows back home:

  forward   rows_sorted --Kernel A: NVLink dispatch + gate/up GEMM, one launch,
                          each GEMM tile waiting only for its chunk's rows-->
              recv, a, h, u     (pallas_kernels/fused_dispatch_gemm.py)
            a --Kernel B: down GEMM whose epilogue stores each tile straight
                          into the source rank's sorted rows--> y_sorted
                                (pallas_kernels/fused_gemm_return.py)
            (FusedConfig.dispatch_in_kernel=False, with de-duplication: x sent once per
             (token, owner) by v1's transfer, the owner's live-rows copy, then v1's
             gate/up launch on every SM instead of Kernel A; with overlap_copy_ctas > 0
             the three in one launch, Kernel D, pallas_kernels/dedup_dispatch_gemm.py,
             and with overlap_copy_ctas_bwd > 0 the backward's dy dispatch, weighted copy
             and da GEMM;
             FusedConfig.return_in_kernel=False: v1's down GEMM, then v1's return;
             with down_return_ctas > 0, Kernel C: the down GEMM with each finished chunk
             sent back beside it, pallas_kernels/down_gemm_return.py)
  backward  v1's, kernel for kernel:
            dy_sorted --send over NVLink (the transpose of the return)--> dy_recv
            --grouped_gemm.swiglu_backward (residuals recv, a, h, u)--> d_recv, dW
            --return over NVLink (the transpose of the dispatch)--> d_rows_sorted
            or, with FusedConfig.backward (EXPERIMENTAL; bitwise = v1 on 4x H200, no faster):
            dy_sorted --Kernel A's twin: NVLink dispatch of dy + da GEMM with the
                        dswiglu epilogue, one launch--> dy_recv, [dh | du]
                                (fused_dispatch_gemm.fused_dispatch_dswiglu)
            --grouped_gemm.swiglu_backward_from_dhu--> d_recv, dW --return--> d_rows
            With UniEPConfig.dedup_tokens (fused_expert_ffn_combine, the combine inside):
            dy sent once per (token, owner), each slot's row w * dy formed on the owner
            (uniep_jax/dedup.py), then v1's launches.
            With FusedConfig.wgrad_return_ctas > 0 (v2.2): dx, dw_down, then ONE launch
            for dw_gate_up with the return of d_recv on that many of its CTAs
            (pallas_kernels/wgrad_return.py): the two ran one after the other in v1.

Bits. Kernel A runs the grouped GEMM's own body on v1's tile plan, so a, h, u
equal v1's; Kernel B runs v1's down-GEMM tiles and stores each row where v1's
return transfer puts it; the receive buffer kept for the backward pass gets
v1's zeroed window; the backward pass is v1's (or, fused, v1's da tiles with v1's
zeroed window on dy_recv). Dead rows as v1's (a window of block_k rows zeroed, the
rest skipped). So outputs and gradients equal "uniep" without `fused` (and "pallas")
bit for bit wherever the kernels' own GPU checks hold (bench/check_fused_gpu.py,
bench/check_fused_return_gpu.py: Kernels A and B bitwise on 4x H200 in their small
cases, 2026-11-26; the GPU sweep, bench/determinism_sweep.py, covers the fused points;
every fused variant gave v1's output and gradient checksums in the layer runs 7, 9 and
10 on 4x H200, NOTES_fused.md). Risk to check in training: the fused launches take every SM and spin on cross-rank
semaphores, so a collective kernel running beside them (gradient all-reduces that
overlap the backward: --grad-reduction xla, or --grad-buckets > 1) could keep CTAs from
becoming resident (SYNC.md's deadlock argument assumes all are); run them under a hang
timeout.
"""

from __future__ import annotations

import functools

import jax

from uniep_jax.combine import weighted_topk_sum
from uniep_jax.config import FusedConfig, KernelConfig, TransferConfig
from uniep_jax.dispatch import (_return_nvlink, _send_nvlink, _zero_plan_cotangent,
                                as_received, sort_rows_transpose, unsort_rows,
                                zero_dropped_rows)
from uniep_jax.layout import (DispatchPlan, dispatch_segments, max_received_rows,
                              return_segments)


def _forward(rows_in, w_gate_up, w_down, plan: DispatchPlan, axis_name, el, kernel,
             transfer, fused, dplan=None):
  """rows_in: the sorted rows [T*K, H] (Kernel A's input), or with
  fused.dispatch_in_kernel=False the tokens x [T, H] and `dplan` (the de-duplicated
  dispatch's plan)."""
  from pallas_kernels import fused_dispatch_gemm, fused_gemm_return  # GPU kernels, lazy
  from pallas_kernels import grouped_gemm as gg

  rank = jax.lax.axis_index(axis_name)
  recv_rows = plan.recv_valid.shape[0]
  sorted_rows = plan.sort_order.shape[0]
  if fused.dispatch_in_kernel:
    seg = dispatch_segments(plan, rank)
    # dead rows: v1's window (moe.py's zero_dead_rows=False): zero up to round_up(live,
    # block_k), the rest skipped; every later launch reads no further
    recv, a, h, u = fused_dispatch_gemm.fused_dispatch_gate_up(
        rows_in, seg.src_start, seg.dst_start, seg.rows, plan.recv_group_sizes, w_gate_up,
        out_rows=recv_rows, axis_name=axis_name, kernel=kernel, transfer=transfer,
        fused=fused, zero_window=kernel.block_k, live_rows=max_received_rows(plan))
    # v1's receive buffer, the residual of the backward pass: [recv_rows, H] with the
    # window after the live rows zeroed (the wgrad reads up to block_k rows past a group)
    recv = as_received(recv, plan)
  elif fused.overlap_copy_ctas:   # Kernel D: the de-duplicated dispatch, its expansion
    # and the gate/up GEMM in one launch, each GEMM chunk once its rows are expanded
    from pallas_kernels.dedup_dispatch_gemm import dedup_dispatch_gate_up
    from uniep_jax.dedup import packed_unique_index
    recv, a, h, u = dedup_dispatch_gate_up(
        rows_in, dplan, packed_unique_index(plan, dplan), plan.num_received,
        plan.recv_group_sizes, w_gate_up, out_rows=recv_rows, axis_name=axis_name,
        kernel=kernel, fused=fused, n_copy=fused.overlap_copy_ctas,
        zero_window=kernel.block_k)
    recv = as_received(recv, plan)   # v1's residual: the window after the live rows zeroed
  else:   # each (token, owner) pair's row sent once, copied to its experts' rows; v1's
    # gate/up launch on every SM (moe.py's uniep_dd forward, kernel for kernel)
    from uniep_jax.dedup import _dedup_nvlink
    recv = _dedup_nvlink(rows_in, plan, dplan, axis_name, transfer)
    a, h, u = gg.gate_up_projection(gg._pad_axis(recv, 0, gg._padded_rows(recv_rows, kernel)),
                                    w_gate_up, plan.recv_group_sizes, config=kernel,
                                    save_hu=True, zero_window=kernel.block_k)
  if fused.return_in_kernel:
    seg = return_segments(plan, rank)
    y_sorted = fused_gemm_return.fused_gemm_return(
        a, w_down, seg.src_start, seg.dst_start, seg.rows, out_rows=sorted_rows,
        axis_name=axis_name, kernel=kernel)
    y_sorted = zero_dropped_rows(y_sorted, plan, el)
  elif fused.down_return_ctas:   # Kernel C: the down GEMM, each finished chunk sent back
    from pallas_kernels.down_gemm_return import down_gemm_return
    seg = return_segments(plan, rank)
    _, y_sorted = down_gemm_return(
        a, w_down, plan.recv_group_sizes, seg.src_start, seg.dst_start, seg.rows,
        out_rows=sorted_rows, live_rows=plan.num_received, axis_name=axis_name,
        kernel=kernel, transfer=transfer, chunk_rows=fused.recv_chunk_rows,
        n_comm=fused.down_return_ctas, zero_window=kernel.block_k)
    y_sorted = zero_dropped_rows(y_sorted, plan, el)
  else:   # v1's down GEMM (its dead-row window, moe.py's zero_dead_rows=False), v1's return
    y_recv = gg.down_projection(a, w_down, plan.recv_group_sizes, config=kernel,
                                zero_window=kernel.block_k)
    y_sorted = _return_nvlink(y_recv[:recv_rows, :w_down.shape[2]], plan, axis_name, el,
                              transfer)
  return y_sorted, (recv, a, h, u)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def _fused_ffn(rows_sorted, w_gate_up, w_down, plan, axis_name, el, kernel, transfer, fused,
               grad_in_kernel):
  return _forward(rows_sorted, w_gate_up, w_down, plan, axis_name, el, kernel, transfer,
                  fused)[0]


def _fused_ffn_fwd(rows_sorted, w_gate_up, w_down, plan, axis_name, el, kernel, transfer,
                   fused, grad_in_kernel):
  y_sorted, (recv, a, h, u) = _forward(rows_sorted, w_gate_up, w_down, plan, axis_name, el,
                                       kernel, transfer, fused)
  return y_sorted, (recv, a, h, u, w_gate_up, w_down, plan)


def _fused_ffn_bwd(axis_name, el, kernel, transfer, fused, grad_in_kernel, res, dy_sorted):
  recv, a, h, u, w_gate_up, w_down, plan = res
  if fused.backward:
    # the dy dispatch (the return's transpose) and da with its dswiglu epilogue, one launch
    from pallas_kernels.fused_dispatch_gemm import fused_dispatch_dswiglu
    recv_rows = plan.recv_valid.shape[0]
    seg = dispatch_segments(plan, jax.lax.axis_index(axis_name))
    dy_recv, dhu = fused_dispatch_dswiglu(
        dy_sorted.astype(recv.dtype), seg.src_start, seg.dst_start, seg.rows,
        plan.recv_group_sizes, w_down, h, u, out_rows=recv_rows, axis_name=axis_name,
        kernel=kernel, transfer=transfer, fused=fused, zero_window=kernel.block_k,
        live_rows=max_received_rows(plan))
    # as v1's send: the window after the live rows zeroed (the dw_down wgrad reads it)
    dy_recv = as_received(dy_recv, plan)
    d_rows, dw_gate_up, dw_down = _tail(recv, w_gate_up, w_down, a, dy_recv, dhu, plan,
                                        axis_name, el, kernel, transfer, fused)
  else:   # v1's: the dy dispatch (the return's transpose), then v1's launches
    dy_recv = _send_nvlink(dy_sorted, plan, axis_name, el, transfer)
    d_rows, dw_gate_up, dw_down = _backward_from_dy_recv(res, dy_recv, axis_name, el, kernel,
                                                         transfer, fused, grad_in_kernel)
  return d_rows, dw_gate_up, dw_down, _zero_plan_cotangent(plan)


def _backward_from_dy_recv(res, dy_recv, axis_name, el, kernel, transfer, fused,
                           grad_in_kernel):
  """v1's backward from dy in the receive layout: the da launch (swiglu_backward's first
  half), then `_tail`. res: `_fused_ffn_fwd`'s residuals (a prefix is enough)."""
  from pallas_kernels.grouped_gemm import swiglu_dhu
  recv, a, h, u, w_gate_up, w_down, plan = res[:7]
  dhu = swiglu_dhu(recv, w_down, plan.recv_group_sizes, h, u, dy_recv, config=kernel,
                   fuse_da_epilogue=grad_in_kernel, zero_window=kernel.block_k)
  return _tail(recv, w_gate_up, w_down, a, dy_recv, dhu, plan, axis_name, el, kernel, transfer,
               fused)


def _tail(recv, w_gate_up, w_down, a, dy_recv, dhu, plan, axis_name, el, kernel, transfer,
          fused):
  """The backward from [dh | du]: dx, the two wgrads and the dX return."""
  from pallas_kernels.grouped_gemm import swiglu_backward_from_dhu
  if fused.wgrad_return_ctas:
    # dx, dw_down, then dw_gate_up with the dX return on wgrad_return_ctas of its CTAs
    return _tail_with_return(recv, w_gate_up, w_down, a, dy_recv, dhu, plan, axis_name, el,
                             kernel, transfer, fused)
  d_recv, dw_gate_up, dw_down = swiglu_backward_from_dhu(
      recv, w_gate_up, w_down, plan.recv_group_sizes, a, dy_recv, dhu, config=kernel,
      zero_window=kernel.block_k)
  d_rows = _return_nvlink(d_recv, plan, axis_name, el, transfer)     # the dispatch's transpose
  return d_rows, dw_gate_up, dw_down


def _tail_with_return(recv, w_gate_up, w_down, a, dy_recv, dhu, plan, axis_name, el, kernel,
                      transfer, fused):
  """The backward's tail from [dh | du] with the dX return beside the dw_gate_up wgrad
  (`FusedConfig.wgrad_return_ctas`): the same launches' bits as
  `swiglu_backward_from_dhu` + `_return_nvlink`, in one launch fewer."""
  from pallas_kernels import grouped_gemm as gg
  from pallas_kernels.wgrad_return import gmm_wgrad_with_return
  group_sizes = plan.recv_group_sizes
  d_recv = gg.swiglu_dx_from_dhu(recv, w_gate_up, group_sizes, dhu, config=kernel,
                                 zero_window=kernel.block_k)
  dw_down = gg.swiglu_dw_down(a, dy_recv, w_down, group_sizes, config=kernel)
  seg = return_segments(plan, jax.lax.axis_index(axis_name))
  dw_gate_up, back = gmm_wgrad_with_return(
      gg._pad_axis(recv, 0, a.shape[0]), dhu, group_sizes, d_recv, seg.src_start,
      seg.dst_start, seg.rows, out_rows=plan.sort_order.shape[0], axis_name=axis_name,
      out_dtype=w_gate_up.dtype, config=kernel, transfer=transfer,
      n_comm=fused.wgrad_return_ctas)
  d_rows = zero_dropped_rows(back, plan, el)
  return d_rows, gg.unpad_dw_gate_up(dw_gate_up, w_down.shape[1]), dw_down


_fused_ffn.defvjp(_fused_ffn_fwd, _fused_ffn_bwd)


# ---------------------------------------------------------------------------
# With token de-duplication (UniEPConfig.dedup_tokens): the combine inside, so that the
# backward's dy dispatch sends each (token, owner) pair's dy row once (uniep_jax/dedup.py).
# ---------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11, 12, 13))
def _fused_ffn_combine(rows_in, w_gate_up, w_down, weights, plan, dplan, axis_name, el,
                       kernel, transfer, fused, grad_in_kernel, top_k, out_dtype):
  return _fused_ffn_combine_fwd(rows_in, w_gate_up, w_down, weights, plan, dplan, axis_name,
                                el, kernel, transfer, fused, grad_in_kernel, top_k,
                                out_dtype)[0]


def _fused_ffn_combine_fwd(rows_in, w_gate_up, w_down, weights, plan, dplan, axis_name, el,
                           kernel, transfer, fused, grad_in_kernel, top_k, out_dtype):
  y_sorted, (recv, a, h, u) = _forward(rows_in, w_gate_up, w_down, plan, axis_name, el,
                                       kernel, transfer, fused, dplan)
  y_assign = unsort_rows(y_sorted, plan, top_k)
  y = weighted_topk_sum(y_assign, weights, out_dtype=out_dtype)
  return y, (recv, a, h, u, w_gate_up, w_down, plan, weights, y_assign, dplan, rows_in[:0])


def _fused_ffn_combine_bwd(axis_name, el, kernel, transfer, fused, grad_in_kernel, top_k,
                           out_dtype, res, dy):
  from uniep_jax.dedup import unique_dy_rows
  recv, plan, (weights, y_assign, dplan, rows_in_like) = res[0], res[6], res[7:]
  if fused.overlap_copy_ctas_bwd:
    # Kernel D's backward twin: dy's de-duplicated dispatch, the weighted expansion and
    # the da GEMM (dh, du in its epilogue) in one launch; d_weights as unique_dy_rows'
    from pallas_kernels.dedup_dispatch_gemm import dedup_dispatch_dswiglu
    from uniep_jax.combine import combine_cotangent
    from uniep_jax.dedup import packed_unique_index
    if not grad_in_kernel:
      raise ValueError("fused.overlap_copy_ctas_bwd computes dh, du in the da GEMM's "
                       "epilogue: it needs swiglu_grad_in_kernel")
    a, h, u, w_gate_up, w_down = res[1:6]
    dy, d_weights = combine_cotangent(dy, y_assign, weights, out_dtype)
    dy_recv, dhu = dedup_dispatch_dswiglu(
        dy.astype(recv.dtype), dplan, packed_unique_index(plan, dplan), dplan.recv_weights,
        plan.num_received, plan.recv_group_sizes, w_down, h, u,
        out_rows=plan.recv_valid.shape[0], axis_name=axis_name, kernel=kernel, fused=fused,
        n_copy=fused.overlap_copy_ctas_bwd, zero_window=kernel.block_k)
    dy_recv = as_received(dy_recv, plan)   # as v1's: the window the dw_down wgrad reads
    d_rows, dw_gate_up, dw_down = _tail(recv, w_gate_up, w_down, a, dy_recv, dhu, plan,
                                        axis_name, el, kernel, transfer, fused)
  else:
    # each (token, owner) pair's dy once; the owner forms every slot's row w * dy
    dy_recv, d_weights = unique_dy_rows(dy, y_assign, weights, plan, dplan,
                                        axis_name=axis_name, transport="nvlink",
                                        transfer=transfer, out_dtype=out_dtype,
                                        rows_dtype=recv.dtype)
    d_rows, dw_gate_up, dw_down = _backward_from_dy_recv(res, dy_recv, axis_name, el, kernel,
                                                         transfer, fused, grad_in_kernel)
  if not fused.dispatch_in_kernel:   # rows_in was x: sort_rows' transpose (dedup.py's)
    d_rows = sort_rows_transpose(d_rows, plan, top_k, rows_in_like)
  return (d_rows, dw_gate_up, dw_down, d_weights, _zero_plan_cotangent(plan),
          _zero_plan_cotangent(dplan))


_fused_ffn_combine.defvjp(_fused_ffn_combine_fwd, _fused_ffn_combine_bwd)


def fused_expert_ffn_combine(rows_in, w_gate_up, w_down, weights, plan: DispatchPlan, dplan,
                             *, axis_name: str, num_local_experts: int, kernel: KernelConfig,
                             transfer: TransferConfig, fused: FusedConfig, top_k: int, out_dtype,
                             grad_in_kernel: bool = False) -> jax.Array:
  """`fused_expert_ffn` followed by the weighted top-k sum, y [T, H] in out_dtype, whose
  backward pass de-duplicates the dy dispatch (`dplan`: uniep_jax/dedup.py): the same
  bits as `fused_expert_ffn` + `weighted_topk_sum`. Needs fused.backward off.
  rows_in: the sorted rows [T*K, H] (`sort_rows`), or the tokens x [T, H] when
  fused.dispatch_in_kernel is False (the forward's dispatch de-duplicated too)."""
  if fused.backward:
    raise ValueError("fused.backward moves the dy dispatch inside its da launch; the "
                     "de-duplicated dy dispatch needs fused.backward=False")
  want = plan.sort_order.shape[0] if fused.dispatch_in_kernel else plan.sort_order.shape[0] // top_k
  if rows_in.shape[0] != want:
    raise ValueError(f"rows_in has {rows_in.shape[0]} rows; fused.dispatch_in_kernel="
                     f"{fused.dispatch_in_kernel} takes {want} (the sorted rows if True, the "
                     f"tokens if False)")
  return _fused_ffn_combine(rows_in, w_gate_up, w_down, weights, plan, dplan, axis_name,
                            num_local_experts, kernel, transfer, fused, grad_in_kernel, top_k,
                            out_dtype)


def fused_expert_ffn(rows_sorted, w_gate_up, w_down, plan: DispatchPlan, *, axis_name: str,
                     num_local_experts: int, kernel: KernelConfig, transfer: TransferConfig,
                     fused: FusedConfig, grad_in_kernel: bool = False) -> jax.Array:
  """Sorted rows [T*K, H] of this rank -> their expert outputs [T*K, H], sorted order
  (rows a receive bound dropped are zero). Differentiable; GPU only."""
  if not fused.dispatch_in_kernel:
    raise ValueError("fused.dispatch_in_kernel=False de-duplicates the forward's dispatch: "
                     "use fused_expert_ffn_combine with a DedupPlan")
  return _fused_ffn(rows_sorted, w_gate_up, w_down, plan, axis_name, num_local_experts,
                    kernel, transfer, fused, grad_in_kernel)
