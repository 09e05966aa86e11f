"""The NVLink row transfer's local form in the CPU interpret mode: per-peer work
lists, the load/store pipeline and the TMA store ladder (rows outside segments
are never written)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.experimental.pallas import mosaic_gpu as plgpu
from pallas_kernels import ep_transfer
from pallas_kernels.ep_transfer import TransferConfig


def _segments(rng, src_rows, out_rows, peers, per_peer):
  """Random disjoint src and dst segments [peers, per_peer] (some empty)."""
  n_seg = peers * per_peer
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
  return [jnp.asarray(a.reshape(peers, per_peer), jnp.int32) for a in (src, dst, lens)]


@pytest.mark.parametrize("chunk,src_rows,peers,per_peer,num_ctas,rank",
                         [(8, 53, 1, 5, 3, 0), (16, 100, 3, 3, 4, 1), (32, 20, 2, 2, 2, 1)])
def test_local_transfer_matches_numpy(chunk, src_rows, peers, per_peer, num_ctas, rank):
  rng = np.random.default_rng(chunk + src_rows)
  h, out_rows = 128, src_rows + 3 * peers * per_peer
  x = jax.random.normal(jax.random.key(0), (src_rows, h), jnp.float32).astype(jnp.bfloat16)
  seg_src, seg_dst, seg_len = _segments(rng, src_rows, out_rows, peers, per_peer)
  cfg = TransferConfig(chunk_rows=chunk, col_tile=64, num_ctas=num_ctas)
  out = ep_transfer.transfer_segments(
      x, seg_src, seg_dst, seg_len, out_rows=out_rows, config=cfg, rank=rank,
      interpret=plgpu.InterpretGPUParams(detect_races=True))
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  assert not gpu_callbacks.get_races().races_found, "race detector reported a race"
  out = np.asarray(out.astype(jnp.float32))
  xs = np.asarray(x.astype(jnp.float32))
  covered = np.zeros(out_rows, bool)
  for s, d, n in zip(*(np.asarray(a).ravel() for a in (seg_src, seg_dst, seg_len))):
    np.testing.assert_array_equal(out[d:d + n], xs[s:s + n])
    covered[d:d + n] = True
  # interpret mode fills unwritten output with NaN: nothing outside a segment was written
  assert (~covered).any() and np.isnan(out[~covered]).all()


@pytest.mark.parametrize("chunk,src_rows,index_rows,peers,per_peer,num_ctas,h,budget",
                         [(32, 40, 90, 2, 3, 3, 256, 8192), (4, 9, 30, 3, 2, 2, 128, None)])
def test_local_gathered_transfer_equals_transfer_of_gathered_rows(
    monkeypatch, chunk, src_rows, index_rows, peers, per_peer, num_ctas, h, budget):
  """src_index (the de-duplicated dispatch's sources, `uniep_jax.transport.send_unique`):
  the loads read src[index[i]] row by row, [1, nb, ct] boxes; the output equals the
  plain transfer of the gathered rows bit for bit, nothing outside a segment written
  (short chunks reload their last row into stage rows the store ladder never stores),
  no race. Case 1: chunk_rows 32 -> items of GATHER_ITEM_ROWS (16) rows, loaded 8 per
  loop iteration (two iterations), rows of 4 boxes in two column blocks of 2 (a small
  stage budget); case 2: 4-row items, one block."""
  from pallas_kernels import row_gather
  if budget is not None:
    monkeypatch.setattr(ep_transfer, "GATHER_UNROLL", 8)
    monkeypatch.setattr(ep_transfer, "column_blocking",
                        functools.partial(row_gather.column_blocking, budget=budget))
    assert ep_transfer.column_blocking(h, 2, ep_transfer.GATHER_ITEM_ROWS,
                                       max_col_tile=64) == (64, 2)
  rng = np.random.default_rng(index_rows)
  out_rows = index_rows + 3 * peers * per_peer
  x = jax.random.normal(jax.random.key(1), (src_rows, h), jnp.float32).astype(jnp.bfloat16)
  index = jnp.asarray(rng.integers(0, src_rows, index_rows), jnp.int32)  # repeats too
  seg_src, seg_dst, seg_len = _segments(rng, index_rows, out_rows, peers, per_peer)
  cfg = TransferConfig(chunk_rows=chunk, col_tile=64, num_ctas=num_ctas)
  run = lambda src, **kw: ep_transfer.transfer_segments(  # noqa: E731
      src, seg_src, seg_dst, seg_len, out_rows=out_rows, config=cfg, rank=1,
      interpret=plgpu.InterpretGPUParams(detect_races=True), **kw)
  gathered = run(x, src_index=index)
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  assert not gpu_callbacks.get_races().races_found, "race detector reported a race"
  plain = run(jnp.take(x, index, axis=0))
  np.testing.assert_array_equal(np.asarray(gathered.view(jnp.uint16)),
                                np.asarray(plain.view(jnp.uint16)))   # NaN rows: unwritten
  covered = np.zeros(out_rows, bool)
  for d, n in zip(*(np.asarray(a).ravel() for a in (seg_dst, seg_len))):
    covered[d:d + n] = True
  assert (~covered).any() and np.isnan(np.asarray(gathered[~covered], np.float32)).all()


def test_work_lists_rotate_and_cover():
  seg_len = jnp.array([[0, 5], [17, 8]], jnp.int32)
  seg_src = jnp.array([[0, 0], [5, 22]], jnp.int32)
  seg_dst = jnp.array([[100, 0], [50, 7]], jnp.int32)
  work = ep_transfer.work_lists(seg_src, seg_dst, seg_len, rank=1, src_rows=30, chunk_rows=8)
  w = (work.shape[1] - 1) // 3
  assert w == 4 + 2
  # row 0 holds this rank's own segments (peer 1), row 1 peer 0
  assert int(work[0, -1]) == 3 + 1 and int(work[1, -1]) == 1
  np.testing.assert_array_equal(np.asarray(work[0, 2 * w:2 * w + 4]), [8, 8, 1, 8])
  assert int(work[1, 2 * w]) == 5 and int(work[1, w]) == 0


def test_config_errors():
  with pytest.raises(ValueError, match="chunk_rows"):
    TransferConfig(chunk_rows=48)
  with pytest.raises(ValueError, match="col_tile"):
    TransferConfig(col_tile=512)


def test_launch_contract_and_smem_fit():
  # The transfer relies on Mosaic GPU's cross-device barrier before each launch
  # (see the module docstring): its default must stay on.
  assert plgpu.CompilerParams().skip_device_barrier is False
  # float32 rows get a narrower column tile so that two stages fit in shared memory
  cfg = TransferConfig()
  assert cfg.col_tile_for(7168, itemsize=2, smem_bytes=227 * 1024) == 256
  assert cfg.col_tile_for(7168, itemsize=4, smem_bytes=227 * 1024) == 224
  assert 2 * cfg.chunk_rows * 224 * 4 <= 227 * 1024
  with pytest.raises(ValueError, match="chunk_rows"):
    TransferConfig(chunk_rows=4096).col_tile_for(7168, itemsize=4, smem_bytes=227 * 1024)


@pytest.mark.parametrize("gathered", [False, True])
def test_communicating_transfer_lowers_for_cuda(mesh_factory, gathered):
  """The NVLink form (remote TMA stores, semaphores, static peer loop) lowers to a
  Mosaic GPU custom call for CUDA on this CPU-only machine, also with its loads
  gathered by index; it runs in bench/check_moe_gpu.py on GPUs."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  r, el, ns, h = 4, 2, 256, 512
  mesh = mesh_factory(1, r)

  def body(x, s, d, n):
    index = jnp.arange(ns - 1, -1, -1, dtype=jnp.int32) if gathered else None
    return ep_transfer.transfer_segments(x, s[0], d[0], n[0], out_rows=r * ns,
                                         config=TransferConfig(num_ctas=8),
                                         axis_name="expert", src_index=index,
                                         interpret=False)

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P("expert"),) * 4, out_specs=P("expert"),
                     check_vma=False)
  sh = NamedSharding(mesh, P("expert"))
  spec = lambda shape, dt=jnp.int32: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
  lowered = jax.jit(fn).trace(spec((r * ns, h), jnp.bfloat16), spec((r, r, el)),
                              spec((r, r, el)), spec((r, r, el))).lower(
                                  lowering_platforms=("cuda",))
  assert "mosaic_gpu" in lowered.as_text()
