"""The layer with replica slots (`UniEPConfig.replica_slots`, uniep_jax/balance.py and
replicas.py) under skewed routing: against the float32 oracle, repeatable bit for bit,
balanced rows per rank, and what each backend promises against the run without
replication:

  "pallas", "uniep"  output and dx bit for bit (the same GEMM on the same weights computes
                     each row wherever it lands; the grouped GEMM is row-split invariant,
                     checked below for the planner's cuts); weight gradients within
                     float32 reassociation (a replicated expert's pieces summed at the owner)
  "xla_dropless"     float tolerance: `lax.ragged_dot` on the CPU is not row-split invariant
"""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import simulated
import uniep_jax
from uniep_jax import KernelConfig, UniEPConfig
from uniep_jax.balance import plan_replicas
from conftest import make_mesh
from moe_testlib import make_params, make_x, rel_err

H, F = 64, 128


def _skewed(experts, tokens, seed, hot=0, dtype=jnp.float32):
  """Params whose expert bias puts expert `hot` in every token's top-k (all-to-one),
  and tokens."""
  bias = jnp.zeros(experts).at[hot].set(100.0)
  p = make_params(jax.random.key(seed), experts=experts, hidden=H, ffn=F, dtype=dtype,
                  bias=bias)
  return p, make_x(jax.random.key(seed + 1), tokens, H, dtype)


@functools.lru_cache(maxsize=None)
def _fns(cfg, mesh, top_k):
  def fwd(x, p):
    return uniep_jax.moe_ffn(x, p, mesh=mesh, top_k=top_k, config=cfg)

  def loss(x, p):
    y = fwd(x, p)[0].astype(jnp.float32)
    return jnp.sum(y * jnp.cos(jnp.arange(H, dtype=jnp.float32)))

  return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1)))


