"""Routing: scores, top-k tie rule, renormalisation, bias, group-limited routing."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from uniep_jax import RoutingConfig, route

from moe_testlib import all_eqns


def _np_topk_lowest_index(values, k):
  # stable argsort of -values: equal values keep index order (lowest first)
  return np.argsort(-values, axis=1, kind="stable")[:, :k]


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_topk_matches_numpy_with_ties(score_fn):
  t, h, e, k = 64, 16, 12, 3
  rng = np.random.default_rng(0)
  # Quantised logits produce many exact ties in the scores.
  x = jnp.asarray(rng.integers(-2, 3, size=(t, h)), jnp.float32)
  w = jnp.asarray(rng.integers(-1, 2, size=(h, e)), jnp.float32)
  out = jax.jit(lambda x, w: route(x, w, k, RoutingConfig(score_fn=score_fn)))(x, w)
  scores = np.asarray(out.scores)
  assert (np.sum(scores[:, :, None] == scores[:, None, :], axis=(1, 2)) > e).any(), "no ties tested"
  np.testing.assert_array_equal(np.asarray(out.topk_experts), _np_topk_lowest_index(scores, k))


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_weights_normalised_and_scaled(score_fn):
  x = jax.random.normal(jax.random.key(1), (32, 8))
  w = jax.random.normal(jax.random.key(2), (8, 6))
  out = route(x, w, 2, RoutingConfig(score_fn=score_fn, normalize_topk=True, scale=2.5))
  np.testing.assert_allclose(np.asarray(out.topk_weights.sum(-1)), 2.5, rtol=1e-6)
  raw = route(x, w, 2, RoutingConfig(score_fn=score_fn, normalize_topk=False))
  np.testing.assert_array_equal(
      np.asarray(raw.topk_weights),
      np.take_along_axis(np.asarray(raw.scores), np.asarray(raw.topk_experts), 1))
  if score_fn == "softmax":
    np.testing.assert_allclose(np.asarray(raw.scores.sum(-1)), 1.0, rtol=1e-6)


def test_bias_changes_selection_not_weights():
  x = jax.random.normal(jax.random.key(3), (40, 8))
  w = jax.random.normal(jax.random.key(4), (8, 6))
  bias = jnp.array([0.0, 0.0, 0.0, 10.0, 0.0, 0.0])
  cfg = RoutingConfig(score_fn="sigmoid", normalize_topk=False)
  out = route(x, w, 2, cfg, expert_bias=bias)
  assert (np.asarray(out.topk_experts[:, 0]) == 3).all()
  np.testing.assert_array_equal(
      np.asarray(out.topk_weights),
      np.take_along_axis(np.asarray(out.scores), np.asarray(out.topk_experts), 1))
  g = jax.grad(lambda b: route(x, w, 2, cfg, expert_bias=b).topk_weights.sum())(bias)
  chex.assert_trees_all_equal(g, jnp.zeros_like(bias))


def test_group_limited_matches_numpy():
  t, h, e, k, groups, topk_groups = 48, 8, 16, 4, 4, 2
  x = jax.random.normal(jax.random.key(5), (t, h))
  w = jax.random.normal(jax.random.key(6), (h, e))
  bias = jax.random.normal(jax.random.key(7), (e,)) * 0.1
  cfg = RoutingConfig(score_fn="sigmoid", n_groups=groups, topk_groups=topk_groups)
  out = route(x, w, k, cfg, expert_bias=bias)
  sel = np.asarray(out.scores) + np.asarray(bias)[None]
  g = sel.reshape(t, groups, e // groups)
  gscore = np.sort(g, axis=-1)[..., -2:].sum(-1)
  best_groups = _np_topk_lowest_index(gscore, topk_groups)
  mask = np.zeros((t, groups), bool)
  np.put_along_axis(mask, best_groups, True, 1)
  masked = np.where(np.repeat(mask, e // groups, 1), sel, -np.inf)
  np.testing.assert_array_equal(np.asarray(out.topk_experts), _np_topk_lowest_index(masked, k))
  chosen_groups = np.asarray(out.topk_experts) // (e // groups)
  assert all(len(set(row)) <= topk_groups for row in chosen_groups)


def test_routing_config_errors():
  with pytest.raises(ValueError, match="score_fn"):
    RoutingConfig(score_fn="relu")
  with pytest.raises(ValueError, match="topk_groups"):
    RoutingConfig(n_groups=2, topk_groups=3)


def _router_case(t=96, h=256, e=24, seed=11):
  kx, kr, kg = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (t, h), jnp.float32).astype(jnp.bfloat16)
  router = jax.random.normal(kr, (h, e), jnp.float32) * h ** -0.5
  g = jax.random.normal(kg, (t, e), jnp.float32)
  return x, router, g


def test_bf16x3_logits_and_gradients_are_float32_accurate():
  """The router's logits from bf16 pieces against float64: forward and d_router within
  float32 accuracy (no worse than a few ulps of the largest value), d_x within its
  bfloat16 rounding; `route` computes its logits this way."""
  from uniep_jax.router_matmul import router_logits_bf16x3
  x, router, g = _router_case()
  x64, r64, g64 = (np.asarray(a.astype(jnp.float32), np.float64) for a in (x, router, g))
  logits, vjp = jax.vjp(router_logits_bf16x3, x, router)
  dx, dr = jax.jit(vjp)(g)
  assert logits.dtype == dr.dtype == jnp.float32 and dx.dtype == jnp.bfloat16

  def rel(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))

  assert rel(logits, x64 @ r64) < 2e-6
  assert rel(dr, x64.T @ g64) < 2e-6
  assert rel(dx.astype(jnp.float32), g64 @ r64.T) < 8e-3   # bf16: 2^-8 of the largest
  # a bf16 product (one piece each) is far worse: the test can tell the two apart
  assert rel(jnp.dot(x, router.astype(jnp.bfloat16), preferred_element_type=jnp.float32),
             x64 @ r64) > 1e-4
  chex.assert_trees_all_equal(route(x, router, 4, RoutingConfig()).logits, logits)


def test_bf16x3_same_bits_for_bf16_and_float32_x():
  """The oracle routes x.astype(float32), the layer routes bf16 x: the same logits and
  router gradient bit for bit (the float32 x's extra pieces are zeros), under jit."""
  from uniep_jax.router_matmul import router_logits_bf16x3
  x, router, g = _router_case(seed=12)

  @jax.jit
  def both(x, router):
    logits, vjp = jax.vjp(router_logits_bf16x3, x, router)
    return logits, vjp(g)[1]

  chex.assert_trees_all_equal(both(x, router), both(x.astype(jnp.float32), router))


def test_bf16x3_router_runs_only_bf16_gemms():
  """Forward and backward of the routing hold no float32 dot (which XLA:GPU runs on CUDA
  cores): every dot_general multiplies bfloat16 operands."""
  x, router, _ = _router_case(seed=13)

  def loss(x, router):
    out = route(x, router, 4, RoutingConfig())
    return jnp.sum(out.topk_weights * jnp.arange(4.0)) + jnp.sum(out.logits ** 2) * 1e-3

  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, router)
  dots = [tuple(v.aval.dtype for v in eqn.invars[:2]) for eqn in all_eqns(jaxpr)
          if eqn.primitive.name == "dot_general"]
  assert len(dots) >= 3, dots    # forward, d_router, d_x
  assert all(d == (jnp.bfloat16, jnp.bfloat16) for d in dots), dots
  # no float32 -> bfloat16 -> float32 round trip: XLA:GPU drops those (excess precision
  # allowed), which zeroes every piece after the first on the GPU (split_bf16's docstring)
  made_by = {}
  round_trips = []
  for eqn in all_eqns(jaxpr):
    for v in eqn.outvars:
      made_by[v] = eqn
    if eqn.primitive.name == "convert_element_type" and eqn.params["new_dtype"] == jnp.float32:
      src = made_by.get(eqn.invars[0]) if not hasattr(eqn.invars[0], "val") else None
      if (src is not None and src.primitive.name == "convert_element_type"
          and src.params["new_dtype"] == jnp.bfloat16 and src.invars[0].aval.dtype == jnp.float32):
        round_trips.append(str(eqn))
  assert not round_trips, round_trips


