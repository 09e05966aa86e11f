"""TMA helpers shared by the kernels."""

from __future__ import annotations

from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu


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
