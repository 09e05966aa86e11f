"""TMA helpers shared by the kernels."""

from __future__ import annotations

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


def two_stage_copy_loop(steps, load, store, load_barrier, *, stores_first: bool = False):
  """`copy_loop` with two stages (the form every kernel here uses)."""
  copy_loop(steps, load, store, load_barrier, stages=2, stores_first=stores_first)


def copy_loop(steps, load, store, load_barrier, *, stages: int = 2, stores_first: bool = False):
  """Steps 0 .. steps-1 of a GMEM -> SMEM -> GMEM copy through `stages` SMEM stages
  (step s in stage s mod stages): `load(s, stage)` issues step s's TMA loads into `stage`
  (arriving on load_barrier[stage]); `store(s, stage)` issues its stores from that stage.
  The loads of the next stages - 1 steps are in flight while a step is stored (2
  stages: one step ahead).

  Synchronisation: step s waits for its loads (`barrier_wait`; every load group is
  waited exactly once, phases alternating per stage), then, before loading step
  s + stages - 1 into the stage step s - 1 used, `wait_smem_to_gmem(0,
  wait_read_only=True)`: the store of step s - 1 (the only one issued from that stage
  since its load) has finished reading it. The first loads wait the same way for stores
  issued before the loop. The caller waits for its stores to land
  (`wait_smem_to_gmem(0)`) when it needs them complete.

  stores_first: step s's stores are issued BEFORE step s + 1's loads, for loads that
  take long to issue (a gather's one TMA per row): the CTA's stores stay in flight while
  it issues the next loads, where the default issues them between the previous store's
  end and this one's start. `store(s, stage)` must then issue step s's stores as ONE
  bulk-async group (`ladder_store(..., commit_group=False)`, then
  `plgpu.commit_smem_to_gmem_group()`), and the wait before loading step s + 1 is
  `wait_smem_to_gmem(1, wait_read_only=True)`: at most one group (step s's) still reads
  SMEM, so step s - 1's, the only one issued from that stage, has finished."""
  if stages < 2:
    raise ValueError(f"copy_loop needs at least 2 stages, got {stages}")
  ahead = stages - 1

  @pl.when(steps > 0)
  def _():
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # every stage free
    load(0, 0)

  for first in range(1, ahead):                       # (3+ stages) the other prefetches
    @pl.when(first < steps)
    def _(first=first):
      load(first, first)

  def step(s, carry):
    stage = lax.rem(s, stages)
    plgpu.barrier_wait(load_barrier.at[stage])
    if stores_first:
      store(s, stage)

    @pl.when(s + ahead < steps)
    def _():
      # step s - 1's stage is free (step s's own group may still read its stage)
      plgpu.wait_smem_to_gmem(1 if stores_first else 0, wait_read_only=True)
      load(s + ahead, 1 - stage if stages == 2 else lax.rem(s + ahead, stages))

    if not stores_first:
      store(s, stage)
    return carry

  lax.fori_loop(0, steps, step, 0)


def load_rows_by_index(row_of, src_gmem, stage_smem, barrier, *, rows: int, col, width: int,
                       unroll: int | None = None):
  """TMA-load stage rows 0 .. rows-1: stage row i <- src_gmem[row_of(i)], dimension-1
  slice [col, col + width) (columns of a 2-D src, boxes of a 3-D one), one [1, ...] box
  per row, each arriving once on `barrier` (which must count `rows` arrivals). `unroll`
  rows per loop iteration, their index reads independent (None or >= rows: one static
  loop). Shared by the live-rows gather (row_gather.py) and the transfer's gathered
  loads (ep_transfer.py)."""
  unroll = rows if unroll is None else min(rows, unroll)
  assert rows % unroll == 0, (rows, unroll)   # every row loads: no remainder

  def group(g, carry):
    for u in range(unroll):
      i = g * unroll + u
      plgpu.copy_gmem_to_smem(src_gmem.at[pl.ds(row_of(i), 1), pl.ds(col, width)],
                              stage_smem.at[pl.ds(i, 1)], barrier)
    return carry

  if unroll == rows:
    group(0, 0)
  else:
    lax.fori_loop(0, rows // unroll, group, 0)


def ladder_store(src_smem, dst_gmem, smem_start, gmem_start, count, max_rows: int, *,
                 commit_group: bool = True):
  """TMA-store rows [smem_start, smem_start + count) of src_smem to
  dst_gmem[gmem_start:...]; 0 <= count <= max_rows (a power of two). One TMA per
  set bit of count, largest first, so rows outside the range are never written:

      count = 5 = 0b101:   rows 0..3  <- one 4-row store
                           row  4     <- one 1-row store

  `dst_gmem` may be a peer's buffer (`plgpu.remote_ref`). commit_group=False: the
  stores join the caller's open bulk-async group (it commits them as one, with
  `plgpu.commit_smem_to_gmem_group`), else each store is its own group.
  """
  size = max_rows
  while size >= 1:
    @pl.when((count & size) != 0)
    def _(size=size, smem_start=smem_start, gmem_start=gmem_start):
      plgpu.copy_smem_to_gmem(src_smem.at[pl.ds(smem_start, size)],
                              dst_gmem.at[pl.ds(gmem_start, size)], commit_group=commit_group)
    smem_start = smem_start + (count & size)
    gmem_start = gmem_start + (count & size)
    size //= 2