def _np_exact_rank(select, logits, k):
  """numpy reference of the ranking: descending select, then descending logit, then
  ascending index (np.lexsort sorts by its last key first)."""
  e = select.shape[1]
  idx = np.broadcast_to(np.arange(e), select.shape)
  order = np.lexsort((idx, -logits, -select), axis=1)
  return order[:, :k]


@pytest.mark.parametrize("score_fn", ["softmax", "sigmoid"])
def test_saturated_scores_are_ranked_by_their_logits(score_fn):
  """Logits far apart: sigmoid scores saturate at 1.0 above ~17 and softmax
  probabilities underflow to 0; float32 top-k over the scores would tie them and pick
  the lowest indices. The ranking is the logits' own (both maps are monotone), and the
  chosen experts' weights are their scores."""
  t, e, k = 256, 16, 4
  rng = np.random.default_rng(3)
  # an identity router: the logits are x itself (exact in the bf16x3 product: the
  # values are small integers times a power of two)
  logits = rng.integers(-64, 65, size=(t, e)).astype(np.float32) * 0.5
  if score_fn == "sigmoid":
    logits += 40.0                                    # every score rounds to 1.0
  else:                                               # one dominant expert per token:
    logits[np.arange(t), rng.integers(0, e, t)] = 200.0  # the others underflow to 0
  router = jnp.eye(e, dtype=jnp.float32)
  out = jax.jit(lambda x: route(x, router, k, RoutingConfig(score_fn=score_fn)))(
      jnp.asarray(logits))
  np.testing.assert_array_equal(np.asarray(out.logits), logits)
  scores = np.asarray(out.scores)
  # the scores do tie where the logits do not: the case the ranking must get right
  ties = [(scores[i] == scores[i, j]).sum() > (logits[i] == logits[i, j]).sum()
          for i in range(t) for j in np.argsort(-logits[i])[:k]]
  assert any(ties)
  want = np.argsort(-logits, axis=1, kind="stable")[:, :k]
  np.testing.assert_array_equal(np.asarray(out.topk_experts), want)
  np.testing.assert_array_equal(np.asarray(out.topk_experts), _np_exact_rank(scores, logits, k))


def test_bias_ties_are_broken_by_the_logits():
  """With a bias, experts whose biased scores round to the same float32 are ordered by
  their logits; true ties (equal logits too) go to the lower index."""
  e, k = 8, 3
  logits = np.array([[30.0, 31.0, 29.0, 32.0, 0.0, 0.0, -5.0, 1.0],
                     [20.0, 20.0, 20.0, 20.0, 20.0, 20.0, 20.0, 20.0]], np.float32)
  bias = jnp.array([0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0])
  out = route(jnp.asarray(logits), jnp.eye(e, dtype=jnp.float32), k,
              RoutingConfig(score_fn="sigmoid"), expert_bias=bias)
  # row 0: experts 0-2 score 1.0 + 0.5 (tied in float32), ordered by logit: 1, 0, 2
  # row 1: all logits equal: experts 0-2 (biased) by index
  np.testing.assert_array_equal(np.asarray(out.topk_experts), [[1, 0, 2], [0, 1, 2]])