@pytest.mark.parametrize("data,ep,slots", [(1, 2, 1), (1, 4, 2), (1, 8, 1), (2, 4, 2)])
def test_xla_dropless_with_replicas_matches_the_oracle(data, ep, slots):
  experts, top_k, tokens = 8, 2, 64 * data * ep
  p, x = _skewed(experts, tokens, seed=ep + data)
  mesh = make_mesh(data, ep)
  cfg = UniEPConfig(backend="xla_dropless", replica_slots=slots)
  f, g = _fns(cfg, mesh, top_k)
  f_ref, g_ref = _fns(UniEPConfig(backend="dense_reference"), None, top_k)
  f0, g0 = _fns(UniEPConfig(backend="xla_dropless"), mesh, top_k)
  (y, aux), grads = f(x, p), g(x, p)
  (y_ref, aux_ref), grads_ref = f_ref(x, p), g_ref(x, p)
  (_, aux0) = f0(x, p)
  assert rel_err(y, y_ref) < 1e-5
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
    assert rel_err(a, b) < 1e-5
  # the routing is skewed (expert 0 in every top-k) and the replicas balance it: every rank computes ceil(rows / R) rows or fewer
  rows0 = np.asarray(aux0["rank_rows"])
  rows = np.asarray(aux["rank_rows"])
  total = tokens * top_k
  assert rows0.max() >= total // ep * 1.3 and rows0.sum() == rows.sum() == total
  assert rows.max() <= -(-total // (ep * data)) * data
  assert int(aux["dropped"]) == 0 and float(aux["replica_weight_bytes"]) > 0
  chex.assert_trees_all_equal(aux["expert_counts"], aux_ref["expert_counts"])
  # repeatable bit for bit under jit
  chex.assert_trees_all_equal((f(x, p), g(x, p)), ((y, aux), grads))


PALLAS = UniEPConfig(backend="pallas", kernel=KernelConfig(num_sms=2), transport="padded")


@pytest.mark.parametrize("ep", [2, 4])
def test_pallas_with_replicas_keeps_the_output_and_dx_bits(ep):
  """Interpret mode: y and dx bit for bit those without replicas; the weight gradients
  within float32 reassociation of the unreplicated ones, and repeatable."""
  experts, top_k, tokens = 4 * ep // 2, 2, 64 * ep
  p, x = _skewed(experts, tokens, seed=40 + ep, dtype=jnp.bfloat16)
  mesh = make_mesh(1, ep)
  rep = dataclasses.replace(PALLAS, replica_slots=1)
  (y0, aux0), (y1, aux1) = _fns(PALLAS, mesh, top_k)[0](x, p), _fns(rep, mesh, top_k)[0](x, p)
  assert np.asarray(aux1["rank_rows"]).max() < np.asarray(aux0["rank_rows"]).max()
  chex.assert_trees_all_equal(y1, y0)
  (dx0, dp0), (dx1, dp1) = _fns(PALLAS, mesh, top_k)[1](x, p), _fns(rep, mesh, top_k)[1](x, p)
  chex.assert_trees_all_equal(dx1, dx0)
  chex.assert_trees_all_equal(dp1.router, dp0.router)
  for a, b in ((dp1.w_gate_up, dp0.w_gate_up), (dp1.w_down, dp0.w_down)):
    a32, b32 = np.asarray(a, np.float32), np.asarray(b, np.float32)
    # bf16 gradients of float32 partial sums: equal up to one rounding of the sum
    np.testing.assert_allclose(a32, b32, rtol=2 ** -7, atol=1e-6 * np.abs(b32).max())
  chex.assert_trees_all_equal(_fns(rep, mesh, top_k)[1](x, p), (dx1, dp1))


@pytest.mark.parametrize("data,ep,slots,hot,top_k", [
    (1, 4, 1, (1,), 2), (2, 2, 1, (1,), 2),
    (1, 2, 2, (0, 1, 2, 3), 4)])   # rank 0's four experts in every top-k: rank 1 takes two
def test_uniep_with_replicas_equals_pallas_bitwise(monkeypatch, data, ep, slots, hot, top_k):
  """"uniep" moves the replica weights and their gradients with the NVLink transfer
  (replaced here by its contract, tests/simulated.py): outputs and every gradient equal
  "pallas" over the padded transport (XLA's all_to_all of the weights) bit for bit."""
  simulated.patch_nvlink(monkeypatch)
  simulated.patch_grouped_gemm(monkeypatch)   # the grouped GEMM launches simulated too
  bias = jnp.zeros(8).at[jnp.asarray(hot)].set(100.0)   # in every top-k
  run = simulated.layer_runner(91, data=data, ep=ep, top_k=top_k, bias=bias, tokens=128,
                               hidden=256, ffn=256)
  (y_p, d_p), g_p = run(UniEPConfig(backend="pallas", replica_slots=slots), transport="padded")
  (y_u, d_u), g_u = run(UniEPConfig(backend="uniep", replica_slots=slots))
  assert int(d_p) == 0 and float(jnp.max(jnp.abs(y_p.astype(jnp.float32)))) > 0
  chex.assert_trees_all_equal((y_u, d_u, g_u), (y_p, d_p, g_p))


def test_grouped_gemm_is_row_split_invariant_at_the_planners_cuts():
  """The Pallas grouped SwiGLU FFN (interpret mode): the rows of one expert computed as
  one group, and the same rows cut where the planner cuts them (pieces of any length, not
  tile multiples) as groups with the same weights, give the same output and dx rows bit
  for bit."""
  from pallas_kernels import grouped_gemm as gg
  r, el = 4, 2
  c = np.zeros((r, r * el), np.int32)
  c[:, 0] = [61, 47, 70, 33]                 # expert 0 hot
  c[:, 1:] = 5
  plan = plan_replicas(jnp.asarray(c), 1)
  pieces = [int(v) for v in np.asarray(plan.rows_on)[0] if v]
  assert len(pieces) > 2 and any(v % 64 for v in pieces)
  n = sum(pieces)
  kx, kw, kd = jax.random.split(jax.random.key(5), 3)
  x = jax.random.normal(kx, (n, H), jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (n, H), jnp.float32).astype(jnp.bfloat16)
  p = make_params(kw, experts=1, hidden=H, ffn=F, dtype=jnp.bfloat16)
  cfg = KernelConfig(num_sms=2)

  def run(groups):
    g = len(groups)
    wgu = jnp.broadcast_to(p.w_gate_up, (g,) + p.w_gate_up.shape[1:])
    wd = jnp.broadcast_to(p.w_down, (g,) + p.w_down.shape[1:])
    sizes = jnp.asarray(groups, jnp.int32)
    y, vjp = jax.vjp(lambda x: gg.grouped_swiglu_ffn(x, wgu, wd, sizes, config=cfg), x)
    return y, vjp(dy)[0]

  whole = jax.jit(lambda: run([n]))()
  split = jax.jit(lambda: run(pieces))()
  chex.assert_trees_all_equal(split, whole)


@pytest.mark.parametrize("kw,field", [
    (dict(replica_slots=-1), "replica_slots"), (dict(replica_slots=True), "replica_slots"),
    (dict(replica_slots=1.5), "replica_slots"),
    (dict(replica_slots=1, backend="xla_capacity"), "replica_slots"),
    (dict(replica_slots=1, backend="dense_reference"), "replica_slots"),
    (dict(replica_slots=1, backend="uniep", overlap=uniep_jax.OverlapConfig()), "replica_slots")])
def test_bad_replica_slots_are_refused(kw, field):
  with pytest.raises(ValueError, match=field):
    UniEPConfig(**kw)


def test_more_slots_than_experts_per_rank_are_refused():
  p, x = _skewed(8, 64, seed=3)
  with pytest.raises(ValueError, match="replica_slots=3 exceeds the 2 experts per rank"):
    uniep_jax.moe_ffn(x, p, mesh=make_mesh(1, 4), top_k=2,
                      config=UniEPConfig(backend="xla_dropless", replica_slots=3))


def test_replicas_let_a_receive_bound_of_t_k_rows_hold_every_row():
  """receive_capacity_factor=1.0 bounds each rank's receive buffer to T*K rows: under
  all-to-one routing the hot rank overflows it and drops rows without replicas; with
  them every rank receives exactly T*K rows and nothing is dropped, and the output is
  the oracle's."""
  experts, top_k, ep = 8, 2, 4
  tokens = 64 * ep
  p, x = _skewed(experts, tokens, seed=17)
  mesh = make_mesh(1, ep)
  f_ref, _ = _fns(UniEPConfig(backend="dense_reference"), None, top_k)
  y_ref, _ = f_ref(x, p)
  bounded = UniEPConfig(backend="xla_dropless", receive_capacity_factor=1.0)
  _, aux0 = _fns(bounded, mesh, top_k)[0](x, p)
  assert int(aux0["dropped"]) > 0
  y, aux = _fns(dataclasses.replace(bounded, replica_slots=2), mesh, top_k)[0](x, p)
  assert int(aux["dropped"]) == 0
  assert np.asarray(aux["rank_rows"]).tolist() == [tokens // ep * top_k] * ep
  assert rel_err(y, y_ref) < 1e-5
