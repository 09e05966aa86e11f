"""Token de-duplication, the "uniep" backend's dispatch (layout.DedupPlan,
transport.send_unique, combine.combine_unique): each (token, owner) pair crosses the
network once, in the forward's x dispatch and in the backward's dy dispatch (the owner
weights each slot's row itself), and everything is bit for bit what the plain dispatch
gives: outputs, dropped counts and every gradient, with and without a receive bound."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import simulated
import uniep_jax
from uniep_jax import UniEPConfig
from uniep_jax.layout import (local_group_sizes, make_dedup_plan, make_plan, sorted_weight_bits,
                              token_destinations, unique_send_rows)
from moe_testlib import host_stepped_loops

E = 8


def _routing(seed, tokens, top_k, experts=E, hot=None):
  logits = jax.random.normal(jax.random.key(seed), (tokens, experts))
  if hot is not None:
    logits = logits.at[:, hot].add(100.0)
  return jax.lax.top_k(logits, top_k)[1].astype(jnp.int32)


_make_plan = jax.jit(make_plan)
_token_destinations = jax.jit(token_destinations, static_argnums=(1, 2))
_make_dedup_plan = jax.jit(make_dedup_plan)


@pytest.mark.parametrize("ranks,top_k,hot",
                         [(4, 2, None), (4, 3, 5), (2, 4, None), (8, 2, 0), (2, 3, 1)])
def test_plan_sends_each_token_once_per_owner(ranks, top_k, hot):
  """The unique send rows are the (token, owner) pairs in (owner, token) order; each
  receive row's expand position names the unique row of its own token, and its weight is
  its own slot's routing weight at the source."""
  tokens, el = 24, E // ranks
  topks = [_routing(10 * s + top_k, tokens, top_k, hot=hot) for s in range(ranks)]
  weights = [jax.random.uniform(jax.random.key(100 + s), (tokens, top_k)) for s in range(ranks)]
  counts = jnp.stack([local_group_sizes(t, E) for t in topks])
  # the plan builders jitted, the rank traced (as inside the layer's shard_map): one
  # program per shape instead of an op-by-op dispatch compiling each primitive; the
  # plans are integers (and weight bits), exact either way; checked below in numpy
  plans = [_make_plan(t, counts, jnp.int32(s)) for s, t in enumerate(topks)]
  local = [_token_destinations(t, ranks, el) for t in topks]
  gathered = jnp.stack([
      jnp.concatenate([present.sum(axis=0, dtype=jnp.int32),
                       position[p.sort_order // top_k, p.sorted_experts // el],
                       sorted_weight_bits(w, p.sort_order)])
      for (present, position), w, p in zip(local, weights, plans)])
  dplans = [_make_dedup_plan(present, gathered, p, jnp.int32(s))
            for s, ((present, _), p) in enumerate(zip(local, plans))]
  plans, dplans = jax.tree.map(np.asarray, (plans, dplans))
  owners = [np.asarray(t) // el for t in topks]

  for s, dp in enumerate(dplans):
    assert dp.unique_tokens.shape == (unique_send_rows(tokens, top_k, ranks),)
    for d in range(ranks):
      want = [t for t in range(tokens) if d in owners[s][t]]
      off, n = int(dp.unique_send_offsets[d]), int(dp.unique_send_counts[d])
      assert np.asarray(dp.unique_tokens[off:off + n]).tolist() == want
      assert int(dp.unique_counts[s, d]) == n
  # fewer rows than the plain dispatch whenever a token has two experts on one rank
  sent_unique = sum(int(dp.unique_send_counts.sum()) for dp in dplans)
  sent_plain = sum(int(p.send_counts.sum()) for p in plans)
  distinct = sum(len(set(o[t].tolist())) for o in owners for t in range(tokens))
  assert sent_unique == distinct <= sent_plain
  # receive row p = (le, s, t, k): its unique row (s, position) holds token t
  for me, (p, dp) in enumerate(zip(plans, dplans)):
    n_live = int(p.num_received)
    src = np.asarray(p.recv_source)[:n_live]
    pos = np.asarray(dp.expand_position)[:n_live]
    for s in range(ranks):
      sel = src == s
      sender = dplans[s]
      off = int(sender.unique_send_offsets[me])
      got_tokens = np.asarray(sender.unique_tokens)[off + pos[sel]]
      # the plain dispatch's rows from s: s's sorted rows for me, in order
      sorted_rows = np.asarray(plans[s].sort_order)[
          int(plans[s].send_offsets[me]):int(plans[s].send_offsets[me] + plans[s].send_counts[me])]
      idx = np.asarray(p.recv_index_in_source)[:n_live][sel]
      np.testing.assert_array_equal(got_tokens, sorted_rows[idx] // top_k)
      np.testing.assert_array_equal(np.asarray(dp.recv_weights)[:n_live][sel],
                                    np.asarray(weights[s]).reshape(-1)[sorted_rows[idx]])
    assert not np.asarray(dp.recv_weights)[n_live:].any()   # dead rows: weight 0


@pytest.mark.parametrize("data,ep,top_k,bound,hot", [
    (1, 4, 3, None, None),     # an odd top-k
    (2, 2, 2, 1.0, 3),         # a hot expert overflows the receive bound: drops
    (1, 8, 2, None, None)])
def test_uniep_equals_pallas_padded_bitwise(monkeypatch, data, ep, top_k, bound, hot):
  """backend "uniep" (the de-duplicated dispatch over "nvlink": one segment per owner into
  a packed unique buffer, the owner's live-rows copy, the zeroed window, the dy dispatch
  weighted on the owner) with the NVLink transfer and the copy replaced by their
  contracts (tests/simulated.py; the kernels themselves: tests/test_ep_transfer.py and
  test_gather_live_rows_kernel) equals "pallas" over the padded transport bit for bit:
  outputs, dropped counts and the gradients of x and every parameter."""
  simulated.patch_nvlink(monkeypatch)
  bias = None if hot is None else jnp.zeros(E).at[hot].set(100.0)
  run = simulated.layer_runner(73, data=data, ep=ep, top_k=top_k, bias=bias, tokens=128)
  (y_p, d_p), g_p = run(UniEPConfig(backend="pallas", receive_capacity_factor=bound),
                        transport="padded")
  (y_u, d_u), g_u = run(UniEPConfig(backend="uniep", receive_capacity_factor=bound))
  assert (int(d_p) > 0) == (bound is not None)
  assert float(jnp.max(jnp.abs(y_p.astype(jnp.float32)))) > 0
  chex.assert_trees_all_equal((y_u, d_u, g_u), (y_p, d_p, g_p))


@pytest.mark.parametrize("live,rows_per_tile,hidden,budget,blocking,scaled", [
    (0, 8, 512, 8192, (256, 1), False), (37, 8, 512, 8192, (256, 1), False),  # 2 col. blocks
    (70, 4, 96, 1 << 20, (96, 1), False), (37, 8, 512, 8192, (256, 1), True),
    (70, 4, 96, 1 << 20, (96, 1), True)])   # the last tile's box of weights reaches past N rows
def test_gather_live_rows_kernel(live, rows_per_tile, hidden, budget, blocking, scaled):
  """The Mosaic GPU kernel in the interpret mode, with the race detector: rows below
  `live` are src[index], bit for bit (scaled: XLA's (scale * f32(row)).astype(bf16),
  bit for bit); rows past it are never written (the interpreter fills unwritten
  output with NaN); a row is split into column blocks when two stages of whole rows
  exceed the shared-memory budget."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  import pallas_kernels.row_gather as rg
  rng = np.random.default_rng(live)
  src = jnp.asarray(rng.standard_normal((40, hidden)), jnp.bfloat16)
  index = jnp.asarray(rng.integers(0, 40, 70), jnp.int32)
  scale = jnp.asarray(rng.standard_normal(70), jnp.float32) if scaled else None
  assert rg.column_blocking(hidden, 2, rows_per_tile, budget) == blocking
  out = rg.gather_live_rows(src, index, jnp.int32(live), out_rows=80, scale=scale,
                            rows_per_tile=rows_per_tile, num_ctas=3, stage_budget_bytes=budget,
                            interpret=plgpu.InterpretGPUParams(detect_races=True))
  out = np.asarray(out.astype(jnp.float32))
  want = src[index] if scale is None else jax.jit(
      lambda a, w: (a.astype(jnp.float32) * w[:, None]).astype(a.dtype))(src[index], scale)
  want = np.asarray(want.astype(jnp.float32))
  if scaled:   # a real multiply: rows differ from the plain copy
    assert not np.array_equal(want[:live], np.asarray(src[index].astype(jnp.float32))[:live])
  np.testing.assert_array_equal(out[:live], want[:live])
  assert np.isnan(out[live:]).all()


def test_uniep_layer_lowers_for_cuda():
  """backend "uniep" at its defaults lowers for CUDA on this CPU-only machine: forward,
  the transfer of the unique rows (read by index in its loads), the owner's live-rows
  copy, gate/up, down, the return; backward, the dy transfer, its weighted copy, da
  (dswiglu), dx, the two wgrads, the return of dx: 12 Mosaic GPU kernels (the golden
  inventory, tests/test_layer_kernels.py, pins each one); no host-stepped loop."""
  from test_moe import lower_uniep_layer_for_cuda
  text = lower_uniep_layer_for_cuda(UniEPConfig(backend="uniep"), 128)
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 12
  assert text.count("gather_live_rows_scaled") >= 1
  assert not host_stepped_loops(text)   # (ragged.SEARCH_METHOD)


def test_unique_receive_bytes_counts_every_token_of_every_rank_once():
  """De-duplication's extra buffer: R*T rows of H (qwen3-like at EP 4: 16384 tokens per
  rank, H 2048, bf16: 256 MiB), reported beside the receive layout's worst case."""
  assert uniep_jax.unique_receive_bytes(16384, 2048, 4) == 4 * 16384 * 2048 * 2 == 256 << 20
  assert uniep_jax.unique_receive_bytes(10, 8, 2, itemsize=4) == 2 * 10 * 8 * 4
  # an eighth of the receive layout's dropless worst case at K = 8
  assert (uniep_jax.receive_buffer_bytes(16384, 8, 2048, 4)
          == 8 * uniep_jax.unique_receive_bytes(16384, 2048, 4))
