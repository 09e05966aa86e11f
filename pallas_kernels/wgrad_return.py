"""The backward's dX return transfer beside a wgrad, in one launch.

In `moe_ffn` as the "uniep" backend's overlap point
`UniEPConfig(overlap=OverlapConfig(wgrad_return_ctas=N))` (uniep_jax/overlap.py). Why:
the return of d_recv to the source ranks (an NVLink transfer) and the dw_gate_up weight
gradient run one after the other on one stream otherwise, although neither needs the
other. Pallas kernels cannot run on a second stream, so this launch gives the transfer
a few CTAs and the wgrad the rest (a transfer keeps most of its rate on a quarter of
its CTAs; docs/performance.md has the measurements).

Roles (by CTA index c on "sm", grid = num_sms, 3 warpgroups each)
------------------------------------------------------------------
  c <  n_comm   transfer CTAs: warpgroup 0 runs `ep_transfer._transfer_body` (the
                return's: every (peer, local expert) segment of `rows` pushed into
                the source rank's sorted rows, remote peers first) on CTAs
                [0, n_comm); the other two warpgroups idle.
  c >= n_comm   wgrad CTAs: `grouped_gemm._wgrad_kernel`'s body on CTAs
                [n_comm, num_sms) (local CTA i takes output tiles i, i + (num_sms -
                n_comm), ...). Each output tile is summed whole by one CTA in its
                fixed block_k order, so dw has the standalone wgrad's bits.

Buffers
-------
  lhs [M_p, K_p], dout [M_p, N_p]   the wgrad's operands (padded as `gmm_wgrad` pads)
  rows [Nr, H]                      what the transfer sends (d_recv, the receive layout)
  dw [G, K_p, N_p]                  output
  back [out_rows, H]                output; PEERS write into it (remote TMA stores).
                                    Rows no segment covers are undefined.
  SMEM: the transfer role's 2 stages [chunk_rows, col_tile] and the wgrad's pipeline
  and epilogue are `run_scoped` in sibling branches: each must fit alone.

Synchronisation contract
------------------------
  The transfer role's, unchanged (ep_transfer.py): Mosaic GPU's cross-device barrier
  before the launch (skip_device_barrier=False, kept), ready_sem[c] and done_sem[c]
  per transfer CTA (allocated at this kernel's top level), each with one waiter.
  When every transfer CTA is past its done wait, every peer's writes into this
  rank's `back` have landed. The wgrad CTAs neither signal nor wait: they share no
  buffer with the transfer (rows is read-only here; dw is local). All num_sms CTAs
  must be resident at once (1 CTA per SM).
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
from pallas_kernels.ep_transfer import TransferConfig
from pallas_kernels.grouped_gemm import KernelConfig


def _kernel(bounds_gmem, work_gmem, lhs_gmem, dout_gmem, rows_gmem, dw_gmem, back_gmem, *,
            wgrad_kw: dict, transfer_kw: dict, n_comm: int, num_sms: int, item_rows: int,
            col_tile: int):
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
    gg._wgrad_kernel(bounds_gmem, lhs_gmem, dout_gmem, dw_gmem, cta_offset=n_comm,
                     num_ctas=num_sms - n_comm, **wgrad_kw)


def gmm_wgrad_with_return(lhs, dout, group_sizes, rows, seg_src, seg_dst, seg_len, *,
                          out_rows: int, axis_name: str, out_dtype=None,
                          config: KernelConfig = KernelConfig(),
                          transfer: TransferConfig = TransferConfig(), n_comm: int = 16):
  """(dw, back): dw = `grouped_gemm.gmm_wgrad(lhs, dout, group_sizes)` (same bits) and
  back = `ep_transfer.transfer_segments(rows, seg_src, seg_dst, seg_len, out_rows=...,
  axis_name=...)` (same rows), in one launch. Inside `shard_map` over `axis_name`;
  GPU only (remote refs and semaphores)."""
  m, k = lhs.shape
  if dout.shape[0] != m:
    raise ValueError(f"lhs.shape={lhs.shape} and dout.shape={dout.shape}: M differs")
  if dout.dtype != lhs.dtype:
    raise ValueError(f"lhs and dout must share one dtype, got {lhs.dtype} and {dout.dtype}")
  out_dtype = out_dtype or lhs.dtype
  num_sms = device_lib.num_sms(config.num_sms)
  if not 1 <= n_comm < num_sms:
    raise ValueError(f"n_comm={n_comm} must be in [1, num_sms={num_sms}) (at least one "
                     f"wgrad CTA)")
  n = dout.shape[1]
  g = group_sizes.shape[0]
  k_p = gg._round_up(k, gg._NUM_COMPUTE_WGS * config.block_m)
  n_p = gg._round_up(n, config.block_n)
  m_p = gg._padded_rows(m, config, wgrad=True)
  lhs_p = gg._pad_axis(gg._pad_axis(lhs, 1, k_p), 0, m_p)
  dout_p = gg._pad_axis(gg._pad_axis(dout, 1, n_p), 0, m_p)
  wgrad_kw = gg.wgrad_params(m_p, g, lhs.dtype, out_dtype, config)

  ns, hidden = rows.shape
  smem = device_lib.smem_capacity()
  col_tile = transfer.col_tile_for(hidden, itemsize=jnp.dtype(rows.dtype).itemsize,
                                   smem_bytes=smem - gg._SMEM_RESERVE)
  item_rows = transfer.chunk_rows
  if ns < item_rows:   # the load box must fit inside rows (as in `transfer_segments`)
    rows = jnp.pad(rows, ((0, item_rows - ns), (0, 0)))
  work = ep_transfer.work_lists(seg_src, seg_dst, seg_len, rank=lax.axis_index(axis_name),
                                src_rows=rows.shape[0], chunk_rows=item_rows)
  w = (work.shape[1] - 1) // 3
  body = functools.partial(
      _kernel, wgrad_kw=wgrad_kw, n_comm=n_comm, num_sms=num_sms, item_rows=item_rows,
      col_tile=col_tile,
      transfer_kw=dict(w=w, axis_name=axis_name, num_peers=seg_len.shape[0]))
  kernel_fn = plgpu.kernel(
      body,
      kernel_name="wgrad_with_return",
      out_type=(jax.ShapeDtypeStruct((g, k_p, n_p), out_dtype),
                jax.ShapeDtypeStruct((out_rows, hidden), rows.dtype)),
      grid=(num_sms,),
      grid_names=("sm",),
      num_threads=gg._NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )
  dw, back = kernel_fn(gg.wgrad_bounds(group_sizes, m_p), work.reshape(-1), lhs_p, dout_p, rows)
  return (dw[:, :k, :n] if (k_p, n_p) != (k, n) else dw), back
