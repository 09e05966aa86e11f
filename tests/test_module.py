"""UniEPMoE: partitioning metadata, output and gradients vs the dense reference,
aux statistics, and the auxiliary-loss-free bias update."""

import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import uniep_jax
from uniep_jax import UniEPConfig, UniEPMoE
from uniep_jax.module import ExpertBias

H, F, E, K = 32, 48, 8, 2
B, S = 4, 16  # 64 tokens: divisible by the 8 token shards


def _make(mesh, *, n_shared=0, use_expert_bias=False, backend="xla_dropless", seed=0, routing=None):
  config = UniEPConfig(backend=backend, **({} if routing is None else dict(routing=routing)))
  return UniEPMoE(H, F, E, K, n_shared=n_shared, mesh=mesh, config=config,
                  use_expert_bias=use_expert_bias, rngs=nnx.Rngs(seed))


def _x(seed=1):
  return jax.random.normal(jax.random.key(seed), (B, S, H), jnp.float32)


def test_partitioning_metadata(mesh_factory):
  moe = _make(mesh_factory(2, 4), n_shared=1, use_expert_bias=True)
  specs = nnx.get_partition_spec(nnx.state(moe))
  assert tuple(specs["w_gate_up"].get_value()) == ("expert", None, None)
  assert tuple(specs["w_down"].get_value()) == ("expert", None, None)
  assert tuple(specs["router"].get_value()) == (None, None)
  # eager placement on the mesh: each expert-axis rank holds E/4 experts
  shard_shapes = {s.data.shape for s in moe.w_gate_up.get_value().addressable_shards}
  assert shard_shapes == {(E // 4, H, 2 * F)}
  # the bias is state, not a trainable parameter
  params = nnx.state(moe, nnx.Param)
  assert "expert_bias" not in params
  assert isinstance(moe.expert_bias, ExpertBias)
  assert moe.router.get_value().dtype == jnp.float32


@pytest.mark.parametrize("n_shared,use_bias", [(0, False), (1, True)])
def test_matches_dense_reference(mesh_factory, n_shared, use_bias):
  moe = _make(mesh_factory(2, 4), n_shared=n_shared, use_expert_bias=use_bias)
  if use_bias:  # a non-trivial selection bias
    bias = 0.05 * jnp.arange(E, dtype=jnp.float32) - 0.2
    moe.expert_bias[...] = jax.device_put(bias, moe.expert_bias.get_value().sharding)
  x = _x()
  y = nnx.jit(lambda m, x: m(x))(moe, x)
  chex.assert_shape(y, (B, S, H))

  host = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), moe.moe_params())  # single-device copies
  y_ref, aux_ref = uniep_jax.moe_ffn(x.reshape(B * S, H), host, mesh=None, top_k=K,
                                     config=UniEPConfig(backend="dense_reference"))
  y_ref = y_ref.reshape(B, S, H)
  if n_shared:
    y_ref = y_ref + moe.shared(x)
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=2e-5, atol=2e-5)

  aux = moe.aux.get_value()
  np.testing.assert_array_equal(np.asarray(aux["expert_counts"]), np.asarray(aux_ref["expert_counts"]))
  assert int(np.asarray(aux["expert_counts"]).sum()) == B * S * K
  assert int(aux["dropped"]) == 0


def test_gradients_match_dense_reference(mesh_factory):
  mesh = mesh_factory(2, 4)
  ep = _make(mesh, n_shared=1)
  ref = _make(None, n_shared=1, backend="dense_reference")  # same seed: same weights
  for a, b in zip(jax.tree.leaves(nnx.state(ep, nnx.Param)), jax.tree.leaves(nnx.state(ref, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  x = _x()
  w_out = jax.random.normal(jax.random.key(7), (B, S, H), jnp.float32)

  def loss(m, x):
    return jnp.sum(m(x) * w_out)

  g_ep, gx_ep = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(ep, x)
  g_ref, gx_ref = nnx.jit(nnx.grad(loss, argnums=(0, 1)))(ref, x)
  np.testing.assert_allclose(np.asarray(gx_ep), np.asarray(gx_ref), rtol=1e-4, atol=1e-4)
  flat_ep, flat_ref = nnx.to_flat_state(g_ep), nnx.to_flat_state(g_ref)
  for (path, a), (_, b) in zip(flat_ep, flat_ref):
    np.testing.assert_allclose(np.asarray(a.get_value()), np.asarray(b.get_value()),
                               rtol=1e-4, atol=1e-4, err_msg=str(path))


def test_update_expert_bias_sign():
  moe = _make(None, use_expert_bias=True)
  counts = jnp.array([10, 0, 5, 5, 9, 1, 5, 5], jnp.int32)  # mean 5
  moe.update_expert_bias(counts, rate=0.25)
  expected = 0.25 * np.array([-1, 1, 0, 0, -1, 1, 0, 0], np.float32)  # overloaded -> down
  np.testing.assert_array_equal(np.asarray(moe.expert_bias.get_value()), expected)
  moe.update_expert_bias(counts, rate=0.25)
  np.testing.assert_array_equal(np.asarray(moe.expert_bias.get_value()), 2 * expected)


def test_bias_update_rebalances_routing(mesh_factory):
  """Repeated updates from the layer's own counts shrink the load imbalance."""
  moe = _make(mesh_factory(2, 4), use_expert_bias=True)
  x = _x(3) + 2.0  # skewed inputs: skewed routing
  fwd = nnx.jit(lambda m, x: m(x))

  def imbalance():
    fwd(moe, x)
    c = np.asarray(moe.aux.get_value()["expert_counts"], np.float64)
    return c.max() / c.mean(), moe.aux.get_value()["expert_counts"]

  before, counts = imbalance()
  for _ in range(30):
    moe.update_expert_bias(counts, rate=0.02)
    after, counts = imbalance()
  assert after < before, (before, after)


def test_update_without_bias_raises():
  with pytest.raises(ValueError, match="use_expert_bias"):
    _make(None).update_expert_bias(jnp.ones((E,), jnp.int32), 0.1)


def test_bad_expert_split_raises(mesh_factory):
  with pytest.raises(ValueError, match="divisible"):
    UniEPMoE(H, F, 6, K, mesh=mesh_factory(2, 4), rngs=nnx.Rngs(0))


def test_xla_determinism_switch_and_warning(monkeypatch):
  """`enable_xla_determinism` adds the flag to XLA_FLAGS (before the backends start; after,
  it raises: the flag would have no effect), leaves an explicit setting alone, and the
  layer warns on GPUs without it, not on the CPU."""
  import warnings
  from jax._src import xla_bridge
  from uniep_jax import determinism
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
  assert not determinism.xla_deterministic()
  uniep_jax.enable_xla_determinism()
  assert determinism.xla_deterministic()
  assert os.environ["XLA_FLAGS"].endswith("--xla_gpu_deterministic_ops=true")
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=false")
  uniep_jax.enable_xla_determinism()   # the user's explicit choice stays
  assert os.environ["XLA_FLAGS"] == "--xla_gpu_deterministic_ops=false"
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
  with pytest.raises(RuntimeError, match="before the first computation"):
    uniep_jax.enable_xla_determinism()
  with pytest.warns(determinism.NondeterministicXLAWarning, match="enable_xla_determinism"):
    determinism.warn_if_nondeterministic("gpu")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    determinism.warn_if_nondeterministic("cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    determinism.warn_if_nondeterministic("gpu")
