"""CPU tests of the EXPERIMENTAL overlapped de-duplicated dispatch ("Kernel D",
pallas_kernels/dedup_dispatch_gemm.py): its work lists (numpy), the readiness invariant
its copies wait on, its transfer and copy roles in their local form (interpret mode, race
detector on) against the rows the de-duplicated dispatch must deliver, its static checks,
and the LOWERING of the communicating kernel for CUDA (remote refs and semaphores do not
run in interpret mode)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels import dedup_dispatch_gemm as ddg
from pallas_kernels import fused_dispatch_gemm as fdg
from uniep_jax.config import FusedConfig, KernelConfig
from uniep_jax.dedup import (local_unique_routing, make_dedup_plan, packed_unique_index,
                             plan_with_dedup, sorted_weight_bits)
from uniep_jax.layout import local_group_sizes, make_plan
from pallas_testlib import INTERPRET_RACES, assert_no_races, fresh_interpret_state  # noqa: F401

_make_plan = jax.jit(make_plan, static_argnames=("recv_rows",))
_local_unique_routing = jax.jit(local_unique_routing, static_argnums=(3, 4, 5))
_make_dedup_plan = jax.jit(make_dedup_plan, static_argnums=(4, 5))


def _plans(ranks, tokens, top_k, experts, groups, seed=0, hot=None, recv_rows=None):
  """(topk, weights, plans, dplans) of every rank from random routing (recv_rows: a
  receive bound, the rows past it dropped)."""
  topks, weights = [], []
  for s in range(ranks):
    logits = jax.random.normal(jax.random.key(seed + s), (tokens, experts))
    if hot is not None:
      logits = logits.at[:, hot].add(100.0)
    topks.append(jax.lax.top_k(logits, top_k)[1].astype(jnp.int32))
    weights.append(jax.random.uniform(jax.random.key(seed + 100 + s), (tokens, top_k)))
  counts = jnp.stack([local_group_sizes(t, experts) for t in topks])
  plans = [_make_plan(t, counts, jnp.int32(s), recv_rows=recv_rows) for s, t in enumerate(topks)]
  local = [_local_unique_routing(t, p.sort_order, p.sorted_experts, ranks, experts // ranks,
                                 groups) for t, p in zip(topks, plans)]
  gathered = jnp.stack([jnp.concatenate([payload, sorted_weight_bits(w, p.sort_order)])
                        for (_, payload), w, p in zip(local, weights, plans)])
  dplans = [_make_dedup_plan(present, gathered, p, jnp.int32(s), top_k, groups)
            for s, ((present, _), p) in enumerate(zip(local, plans))]
  return topks, weights, plans, dplans


def test_group_work_lists_cover_every_row_once_group_by_group():
  rng = np.random.default_rng(0)
  r, g, tokens = 3, 4, 100
  seg_len = rng.integers(0, 30, (r, g))
  seg_len[1, 2] = 0                                   # an empty group
  seg_src = np.cumsum(seg_len, axis=1) - seg_len + 1000 * np.arange(r)[:, None]
  seg_dst = np.cumsum(seg_len, axis=1) - seg_len + 7
  for rank in range(r):
    lists = np.asarray(ddg.group_work_lists(jnp.asarray(seg_src), jnp.asarray(seg_dst),
                                            jnp.asarray(seg_len), rank=rank, src_rows=tokens))
    w = ddg.group_items(tokens, g)
    assert lists.shape == (r, ddg.transfer_row_length(w, g))
    walk_rank = 0
    deal = {}
    for j in range(r):
      peer = (rank + j) % r
      src, dst, rows = lists[j, :w], lists[j, w:2 * w], lists[j, 2 * w:3 * w]
      start = lists[j, 3 * w:3 * w + g + 1]
      deal[j] = lists[j, 3 * w + g + 1:]
      assert (rows <= ddg.ITEM_ROWS).all() and (rows[start[-1]:] == 0).all()
      for grp in range(g):
        items = range(start[grp], start[grp + 1])
        got = np.concatenate([np.arange(src[i], src[i] + rows[i]) for i in items] or [[]])
        np.testing.assert_array_equal(got, np.arange(seg_src[peer, grp],
                                                     seg_src[peer, grp] + seg_len[peer, grp]))
        assert all(dst[i] - src[i] == seg_dst[peer, grp] - seg_src[peer, grp] for i in items)
    # deal_start: ranks of the walk group-major, offsets 1..R-1, 0 inside a group
    for grp in range(g):
      for j in fdg.transfer_order(r):
        start = lists[j, 3 * w:3 * w + g + 1]
        assert deal[j][grp] == walk_rank
        walk_rank += start[grp + 1] - start[grp]


@pytest.mark.parametrize("ranks,top_k,experts,groups,chunk,hot,bound", [
    (4, 3, 16, 2, 32, None, None), (2, 4, 8, 4, 16, 1, None), (4, 2, 16, 1, 48, None, None),
    # a hot expert and a receive bound that drops rows (the hot owner's)
    (4, 3, 16, 4, 16, 5, 96)])
def test_copy_waits_only_for_groups_that_hold_its_rows(ranks, top_k, experts, groups, chunk, hot,
                                                       bound):
  """group_of_chunks: every unique row a receive chunk reads lies below every source's
  end of that chunk's group as the SOURCE sends it (what the copies wait for: arrived[g]
  counts the senders' groups). The owner's own bound (`unique_group_ends`, from the rows
  it reads) is the sender's, or below it where a receive bound dropped rows the sender
  still sends."""
  _, _, plans, dplans = _plans(ranks, 40, top_k, experts, groups, hot=hot, recv_rows=bound)
  if bound is not None:   # the bound drops rows somewhere (else the case tests nothing new)
    assert any(int(p.num_received) == bound for p in plans)
  for me, (p, dp) in enumerate(zip(plans, dplans)):
    live = int(p.num_received)
    nchunks = -(-p.recv_valid.shape[0] // chunk)
    grp = np.asarray(ddg.group_of_chunks(p.recv_group_sizes, p.num_received,
                                         num_groups=groups, recv_chunk_rows=chunk,
                                         num_chunks=nchunks))
    src, pos = np.asarray(p.recv_source), np.asarray(dp.expand_position)
    sent = np.stack([np.asarray(dplans[s].unique_send_group_ends)[me] for s in range(ranks)])
    for k in range(-(-live // chunk)):
      rows = np.arange(k * chunk, min((k + 1) * chunk, live))
      assert (pos[rows] < sent[src[rows], grp[k]]).all(), (me, k)
    owner = np.asarray(dp.unique_group_ends)
    if bound is None:
      np.testing.assert_array_equal(sent, owner)
    else:
      assert (owner <= sent).all()
  if bound is not None:   # and the bound made the two differ somewhere
    assert any((np.asarray(dp.unique_group_ends)
                != np.stack([np.asarray(dplans[s].unique_send_group_ends)[me]
                             for s in range(ranks)])).any()
               for me, dp in enumerate(dplans))


@pytest.mark.parametrize("scaled,h,n_comm,n_copy,chunk,stages,join", [
    (False, 256, 2, 3, 32, 2, 0),      # one column block, the forward's plain copy
    (True, 3072, 3, 2, 48, 2, 0),      # rows of 12 boxes in 2 blocks, the backward's weighted copy
    (True, 3072, 2, 2, 32, 3, 0),      # 3 copy stages (overlap_copy_stages)
    (False, 256, 3, 2, 16, 2, 40),     # the transfer CTAs copy the chunks from 40% on too
    (True, 3072, 2, 1, 32, 3, 40)])    # both, weighted, one copy CTA: several steps each
def test_local_form_delivers_the_dedup_dispatch_rows(scaled, h, n_comm, n_copy, chunk, stages,
                                                     join):
  """The transfer role (group-major, every source simulated as a peer offset landing in
  this device's buffer) then the copy role, chunk by chunk: the owner's packed unique
  buffer and its receive layout, each row the token the plan names, weighted as
  gather_live_rows weights (dtype(w * f32(row)))."""
  ranks, tokens, top_k, experts, groups = 3, 24, 3, 12, 2
  _, _, plans, dplans = _plans(ranks, tokens, top_k, experts, groups, seed=7)
  me = 1
  x = jax.random.normal(jax.random.key(3), (ranks * tokens, h), jnp.float32).astype(jnp.bfloat16)
  p, dp = plans[me], dplans[me]
  # the owner's view: source s sends its rows for `me`, group by group; the local form's
  # peer offset j (row j = peer me + j) stands for source me + j, whose x rows are
  # x[s*T:(s+1)*T] (src indices into the concatenated unique_tokens below)
  uniq, seg_src, seg_dst, seg_len, base = [], [], [], [], 0
  for s in range(ranks):
    sd = dplans[s]
    off, n = int(sd.unique_send_offsets[me]), int(sd.unique_send_counts[me])
    uniq.append(np.asarray(sd.unique_tokens)[off:off + n] + s * tokens)
    ends = np.asarray(sd.unique_send_group_ends)[me]
    start = np.concatenate([[0], ends[:-1]])
    seg_src.append(base + start)
    seg_dst.append(int(dp.unique_recv_offsets[s]) + start)
    seg_len.append(ends - start)
    base += n
  as_i32 = lambda a: jnp.asarray(np.stack(a), jnp.int32)  # noqa: E731
  unique_tokens = jnp.asarray(np.concatenate(uniq), jnp.int32)
  index = packed_unique_index(p, dp)
  out_rows = -(-p.recv_valid.shape[0] // chunk) * chunk
  index = jnp.pad(index, (0, out_rows - index.shape[0]))
  scale = (jnp.pad(dp.recv_weights, (0, out_rows - dp.recv_weights.shape[0]))
           if scaled else None)
  unique, recv = ddg.transfer_copy_local(
      x, unique_tokens, as_i32(seg_src), as_i32(seg_dst), as_i32(seg_len), index,
      p.num_received, p.recv_group_sizes, unique_rows=ranks * tokens, out_rows=out_rows,
      recv_chunk_rows=chunk, rank=me, scale=scale, n_comm=n_comm, n_copy=n_copy,
      copy_stages=stages, join_percent=join, interpret=INTERPRET_RACES)
  assert_no_races()
  live = int(p.num_received)
  total = int(np.sum([len(u) for u in uniq]))
  xs = np.asarray(x.astype(jnp.float32))
  want_unique = xs[np.concatenate(uniq)]
  np.testing.assert_array_equal(np.asarray(unique.astype(jnp.float32))[:total], want_unique)
  rows = want_unique[np.asarray(index)[:live]]
  if scaled:
    w = np.asarray(scale)[:live, None]
    rows = np.asarray(jnp.asarray(w * rows, jnp.float32).astype(jnp.bfloat16)
                      .astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(recv.astype(jnp.float32))[:live], rows)
  # each live receive row holds its own token (the plan's, independently)
  src = np.asarray(p.recv_source)[:live]
  tok = np.array([int(np.asarray(dplans[s].unique_tokens)[int(dplans[s].unique_send_offsets[me])
                                                           + int(q)])
                  for s, q in zip(src, np.asarray(dp.expand_position)[:live])])
  if not scaled:
    np.testing.assert_array_equal(np.asarray(recv.astype(jnp.float32))[:live],
                                  xs[src * tokens + tok])


@pytest.mark.parametrize("kw,match", [
    (dict(n_copy=0), "at least one copy CTA"),
    (dict(n_copy=6), "must leave GEMM CTAs"),
    (dict(num_groups=3), "3 send groups must divide the 4 local experts"),
    (dict(fused=FusedConfig(n_comm=2, recv_chunk_rows=200)), "multiple of block_m"),
])
def test_static_validation_errors(kw, match):
  args = dict(out_rows=1024, hidden=256, ffn=192, num_local_experts=4, num_groups=2,
              dtype=jnp.bfloat16, kernel=KernelConfig(num_sms=8),
              fused=FusedConfig(n_comm=2, recv_chunk_rows=256), n_copy=2, smem=227 * 1024)
  args.update(kw)
  with pytest.raises(ValueError, match=match):
    ddg.validate(**args)


@pytest.mark.parametrize("backward", [False, True])
def test_communicating_kernel_lowers_for_cuda(mesh_factory, backward):
  """The whole launch (three roles, remote refs, both semaphore arrays, the recv reshape
  for the copies) lowers to a Mosaic GPU custom call for CUDA on a CPU-only machine
  (runs: bench/check_moe_gpu.py --backends uniep_dd,uniep_dd_ov on GPUs)."""
  r, t, h, f, el, k, groups = 4, 64, 256, 192, 2, 2, 2
  mesh = mesh_factory(1, r)
  kernel = KernelConfig(num_sms=8, max_concurrent_steps=2)
  fused = FusedConfig(n_comm=2, recv_chunk_rows=128, return_in_kernel=False,
                      dispatch_in_kernel=False, overlap_copy_stages=2 if backward else 3,
                      overlap_join_percent=0 if backward else 50)
  recv_rows = r * t * k

  def body(x, topk, weights, w1, w2):
    plan, dplan = plan_with_dedup(topk, weights, num_experts=r * el, axis_name="expert",
                                  top_k=k, send_groups=groups)
    index = packed_unique_index(plan, dplan)
    if not backward:
      outs = ddg.dedup_dispatch_gate_up(x, dplan, index, plan.num_received,
                                        plan.recv_group_sizes, w1, out_rows=recv_rows,
                                        axis_name="expert", kernel=kernel, fused=fused,
                                        n_copy=3, zero_window=kernel.block_k)
    else:
      st, _, _ = ddg.validate(out_rows=recv_rows, hidden=h, ffn=f, num_local_experts=el,
                              num_groups=groups, dtype=x.dtype, kernel=kernel, fused=fused,
                              n_copy=3, mode="dswiglu")
      hu = jnp.zeros((st.m_p, st.f_p), x.dtype)
      outs = ddg.dedup_dispatch_dswiglu(x, dplan, index, dplan.recv_weights,
                                        plan.num_received, plan.recv_group_sizes, w2, hu, hu,
                                        out_rows=recv_rows, axis_name="expert", kernel=kernel,
                                        fused=fused, n_copy=3, zero_window=kernel.block_k)
    return tuple(o[None] for o in outs)

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P("expert"),) * 5, out_specs=P("expert"),
                     check_vma=False)
  sh = NamedSharding(mesh, P("expert"))
  s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
  args = (s((r * t, h), jnp.bfloat16), s((r * t, k), jnp.int32), s((r * t, k), jnp.float32),
          s((r * el, h, 2 * f), jnp.bfloat16), s((r * el, f, h), jnp.bfloat16))
  lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert "mosaic_gpu" in text
