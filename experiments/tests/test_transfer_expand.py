"""The de-duplicated dispatch's transfer and expansion in one launch
(pallas_kernels/transfer_expand.py): its local form in the CPU interpret mode, bit for
bit against the two launches it replaces (ep_transfer.transfer_segments with gathered
loads, then row_gather.gather_live_rows), and the communicating kernel's lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.experimental.pallas import mosaic_gpu as plgpu
from pallas_kernels import ep_transfer, row_gather, transfer_expand
from uniep_jax import TransferConfig
from test_ep_transfer import _segments


def _copy_blocks(rng, live, peers, el):
  """[peers, El] (start, rows) blocks tiling [0, live) in (le, source) order, some empty
  (the receive layout's (local expert, source) blocks, `layout.return_segments`)."""
  cuts = rng.choice(np.arange(1, live), peers * el - 2, replace=False)
  cuts = np.sort(np.concatenate([cuts, cuts[:1]]))    # a cut twice: an empty block
  lens = np.diff(np.concatenate([[0], cuts, [live]]))
  assert lens.sum() == live and (lens == 0).sum() == 1
  start = np.concatenate([[0], np.cumsum(lens)[:-1]])
  # block le * peers + s holds source s's rows of expert le
  as_src_le = lambda a: a.reshape(el, peers).T  # noqa: E731
  return (jnp.asarray(as_src_le(start), jnp.int32), jnp.asarray(as_src_le(lens), jnp.int32))


@pytest.mark.parametrize("chunk,peers,el,num_ctas,copy_ctas,rank,scaled,h,last_on_all,stages", [
    # items of 16 rows (the default), 3 sources, a rotated walk, the weighted copy (the
    # backward's), rows of 12 boxes in 2 column blocks of 6 (as H 7168's 4 blocks of 7)
    (128, 3, 2, 3, 2, 1, True, 3072, False, 2),
    # items of 4 rows, one block, the plain copy, the last source's copies dealt over
    # the transfer CTAs too (expand_last_on_all)
    (4, 2, 3, 2, 3, 0, False, 256, True, 2),
    # the copies through 3 SMEM stages (TransferConfig.copy_stages)
    (16, 3, 2, 2, 2, 2, True, 3072, True, 3)])
def test_local_form_equals_transfer_then_gather(chunk, peers, el, num_ctas, copy_ctas, rank,
                                                scaled, h, last_on_all, stages):
  assert row_gather.column_blocking(h, 2, min(chunk, 16)) == ((256, 6) if h == 3072 else (256, 1))
  rng = np.random.default_rng(chunk)
  src_rows, index_rows, live, out_rows = 30, 70, 90, 100
  unique_rows = index_rows + 3 * peers * el
  x = jax.random.normal(jax.random.key(2), (src_rows, h), jnp.float32).astype(jnp.bfloat16)
  src_index = jnp.asarray(rng.integers(0, src_rows, index_rows), jnp.int32)
  seg_src, seg_dst, seg_len = _segments(rng, index_rows, unique_rows, peers, el)
  covered = np.concatenate([np.arange(d, d + n) for d, n in
                            zip(np.asarray(seg_dst).ravel(), np.asarray(seg_len).ravel())])
  index = jnp.asarray(rng.choice(covered, out_rows - 5), jnp.int32)   # written rows only
  copy_start, copy_len = _copy_blocks(rng, live, peers, el)
  scale = jnp.asarray(rng.standard_normal(index.shape[0]), jnp.float32) if scaled else None
  cfg = TransferConfig(chunk_rows=chunk, num_ctas=num_ctas, expand_in_transfer=True,
                       copy_ctas=copy_ctas, expand_last_on_all=last_on_all,
                       copy_stages=stages)
  detect = plgpu.InterpretGPUParams(detect_races=True)
  got = transfer_expand.transfer_expand(
      x, seg_src, seg_dst, seg_len, copy_start, copy_len, index, src_index=src_index,
      unique_rows=unique_rows, out_rows=out_rows, scale=scale, config=cfg, rank=rank,
      interpret=detect)
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
  assert not gpu_callbacks.get_races().races_found, "race detector reported a race"
  unique = ep_transfer.transfer_segments(x, seg_src, seg_dst, seg_len, out_rows=unique_rows,
                                         config=cfg, rank=rank, src_index=src_index,
                                         interpret=detect)
  want = row_gather.gather_live_rows(unique, index, jnp.int32(live), out_rows=out_rows,
                                     scale=scale, interpret=detect)
  bits = lambda a: np.asarray(a[:live].view(jnp.uint16))  # noqa: E731
  np.testing.assert_array_equal(bits(got), bits(want))
  # and against numpy: recv[p] = x[src_index[i]], i the row unique[index[p]] holds
  holder = np.full(unique_rows, -1)
  for s, d, n in zip(*(np.asarray(a).ravel() for a in (seg_src, seg_dst, seg_len))):
    holder[d:d + n] = np.arange(s, s + n)
  held = holder[np.asarray(index)[:live]]
  expanded = np.asarray(x.astype(jnp.float32))[np.asarray(src_index)[held]]
  got32 = np.asarray(got[:live].astype(jnp.float32))
  if scaled:   # a real multiply
    assert not np.array_equal(got32, expanded)
  else:
    np.testing.assert_array_equal(got32, expanded)
  assert np.isnan(np.asarray(got[live:], np.float32)).all()   # rows past live: unwritten


@pytest.mark.parametrize("last_on_all", [False, True])
def test_copy_walks_deal_every_item_once(last_on_all):
  """Over all copy and transfer CTAs, every item of every offset's copy list goes to
  exactly one CTA (items i, i + n, ... of each walk), the last offset's over all of them
  with expand_last_on_all."""
  n_copy, num_ctas, peers, items = 3, 2, 4, 11
  taken = np.zeros((peers, items), int)
  for role, count in (("copy", n_copy), ("transfer", num_ctas)):
    for cta in range(count):
      for first, end, index, dealt in transfer_expand.copy_walks(
          cta, role=role, n_copy=n_copy, num_ctas=num_ctas, num_peers=peers,
          last_on_all=last_on_all):
        assert 0 <= index < dealt
        taken[first:end, index::dealt] += 1
  assert (taken == 1).all()
  joined = transfer_expand.copy_walks(0, role="transfer", n_copy=n_copy, num_ctas=num_ctas,
                                      num_peers=peers, last_on_all=last_on_all)
  assert bool(joined) == last_on_all


def test_copy_lists_walk_the_sources_in_arrival_order():
  """Row j of the copy lists holds the blocks of source me - j (the rank that sends to
  this one at offset j), the transfer lists' row j those for peer me + j."""
  copy_len = jnp.array([[3, 0], [0, 5], [2, 2]], jnp.int32)      # [source, le]
  copy_start = jnp.array([[0, 10], [3, 10], [5, 15]], jnp.int32)
  work = ep_transfer.work_lists(copy_start, copy_start, copy_len, rank=1, src_rows=20,
                                chunk_rows=4, sign=-1)
  w = (work.shape[1] - 1) // 3
  items = [int(n) for n in work[:, -1]]
  assert items == [2, 1, 2]   # source 1 (5 rows: 4 + 1), source 0 (3), source 2 (2 + 2)
  np.testing.assert_array_equal(np.asarray(work[1, 2 * w:2 * w + 1]), [3])
  np.testing.assert_array_equal(np.asarray(work[2, w:w + 2]), [5, 15])
  assert transfer_expand.expand_order(4) == [0, 1, 2, 3]


@pytest.mark.parametrize("bound", [None, 100, 40])
def test_copy_lists_cover_the_live_rows_once_from_their_own_source(bound):
  """On real plans at EP 4 (skewed routing; receive bounds that drop rows): row j of a
  rank's copy lists holds only receive rows p from source me - j, whose unique-buffer
  row index[p] lies in that source's block (the rows its `arrived[j]` signal covers),
  and the items cover every receive row p < num_received exactly once, none past it."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from conftest import make_mesh
  from uniep_jax.dedup import plan_with_dedup
  from uniep_jax.layout import return_segments
  r, t, k, e = 4, 64, 4, 16
  mesh = make_mesh(1, r)
  rng = np.random.default_rng(0 if bound is None else bound)
  prob = np.ones(e)
  prob[:4] = 8
  topk = np.stack([rng.choice(e, k, replace=False, p=prob / prob.sum())
                   for _ in range(r * t)]).astype(np.int32)
  weights = rng.random((r * t, k)).astype(np.float32)

  def body(tk, tw):
    plan, d = plan_with_dedup(tk, tw, num_experts=e, axis_name="expert", top_k=k,
                              recv_rows=bound)
    me = jax.lax.axis_index("expert")
    blocks = return_segments(plan, me)
    index = d.unique_recv_offsets[plan.recv_source] + d.expand_position
    lists = ep_transfer.work_lists(blocks.src_start, blocks.src_start, blocks.rows, rank=me,
                                   src_rows=index.shape[0], chunk_rows=16, sign=-1)
    return tuple(a[None] for a in (lists, index, d.unique_recv_offsets,
                                   d.unique_counts[:, me], plan.num_received))

  sh = NamedSharding(mesh, P("expert"))
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("expert"),) * 2,
                             out_specs=P("expert"), check_vma=False))
  lists, index, offsets, incoming, live = map(np.asarray, fn(jax.device_put(topk, sh),
                                                             jax.device_put(weights, sh)))
  w = (lists.shape[2] - 1) // 3
  for me in range(r):
    covered = np.zeros(index.shape[1], int)
    for j in range(r):
      source, row = (me - j) % r, lists[me, j]
      for it in range(row[-1]):
        start, dst, n = row[it], row[w + it], row[2 * w + it]
        assert start == dst and 1 <= n <= 16
        p = np.arange(start, start + n)
        covered[p] += 1
        lo, hi = offsets[me, source], offsets[me, source] + incoming[me, source]
        assert ((index[me, p] >= lo) & (index[me, p] < hi)).all(), (me, j)
    assert (covered[:live[me]] == 1).all() and not covered[live[me]:].any()
  if bound is not None:   # the bound binds: rows were dropped
    assert (live <= bound).all() and (live == bound).any()


def test_errors_name_the_argument():
  with pytest.raises(ValueError, match="gather_rows"):
    TransferConfig(expand_in_transfer=True, gather_rows=False)
  with pytest.raises(ValueError, match="copy_ctas"):
    TransferConfig(copy_ctas=0)
  with pytest.raises(ValueError, match="expand_last_on_all"):
    TransferConfig(expand_last_on_all=True)
  x = jnp.zeros((8, 256), jnp.bfloat16)
  seg = jnp.zeros((2, 1), jnp.int32)
  kw = dict(src_index=jnp.zeros((4,), jnp.int32), unique_rows=8, out_rows=8)
  with pytest.raises(ValueError, match="copy_start"):
    transfer_expand.transfer_expand(x, seg, seg, seg, jnp.zeros((3, 1), jnp.int32), seg,
                                    jnp.zeros((4,), jnp.int32), **kw)
  with pytest.raises(ValueError, match="scale must be float32"):
    transfer_expand.transfer_expand(x, seg, seg, seg, seg, seg, jnp.zeros((4,), jnp.int32),
                                    scale=jnp.zeros((4,), jnp.bfloat16), **kw)


@pytest.mark.parametrize("scaled,last_on_all,bringup", [
    (False, False, ()), (True, True, ()),
    # the bring-up probe's bisection variants (bench/transfer_expand_probe.py) lower too
    (False, False, ("no_signal", "no_wait", "no_copy", "no_moves", "local_stores"))])
def test_communicating_kernel_lowers_for_cuda(mesh_factory, monkeypatch, scaled, last_on_all,
                                              bringup):
  """The NVLink form (remote TMA stores, the per-offset semaphores, both roles in one
  grid; the transfer CTAs joining the last offset's copies) lowers to one Mosaic GPU
  custom call for CUDA on this CPU-only machine."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  monkeypatch.setattr(transfer_expand, "BRINGUP", frozenset(bringup))
  r, el, ns, h = 4, 2, 256, 512
  mesh = mesh_factory(1, r)

  def body(x, s, d, n, cs, cn):
    src_index = jnp.arange(ns - 1, -1, -1, dtype=jnp.int32)
    index = jnp.arange(r * ns, dtype=jnp.int32) // 2
    scale = jnp.ones((r * ns,), jnp.float32) if scaled else None
    return transfer_expand.transfer_expand(
        x, s[0], d[0], n[0], cs[0], cn[0], index, src_index=src_index, unique_rows=r * ns,
        out_rows=r * ns, scale=scale,
        config=TransferConfig(num_ctas=8, expand_in_transfer=True, copy_ctas=8,
                              expand_last_on_all=last_on_all),
        axis_name="expert", interpret=False)

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P("expert"),) * 6, out_specs=P("expert"),
                     check_vma=False)
  sh = NamedSharding(mesh, P("expert"))
  spec = lambda shape, dt=jnp.int32: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
  text = jax.jit(fn).trace(spec((r * ns, h), jnp.bfloat16), *((spec((r, r, el)),) * 5)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
