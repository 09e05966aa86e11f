"""Row gathers whose backward pass is a gather (uniep_jax.rows.gather_rows).

XLA transposes a gather into a scatter-add (atomics on the GPU, and slow). The
row movements of every backend are injective, so their transpose is the
gather by the inverse map; these tests pin that down: same bits as XLA's
transpose, no float scatter-add left in any backend's backward pass, and the
capacity path's gradients right when tokens are dropped.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import uniep_jax
from uniep_jax import UniEPConfig
from uniep_jax.rows import gather_rows, permute_rows, take_rows
from conftest import make_mesh
from moe_testlib import capacity_keep_mask, float_scatter_adds, make_params, make_x, rel_err


def _injective_case(seed, n_src=40, n_out=32, h=8):
  """A partial one-to-one map from output rows to source rows, and its transpose."""
  rng = np.random.default_rng(seed)
  index = rng.permutation(n_src)[:n_out].astype(np.int32)
  valid = rng.random(n_out) < 0.7
  index_t = np.full(n_src, 0, np.int32)
  valid_t = np.zeros(n_src, bool)
  for i in np.flatnonzero(valid):
    index_t[index[i]] = i
    valid_t[index[i]] = True
  rows = jax.random.normal(jax.random.key(seed), (n_src, h), jnp.float32)
  return rows, *map(jnp.asarray, (index, valid, index_t, valid_t))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gather_rows_matches_xla_transpose_bitwise(seed):
  rows, index, valid, index_t, valid_t = _injective_case(seed)
  ct = jax.random.normal(jax.random.key(100 + seed), (index.shape[0], rows.shape[1]))
  ours = jax.jit(lambda r: jnp.vdot(gather_rows(r, index, valid, index_t, valid_t), ct))
  xlas = jax.jit(lambda r: jnp.vdot(take_rows(r, index, valid), ct))
  chex.assert_trees_all_equal(ours(rows), xlas(rows))
  chex.assert_trees_all_equal(jax.grad(ours)(rows), jax.grad(xlas)(rows))
  # source rows nobody reads get exactly zero
  g = np.asarray(jax.grad(ours)(rows))
  assert np.all(g[~np.asarray(valid_t)] == 0)


def test_permute_rows_backward_is_inverse_permutation():
  perm = jnp.asarray(np.random.default_rng(3).permutation(24).astype(np.int32))
  inv = jnp.argsort(perm).astype(jnp.int32)
  rows = jax.random.normal(jax.random.key(4), (24, 5))
  ct = jax.random.normal(jax.random.key(5), (24, 5))
  _, vjp = jax.vjp(lambda r: permute_rows(r, perm, inv), rows)
  chex.assert_trees_all_equal(vjp(ct)[0], ct[inv])


@pytest.mark.parametrize("backend", ["xla_capacity", "xla_dropless", "pallas"])
def test_no_float_scatter_add_in_backward(backend):
  e, h, f, top_k, tokens = 8, 16, 32, 2, 32
  mesh = make_mesh(1, 4)
  p = make_params(jax.random.key(0), experts=e, hidden=h, ffn=f)
  x = make_x(jax.random.key(1), tokens, h)
  cfg = UniEPConfig(backend=backend)

  def loss(x, p):
    y, aux = uniep_jax.moe_ffn(x, p, mesh=mesh, top_k=top_k, config=cfg)
    return jnp.sum(y * y)

  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, p)
  assert float_scatter_adds(jaxpr, h) == []


def test_capacity_gradients_with_drops_match_reference():
  """Dropped assignments get no gradient; kept ones the reference's."""
  e, h, f, top_k, tokens, ep = 8, 16, 24, 2, 64, 4
  kx, kp = jax.random.split(jax.random.key(7))
  p = make_params(kp, experts=e, hidden=h, ffn=f, bias=jnp.zeros(e).at[0].set(100.0))
  x = make_x(kx, tokens, h)
  cfg = UniEPConfig(backend="xla_capacity", capacity_factor=1.0)
  mesh = make_mesh(1, ep)
  out = uniep_jax.route(x, p.router, top_k, cfg.routing, p.expert_bias)
  topk = np.asarray(out.topk_experts)
  cap = int(np.ceil((tokens // ep) * top_k / e))
  keep = capacity_keep_mask(topk, ep, cap, e)
  assert (~keep).sum() > 0

  def ours(x, p):
    y, _ = uniep_jax.moe_ffn(x, p, mesh=mesh, top_k=top_k, config=cfg)
    return jnp.sum(jnp.sin(y))

  def reference(x, p):
    w = jax.nn.softmax(x @ p.router, axis=-1)
    w_sel = jnp.take_along_axis(w, jnp.asarray(topk), axis=1)
    w_sel = w_sel / jnp.sum(w_sel, axis=1, keepdims=True)
    w_sel = jnp.where(jnp.asarray(keep), w_sel, 0.0)
    hid, up = (jnp.einsum("nh,ehf->enf", x, w) for w in uniep_jax.split_gate_up(p.w_gate_up))
    y_all = jnp.einsum("enf,efh->enh", jax.nn.silu(hid) * up, p.w_down)
    y_sel = y_all[jnp.asarray(topk), jnp.arange(tokens)[:, None]]
    return jnp.sum(jnp.sin(jnp.einsum("tk,tkh->th", w_sel, y_sel)))

  # the reference jitted too: one program, not an op-by-op dispatch compiling each primitive
  assert rel_err(jax.jit(ours)(x, p), jax.jit(reference)(x, p)) < 1e-5
  g = jax.jit(jax.grad(ours, argnums=(0, 1)))(x, p)
  g_ref = jax.jit(jax.grad(reference, argnums=(0, 1)))(x, p)
  for name, a, b in [("x", g[0], g_ref[0]), ("w_gate_up", g[1].w_gate_up, g_ref[1].w_gate_up),
                     ("w_down", g[1].w_down, g_ref[1].w_down),
                     ("router", g[1].router, g_ref[1].router)]:
    assert rel_err(a, b) < 2e-5, (name, rel_err(a, b))
