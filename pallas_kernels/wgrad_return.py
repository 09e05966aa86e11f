"""EXPERIMENTAL (v2.2): the backward's dX return transfer beside a wgrad, one launch.

In `moe_ffn` as `UniEPConfig(backend="uniep", fused=FusedConfig(return_beside_wgrad=True))`
(uniep_jax/fused.py). Why: in v1's backward the return of d_recv to the source ranks
(an NVLink transfer, ~1.2 ms on qwen3-like at EP 4) and the two weight gradients
(~1.75 ms) run one after the other on one stream although neither needs the other.
Pallas kernels cannot run on a second stream, so this launch gives the transfer a
few CTAs and the wgrad the rest: the transfer keeps ~90% of its 64-CTA rate on 16
CTAs (bench/overlap_probe.py, 4x H200: 2.02 ms with 16 CTAs, 1.81 with 64, plan and
sort included), and the wgrad loses ~12% of its SMs.

Roles (by CTA index c on "sm", grid = num_sms, 3 warpgroups each)
------------------------------------------------------------------
  c <  n_comm   transfer CTAs: warpgroup 0 runs `ep_transfer._transfer_body` (v1's
                return: every (peer, local expert) segment of `rows` pushed into
                the source rank's sorted rows, remote peers first) on CTAs
                [0, n_comm); the other two warpgroups idle.
  c >= n_comm   wgrad CTAs: `grouped_gemm._wgrads_kernel`'s body on CTAs
                [n_comm, num_sms) (local CTA i takes output tiles i, i + (num_sms -
                n_comm), ... of one list: the first wgrad's tiles, then the next's;
                `gmm_wgrads_with_return` takes dw_gate_up's and dw_down's operands,
                FusedConfig.return_beside_dw_down). Each output tile is summed whole
                by one CTA in its fixed block_k order, so each dw has the standalone
                wgrad's bits.

Buffers
-------
  bounds [2G], lhs [M_p, K_p], dout [M_p, N_p]   per wgrad: its operands (padded as
                                    `gmm_wgrad` pads; one M_p and dtype, K_p and N_p
                                    per wgrad)
  rows [Nr, H]                      what the transfer sends (d_recv, the receive layout)
  dw [G, K_p, N_p]                  output, per wgrad
  back [out_rows, H]                output; PEERS write into it (remote TMA stores).
                                    Rows no segment covers are undefined (as v1's).
  SMEM: the transfer role's 2 stages [chunk_rows, col_tile] and the wgrad's pipeline
  and epilogue are `run_scoped` in sibling branches: each must fit alone. The
  wgrads share one pipeline and epilogue buffer (their blocks have one shape).

Synchronisation contract
------------------------
  The transfer role's, unchanged (ep_transfer.py): Mosaic GPU's cross-device barrier
  before the launch (skip_device_barrier=False, kept), ready_sem[c] and done_sem[c]
  per transfer CTA (allocated at this kernel's top level), each with one waiter.
  When every transfer CTA is past its done wait, every peer's writes into this
  rank's `back` have landed. The wgrad CTAs neither signal nor wait: they share no
  buffer with the transfer (rows is read-only here; dw is local). All num_sms CTAs
  must be resident at once (1 CTA per SM), as for the fused dispatch kernels.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import device as device_lib
from pallas_kernels import ep_transfer
from pallas_kernels import grouped_gemm as gg
from uniep_jax.config import KernelConfig, TransferConfig


def _kernel(work_gmem, rows_gmem, *refs, wgrad_kw: dict, transfer_kw: dict, n_comm: int,
            num_sms: int, item_rows: int, col_tile: int, num_wgrads: int):
  # refs: (bounds, lhs, dout) per wgrad, then the outputs: dw per wgrad, back
  operands, dws, back_gmem = refs[:3 * num_wgrads], refs[3 * num_wgrads:-1], refs[-1]
  c = lax.axis_index("sm")
  sems = ep_transfer.transfer_semaphores(n_comm)

  @pl.when(c < n_comm)
  def _transfer():
    @functools.partial(pl.run_scoped,
                       stage_smem=plgpu.SMEM((2, item_rows, col_tile), rows_gmem.dtype),
                       load_barrier=plgpu.Barrier(num_barriers=2),
                       collective_axes="wg")
    def _(stage_smem, load_barrier):
      @pl.when(lax.axis_index("wg") == 0)
      def _():
        ep_transfer._transfer_body(work_gmem, rows_gmem, back_gmem, stage_smem, load_barrier,
                                   cta_axis="sm", sems=sems, num_ctas=n_comm,
                                   chunk_rows=item_rows, col_tile=col_tile, **transfer_kw)

  @pl.when(c >= n_comm)
  def _wgrad():
    problems = [(*operands[3 * i:3 * i + 3], dws[i]) for i in range(num_wgrads)]
    gg._wgrads_kernel(problems, cta_offset=n_comm, num_ctas=num_sms - n_comm, **wgrad_kw)


def gmm_wgrad_with_return(lhs, dout, group_sizes, rows, seg_src, seg_dst, seg_len, *,
                          out_rows: int, axis_name: str, out_dtype=None,
                          config: KernelConfig = KernelConfig(),
                          transfer: TransferConfig = TransferConfig(), n_comm: int = 16):
  """(dw, back): dw = `grouped_gemm.gmm_wgrad(lhs, dout, group_sizes)` (same bits) and
  back = `ep_transfer.transfer_segments(rows, seg_src, seg_dst, seg_len, out_rows=...,
  axis_name=...)` (same rows), in one launch. Inside `shard_map` over `axis_name`;
  GPU only (remote refs and semaphores)."""
  (dw,), back = gmm_wgrads_with_return(
      [(lhs, dout)], group_sizes, rows, seg_src, seg_dst, seg_len, out_rows=out_rows,
      axis_name=axis_name, out_dtype=out_dtype, config=config, transfer=transfer,
      n_comm=n_comm)
  return dw, back


def gmm_wgrads_with_return(wgrads, group_sizes, rows, seg_src, seg_dst, seg_len, *,
                           out_rows: int, axis_name: str, out_dtype=None,
                           config: KernelConfig = KernelConfig(),
                           transfer: TransferConfig = TransferConfig(), n_comm: int = 16):
  """([dw, ...], back): for each (lhs, dout) of `wgrads`, dw =
  `grouped_gemm.gmm_wgrad(lhs, dout, group_sizes)` (same bits; the wgrad CTAs walk the
  first's tiles, then the next's, as one list), and back = `ep_transfer.transfer_segments(
  rows, seg_src, seg_dst, seg_len, out_rows=..., axis_name=...)` (same rows), in one
  launch. Every wgrad's operands share the row count M and one dtype (K, N may
  differ). Inside `shard_map` over `axis_name`; GPU only (remote refs and semaphores)."""
  if not wgrads:
    raise ValueError("wgrads must hold at least one (lhs, dout) pair")
  m = wgrads[0][0].shape[0]
  for i, (lhs, dout) in enumerate(wgrads):
    if lhs.shape[0] != m or dout.shape[0] != m:
      raise ValueError(f"wgrads[{i}]: lhs.shape={lhs.shape} and dout.shape={dout.shape} "
                       f"must have the first wgrad's M={m} rows")
    if dout.dtype != lhs.dtype or lhs.dtype != wgrads[0][0].dtype:
      raise ValueError(f"wgrads[{i}]: lhs and dout must share the first wgrad's dtype "
                       f"{wgrads[0][0].dtype}, got {lhs.dtype} and {dout.dtype}")
  in_dtype = wgrads[0][0].dtype
  out_dtype = out_dtype or in_dtype
  num_sms = device_lib.num_sms(config.num_sms)
  if not 1 <= n_comm < num_sms:
    raise ValueError(f"n_comm={n_comm} must be in [1, num_sms={num_sms}) (at least one "
                     f"wgrad CTA)")
  g = group_sizes.shape[0]
  m_p = gg._padded_rows(m, config, wgrad=True)
  bounds = gg.wgrad_bounds(group_sizes, m_p)
  operands, out_types, shapes = [], [], []
  for lhs, dout in wgrads:
    (_, k), n = lhs.shape, dout.shape[1]
    k_p = gg._round_up(k, gg._NUM_COMPUTE_WGS * config.block_m)
    n_p = gg._round_up(n, config.block_n)
    operands += [bounds, gg._pad_axis(gg._pad_axis(lhs, 1, k_p), 0, m_p),
                 gg._pad_axis(gg._pad_axis(dout, 1, n_p), 0, m_p)]
    out_types.append(jax.ShapeDtypeStruct((g, k_p, n_p), out_dtype))
    shapes.append((k, n, k_p, n_p))
  wgrad_kw = gg.wgrad_params(m_p, g, in_dtype, out_dtype, config)

  ns, hidden = rows.shape
  smem = device_lib.smem_capacity()
  col_tile = transfer.col_tile_for(hidden, itemsize=jnp.dtype(rows.dtype).itemsize,
                                   smem_bytes=smem - gg._SMEM_RESERVE)
  item_rows = transfer.chunk_rows
  if ns < item_rows:   # the load box must fit inside rows (as v1)
    rows = jnp.pad(rows, ((0, item_rows - ns), (0, 0)))
  work = ep_transfer.work_lists(seg_src, seg_dst, seg_len, rank=lax.axis_index(axis_name),
                                src_rows=rows.shape[0], chunk_rows=item_rows)
  w = (work.shape[1] - 1) // 3
  body = functools.partial(
      _kernel, wgrad_kw=wgrad_kw, n_comm=n_comm, num_sms=num_sms, item_rows=item_rows,
      col_tile=col_tile, num_wgrads=len(wgrads),
      transfer_kw=dict(w=w, axis_name=axis_name, num_peers=seg_len.shape[0]))
  kernel_fn = plgpu.kernel(
      body,
      kernel_name="wgrad_with_return",
      out_type=(*out_types, jax.ShapeDtypeStruct((out_rows, hidden), rows.dtype)),
      grid=(num_sms,),
      grid_names=("sm",),
      num_threads=gg._NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )
  *dws, back = kernel_fn(work.reshape(-1), rows, *operands)
  dws = [dw[:, :k, :n] if (k_p, n_p) != (k, n) else dw
         for dw, (k, n, k_p, n_p) in zip(dws, shapes)]
  return dws, back
