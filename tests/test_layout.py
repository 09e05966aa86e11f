"""The dispatch plan: its order is a pure function of routing, checked in numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from uniep_jax import make_plan, sort_assignments
from uniep_jax.layout import local_group_sizes


def _random_routing(rng, t, k, e, skew=False):
  if skew:  # a hot expert plus an expert that gets nothing
    p = np.full(e, 1.0); p[1] = 5 * e; p[-1] = 0.0; p /= p.sum()
  else:
    p = np.full(e, 1.0 / e)
  # top-k experts of a token are distinct
  return np.stack([rng.choice(e, size=k, replace=False, p=p) for _ in range(t)]).astype(np.int32)


@pytest.mark.parametrize("skew", [False, True])
def test_sort_order_equals_numpy_stable_argsort(skew):
  t, k, e = 37, 3, 8
  topk = _random_routing(np.random.default_rng(1), t, k, e, skew)
  order, pos, sorted_e, sizes = jax.jit(sort_assignments, static_argnums=1)(jnp.asarray(topk), e)
  flat = topk.reshape(-1)
  np.testing.assert_array_equal(np.asarray(order), np.argsort(flat, kind="stable"))
  # the documented key (expert, token, slot), spelled out
  tok, slot = np.divmod(np.arange(t * k), k)
  np.testing.assert_array_equal(np.asarray(order), np.lexsort((slot, tok, flat)))
  np.testing.assert_array_equal(np.asarray(pos)[np.asarray(order)], np.arange(t * k))
  np.testing.assert_array_equal(np.asarray(sizes), np.bincount(flat, minlength=e))
  np.testing.assert_array_equal(np.asarray(sorted_e), np.sort(flat))


@pytest.mark.parametrize("ranks,skew", [(1, False), (2, True), (4, False), (4, True), (8, True)])
def test_receive_layout_is_the_documented_key(ranks, skew):
  """Simulate the transport in numpy from the plans of all ranks; every row must
  land where the key (local expert, source rank, token, slot) puts it."""
  t, k, e = 11, 2, 8
  rng = np.random.default_rng(ranks)
  el = e // ranks
  topks = [_random_routing(rng, t, k, e, skew) for _ in range(ranks)]
  cm = jnp.stack([local_group_sizes(jnp.asarray(tk), e) for tk in topks])  # [R, E]
  plans = [make_plan(jnp.asarray(topks[r]), cm, r) for r in range(ranks)]
  for me in range(ranks):
    plan = jax.tree.map(np.asarray, plans[me])
    # expected receive rows: (le, s, t, k) for every assignment to my experts
    want = sorted((tk[tt, kk] - me * el, s, tt, kk)
                  for s, tk in enumerate(topks) for tt in range(t) for kk in range(k)
                  if tk[tt, kk] // el == me)
    n_live = len(want)
    assert plan.recv_valid.sum() == n_live and plan.recv_valid[:n_live].all()
    np.testing.assert_array_equal(plan.recv_group_sizes,
                                  np.bincount([w[0] for w in want], minlength=el))
    for p, (le, s, tt, kk) in enumerate(want):
      assert plan.recv_source[p] == s
      # row index inside s's block -> s's sorted position -> assignment
      sp = jax.tree.map(np.asarray, plans[s])
      sorted_pos = sp.send_offsets[me] + plan.recv_index_in_source[p]
      assert sp.sort_order[sorted_pos] == tt * k + kk
    # offsets used by ragged_all_to_all agree with the senders' view
    for s in range(ranks):
      sp = jax.tree.map(np.asarray, plans[s])
      assert sp.send_counts[me] == plan.recv_counts[s]
      assert plan.return_offsets[s] == sp.send_offsets[me]
      assert sp.output_offsets[me] == plan.recv_offsets[s]


def test_plan_is_deterministic_under_jit():
  topk = jnp.asarray(_random_routing(np.random.default_rng(3), 64, 4, 16, True))
  cm = jnp.stack([local_group_sizes(topk, 16)] * 4)
  f = jax.jit(make_plan)
  a, b, c = f(topk, cm, 2), f(topk, cm, 2), f(topk, cm, 2)
  for x, y in ((a, b), (a, c)):
    jax.tree.map(np.testing.assert_array_equal, x, y)


@pytest.mark.parametrize("ranks,bound", [(1, None), (2, None), (4, None), (2, 30), (4, 20)])
def test_segments_reproduce_the_transport(ranks, bound):
  """Copying the dispatch segments of every rank, then the return segments, in
  numpy, gives the receive layout of `send_rows` and the identity on return
  (with a receive bound: rows past it are neither sent nor returned)."""
  from uniep_jax.layout import dispatch_segments, return_segments
  t, k, e = 13, 3, 8
  rng = np.random.default_rng(10 + ranks)
  topks = [_random_routing(rng, t, k, e, skew=True) for _ in range(ranks)]
  cm = jnp.stack([local_group_sizes(jnp.asarray(tk), e) for tk in topks])
  mk = lambda r: make_plan(jnp.asarray(topks[r]), cm, r, recv_rows=bound)  # noqa: E731
  plans = [jax.tree.map(np.asarray, mk(r)) for r in range(ranks)]
  n = t * k
  cap = bound or ranks * n
  # source rows: a unique id per (rank, sorted position)
  src = [np.arange(n) + 1000 * r for r in range(ranks)]
  recv = [np.full(cap, -1) for _ in range(ranks)]
  for r in range(ranks):
    seg = jax.tree.map(np.asarray, dispatch_segments(mk(r), r))
    peer = np.repeat(np.arange(ranks), e // ranks)
    for s0, d0, m, p in zip(seg.src_start.ravel(), seg.dst_start.ravel(), seg.rows.ravel(), peer):
      assert (recv[p][d0:d0 + m] == -1).all()      # no overlap between writers
      recv[p][d0:d0 + m] = src[r][s0:s0 + m]
  for me in range(ranks):
    pl = plans[me]
    live = int(pl.recv_valid.sum())
    want = 1000 * pl.recv_source[:live] + plans_send_pos(plans, pl, me)[:live]
    np.testing.assert_array_equal(recv[me][:live], want)
    assert (recv[me][live:] == -1).all()
    # what overflowed the bound is counted
    total = sum(int((tk // (e // ranks) == me).sum()) for tk in topks)
    assert int(pl.dropped) == total - live and (bound is not None or total == live)
  back = [np.full(n, -1) for _ in range(ranks)]
  for r in range(ranks):
    seg = jax.tree.map(np.asarray, return_segments(mk(r), r))
    peer = np.repeat(np.arange(ranks), e // ranks)
    for s0, d0, m, p in zip(seg.src_start.ravel(), seg.dst_start.ravel(), seg.rows.ravel(), peer):
      assert (back[p][d0:d0 + m] == -1).all()
      back[p][d0:d0 + m] = recv[r][s0:s0 + m]
  dropped_total = sum(int(p.dropped) for p in plans)
  assert (bound is None) == (dropped_total == 0)
  for r in range(ranks):
    returned = back[r] != -1
    np.testing.assert_array_equal(back[r][returned], src[r][returned])
  assert sum(int((b == -1).sum()) for b in back) == dropped_total


def plans_send_pos(plans, pl, me):
  """Sorted position at the source of every receive row of rank `me`."""
  return np.array([plans[s].send_offsets[me] + i
                   for s, i in zip(pl.recv_source, pl.recv_index_in_source)])
