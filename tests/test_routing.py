"""Routing: scores, top-k tie rule, renormalisation, bias, group-limited routing."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from uniep_jax import RoutingConfig, route


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
