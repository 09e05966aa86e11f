"""Row segments pushed over NVLink from inside a Pallas Mosaic GPU kernel.

The transport of the `"uniep"` backend: each EP rank writes its token rows
straight into the owner's buffer at the offsets of the deterministic receive
layout (`uniep_jax/layout.py`), and the owners write the expert outputs straight
back. No staging buffer, no NCCL, and no atomics: every row's destination is
computed from the routing before the launch, so arrival order cannot change
where anything lands.

Problem
-------
  src       [Ns, H]  this rank's rows (sorted rows for a dispatch, the receive
                     layout for a return)
  segments  S of them: (src_start, dst_start, rows, peer): copy
            src[src_start : src_start + rows] to out[dst_start : ...] ON `peer`
  out       [Nd, H]  the kernel's output; peers write into it (collective
                     metadata mode: one process drives all local GPUs, and XLA
                     gives a kernel output the same address on every device).
Rows of `out` that no segment covers are left untouched (their contents are
undefined); callers that need zeros there write them (see `push_rows`).

Work list and tiling
--------------------
Before the launch, plain JAX cuts every segment into chunks of `chunk_rows`
rows (the last chunk of a segment may be shorter) and lists them, at most
W = cdiv(Ns, chunk_rows) + S items of (src_row, dst_row, rows, peer), plus the
live count. Items are ordered segment by segment; `segment_order` decides the
segment order ("interleaved": by local expert, then peer rotated from this rank,
so that consecutive items, which go to different CTAs, load every NVLink at
once; "peer_major": all of one peer's rows first). Nothing here is unrolled over
segments: compile time does not depend on S.

Grid: `num_ctas` CTAs ("cta"), one warpgroup each. CTA c takes items
c, c + num_ctas, ... . An item is moved column tile by column tile
([chunk_rows, col_tile], col_tile <= 256, the TMA box limit):

    GMEM src --TMA load--> SMEM stage s --TMA store ladder--> (peer) GMEM out

SMEM: `stages` (= 2) buffers of [chunk_rows, col_tile] in the src dtype, no
swizzle (a store may start at any row of the buffer). 2 x 128 x 256 x 2 B =
128 KiB for the default bf16 config.

A chunk of `rows` < chunk_rows rows is stored with one TMA per set bit of
`rows` (largest first), so rows outside the segment are never written: two
sources write adjacent segments of one peer's buffer without overlap.

Synchronisation contract
------------------------
  load_barrier[s]  (SMEM barrier, one per stage): producer the TMA load of
      step i into stage s = i % 2; consumer the same CTA's store of step i,
      after `barrier_wait`. Re-armed by every load (phase flips).
  stage reuse: before loading step i + 1 into stage 1 - s, the CTA waits
      `wait_smem_to_gmem(0, wait_read_only=True)`: the stores of step i - 1
      have finished reading that stage.
  ready_sem[c]  (global semaphore per CTA index, communicating mode only):
      at entry CTA c signals ready_sem[c] on every rank of the expert axis
      (itself included), then waits for R signals with decrement (so it is
      0 again for the next launch). Invariant after the wait: every peer runs
      this kernel, so its `out` buffer is allocated and no earlier op of the
      peer still uses that memory.
  done_sem[c]  (global semaphore per CTA index): after `wait_smem_to_gmem(0)`
      (all of CTA c's stores complete), CTA c signals done_sem[c] on every
      rank; then waits for R signals with decrement. A signal orders the NVLink
      writes issued before it. Invariant when the kernel ends (all CTAs past
      this wait): every peer's CTA c, for every c, has finished writing into
      this rank's `out`, so the next XLA op may read it.
  Both waits are done by exactly one CTA per semaphore (CTA c waits only on
  index c), so no CTA can take another's count. All ranks launch the same
  num_ctas, and num_ctas <= the SM count, so all CTAs are resident and the
  barrier cannot deadlock.
The local (non-communicating) form has no semaphores and writes every segment
into this device's `out`: it runs in the CPU interpret mode, so the work list,
the pipeline and the store ladder are tested on the CPU.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import device as device_lib
from uniep_jax.config import SEGMENT_ORDERS, TransferConfig  # noqa: F401  (re-exported)


def work_list(seg_src, seg_dst, seg_len, seg_peer, *, src_rows: int, chunk_rows: int):
  """Cuts segments into chunk items. Returns int32 [4 * W + 1]:
  src_row[W], dst_row[W], rows[W], peer[W], live item count; W = max items."""
  seg_len = seg_len.astype(jnp.int32)
  num_seg = seg_len.shape[0]
  w = pl.cdiv(src_rows, chunk_rows) + num_seg
  chunks = (seg_len + chunk_rows - 1) // chunk_rows                 # [S]
  ends = jnp.cumsum(chunks)
  starts = ends - chunks
  i = jnp.arange(w, dtype=jnp.int32)
  seg = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)
  valid = seg < num_seg
  seg = jnp.minimum(seg, num_seg - 1)
  j = i - starts[seg]
  src_row = seg_src[seg] + j * chunk_rows
  dst_row = seg_dst[seg] + j * chunk_rows
  rows = jnp.where(valid, jnp.minimum(chunk_rows, seg_len[seg] - j * chunk_rows), 0)
  peer = seg_peer[seg]
  z = lambda a: jnp.where(valid, a, 0).astype(jnp.int32)  # noqa: E731
  return jnp.concatenate([z(src_row), z(dst_row), rows.astype(jnp.int32), z(peer),
                          ends[-1:].astype(jnp.int32)])


def _ladder_store(src_smem, dst_gmem, smem_start, gmem_start, count, max_rows: int):
  """Rows [smem_start, smem_start + count) of src_smem to dst_gmem[gmem_start:];
  one TMA per set bit of count, largest first."""
  size = max_rows
  while size >= 1:
    @pl.when((count & size) != 0)
    def _(size=size, smem_start=smem_start, gmem_start=gmem_start):
      plgpu.copy_smem_to_gmem(src_smem.at[pl.ds(smem_start, size)],
                              dst_gmem.at[pl.ds(gmem_start, size)])
    smem_start = smem_start + (count & size)
    gmem_start = gmem_start + (count & size)
    size //= 2


def _transfer_body(work_gmem, src_gmem, out_gmem, stage_smem, load_barrier, *,
                   w: int, chunk_rows: int, col_tile: int, num_ctas: int,
                   axis_name, num_peers: int):
  """One CTA's share of the work list. `axis_name=None`: the local form."""
  ns, hidden = src_gmem.shape
  n_col = hidden // col_tile
  c = lax.axis_index("cta")
  live = work_gmem[4 * w]
  my_items = jnp.maximum(live - c + num_ctas - 1, 0) // num_ctas
  steps = my_items * n_col

  if axis_name is not None:
    me = lax.axis_index(axis_name)
    ready_sem = pl.get_global(plgpu.SemaphoreType.REGULAR((num_ctas,)))
    done_sem = pl.get_global(plgpu.SemaphoreType.REGULAR((num_ctas,)))
    for p in range(num_peers):
      pl.semaphore_signal(ready_sem.at[c], device_id={axis_name: p})
    pl.semaphore_wait(ready_sem.at[c], num_peers)

  def item_col(s):
    return c + (s // n_col) * num_ctas, (s % n_col) * col_tile

  def load_row(it):
    # The load box never leaves src: near the end it starts earlier and the
    # item's rows sit further down the stage buffer.
    return jnp.minimum(work_gmem[it], ns - chunk_rows)

  def load(s, stage):
    it, col = item_col(s)
    plgpu.copy_gmem_to_smem(src_gmem.at[pl.ds(load_row(it), chunk_rows), pl.ds(col, col_tile)],
                            stage_smem.at[stage], load_barrier.at[stage])

  @pl.when(steps > 0)
  def _():
    load(0, 0)

  def step(s, carry):
    stage = lax.rem(s, 2)
    plgpu.barrier_wait(load_barrier.at[stage])

    @pl.when(s + 1 < steps)
    def _():
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # stage 1 - s is free
      load(s + 1, 1 - stage)

    it, col = item_col(s)
    smem_row = work_gmem[it] - load_row(it)
    dst_row = work_gmem[w + it]
    rows = work_gmem[2 * w + it]
    if axis_name is None:
      _ladder_store(stage_smem.at[stage], out_gmem.at[:, pl.ds(col, col_tile)],
                    smem_row, dst_row, rows, chunk_rows)
    else:
      peer = work_gmem[3 * w + it]

      @pl.when(peer == me)
      def _():
        _ladder_store(stage_smem.at[stage], out_gmem.at[:, pl.ds(col, col_tile)],
                      smem_row, dst_row, rows, chunk_rows)

      @pl.when(peer != me)
      def _():
        remote = plgpu.remote_ref(out_gmem, {axis_name: peer})
        _ladder_store(stage_smem.at[stage], remote.at[:, pl.ds(col, col_tile)],
                      smem_row, dst_row, rows, chunk_rows)
    return carry

  lax.fori_loop(0, steps, step, 0)
  plgpu.wait_smem_to_gmem(0)

  if axis_name is not None:
    for p in range(num_peers):
      pl.semaphore_signal(done_sem.at[c], device_id={axis_name: p})
    pl.semaphore_wait(done_sem.at[c], num_peers)


def transfer_segments(src, seg_src, seg_dst, seg_len, seg_peer, *, out_rows: int,
                      config: TransferConfig = TransferConfig(), axis_name=None,
                      num_peers: int = 1, interpret=None):
  """Copies row segments of `src` [Ns, H] into a new [out_rows, H] buffer.

  axis_name=None: the local form, every segment lands in this device's output
  (peers ignored; runs in the CPU interpret mode). Otherwise, inside a
  `shard_map` over `axis_name` of size `num_peers`: segment i lands in the
  output of rank seg_peer[i] (collective metadata mode; GPU only).
  Rows no segment covers are undefined.
  """
  ns, hidden = src.shape
  col_tile = config.col_tile_for(hidden)
  chunk = config.chunk_rows
  if ns < chunk:  # the load box must fit inside src
    src = jnp.pad(src, ((0, chunk - ns), (0, 0)))
  num_ctas = min(config.num_ctas, device_lib.num_sms())
  work = work_list(seg_src, seg_dst, seg_len, seg_peer, src_rows=ns, chunk_rows=chunk)
  w = (work.shape[0] - 1) // 4
  body = functools.partial(_transfer_body, w=w, chunk_rows=chunk, col_tile=col_tile,
                           num_ctas=num_ctas, axis_name=axis_name, num_peers=num_peers)
  if interpret is None:
    interpret = plgpu.InterpretGPUParams() if jax.default_backend() == "cpu" else False
  if axis_name is not None and interpret:
    raise ValueError("the communicating transfer needs a GPU (remote refs and semaphores "
                     "do not run in the interpret mode); use axis_name=None on the CPU")
  kernel = plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((out_rows, hidden), src.dtype),
      scratch_types=[plgpu.SMEM((2, chunk, col_tile), src.dtype),
                     plgpu.Barrier(num_barriers=2)],
      grid=(num_ctas,),
      grid_names=("cta",),
      interpret=interpret,
  )
  return kernel(work, src)
