"""The NVLink row transfer's local form in the CPU interpret mode: work list,
load/store pipeline and the TMA store ladder (rows outside segments untouched)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.experimental.pallas import mosaic_gpu as plgpu
from pallas_kernels import ep_transfer


def _segments(rng, src_rows, out_rows, n_seg):
  """Random disjoint src and dst segments (some empty), in a random dst order."""
  cuts = np.sort(rng.choice(np.arange(1, src_rows), n_seg - 1, replace=False))
  bounds = np.concatenate([[0], cuts, [src_rows]])
  lens = np.diff(bounds)
  lens[rng.integers(0, n_seg)] = 0                    # an empty segment
  src = bounds[:-1]
  perm = rng.permutation(n_seg)
  gaps = rng.integers(0, 3, n_seg)
  dst = np.zeros(n_seg, int)
  pos = 0
  for i in perm:
    pos += gaps[i]
    dst[i] = pos
    pos += lens[i]
  assert pos <= out_rows
  return [jnp.asarray(a, jnp.int32) for a in (src, dst, lens, np.zeros(n_seg))]


@pytest.mark.parametrize("chunk,src_rows,n_seg,num_ctas", [(8, 53, 5, 3), (16, 100, 9, 4), (32, 20, 3, 2)])
def test_local_transfer_matches_numpy(chunk, src_rows, n_seg, num_ctas):
  rng = np.random.default_rng(chunk + src_rows)
  h, out_rows = 128, src_rows + 3 * n_seg
  x = jax.random.normal(jax.random.key(0), (src_rows, h), jnp.float32).astype(jnp.bfloat16)
  seg_src, seg_dst, seg_len, seg_peer = _segments(rng, src_rows, out_rows, n_seg)
  cfg = ep_transfer.TransferConfig(chunk_rows=chunk, col_tile=64, num_ctas=num_ctas)
  out = ep_transfer.transfer_segments(
      x, seg_src, seg_dst, seg_len, seg_peer, out_rows=out_rows, config=cfg,
      interpret=plgpu.InterpretGPUParams(detect_races=True))
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  assert not gpu_callbacks.get_races().races_found, "race detector reported a race"
  out = np.asarray(out.astype(jnp.float32))
  xs = np.asarray(x.astype(jnp.float32))
  covered = np.zeros(out_rows, bool)
  for s, d, n in zip(*(np.asarray(a) for a in (seg_src, seg_dst, seg_len))):
    np.testing.assert_array_equal(out[d:d + n], xs[s:s + n])
    covered[d:d + n] = True
  # interpret mode fills unwritten output with NaN: nothing outside a segment was written
  assert np.isnan(out[~covered]).all()


def test_work_list_bounds():
  seg_len = jnp.array([0, 5, 17, 8], jnp.int32)
  work = ep_transfer.work_list(jnp.array([0, 0, 5, 22]), jnp.array([100, 0, 50, 7]), seg_len,
                               jnp.array([0, 1, 2, 3]), src_rows=30, chunk_rows=8)
  w = (work.shape[0] - 1) // 4
  assert w == 4 + 4 and int(work[-1]) == 1 + 3 + 1
  rows = np.asarray(work[2 * w:3 * w])
  assert rows.sum() == 30 and rows[:5].tolist() == [5, 8, 8, 1, 8]


def test_config_errors():
  with pytest.raises(ValueError, match="chunk_rows"):
    ep_transfer.TransferConfig(chunk_rows=48)
  with pytest.raises(ValueError, match="col_tile"):
    ep_transfer.TransferConfig(col_tile=512)
