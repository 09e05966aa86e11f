"""Step 1 of the MoE layer: the router.

    logits  = x @ router in float32                       [T, E] f32
              (from bf16 tensor-core GEMMs: uniep_jax/router_matmul.py)
    scores  = softmax(logits) | sigmoid(logits)           [T, E] f32
    select  = scores + expert_bias (selection only)       [T, E] f32
    group-limited routing (optional): only the `topk_groups` best of `n_groups`
      contiguous expert groups stay eligible (group score: sum of its best two
      `select` values, DeepSeek-V3)
    topk_experts = the K best experts by (select, then logits), descending; a true tie
                   (equal select and equal logit) goes to the lower expert index
    topk_weights = scores[topk_experts], renormalised to sum to 1 if
                   `normalize_topk`, times `scale`

The logits break ties of `select`: float32 scores lose the order of the logits where
the maps saturate (a sigmoid of a logit above ~17 rounds to 1.0, a softmax probability
far below the largest underflows to 0), and without the logits those experts would tie
and fall to the lowest index. Both maps are monotone, so without a bias the ranking is
exactly the logits' ranking; with one, the logits order the experts whose biased scores
round to the same float.

The bias changes which experts are chosen, never the weights, and gets no
gradient. A token with a non-finite logit (a NaN or an infinity in its input) is sent
to experts 0..K-1 (its selection scores are all -inf, its tie-break logits 0, so the
lowest indices win), with its non-finite weights; `moe_ffn` counts such tokens in
aux["nonfinite_tokens"]. Everything here is a pure function of its inputs.
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp

from uniep_jax.config import RoutingConfig
from uniep_jax.router_matmul import router_logits_bf16x3


@flax.struct.dataclass
class RouterOutput:
  logits: jax.Array        # [T, E] f32
  scores: jax.Array        # [T, E] f32, softmax or sigmoid of logits
  topk_experts: jax.Array  # [T, K] int32, per token in descending selection score
  topk_weights: jax.Array  # [T, K] f32, the combine weights


def _top_k_lowest_index_wins(values: jax.Array, k: int) -> jax.Array:
  """Indices of the k largest entries per row; ties go to the lower index.

  `lax.top_k` already orders equal values by index; we rely on that and a test
  checks it against numpy's stable argsort.
  """
  _, idx = jax.lax.top_k(values, k)
  return idx.astype(jnp.int32)


def _rank_experts(select: jax.Array, tie_break: jax.Array, k: int) -> jax.Array:
  """[T, k] int32: per row, the experts in descending (select, tie_break) order, equal
  pairs by ascending index: one lexicographic sort (`lax.sort` with three keys)."""
  t, e = select.shape
  index = jnp.broadcast_to(jnp.arange(e, dtype=jnp.int32), (t, e))
  # + 0.0 makes -0.0 keys +0.0: lax.sort orders -0.0 before +0.0
  keys = (-select + 0.0, -tie_break + 0.0, index)
  return jax.lax.sort(keys, dimension=1, num_keys=3)[2][:, :k]


def _group_mask(select: jax.Array, n_groups: int, topk_groups: int) -> jax.Array:
  """[T, E] bool: experts whose group is among the `topk_groups` best groups."""
  t, e = select.shape
  per_group = e // n_groups
  grouped = select.reshape(t, n_groups, per_group)                 # [T, G, E/G]
  if per_group >= 2:
    best2, _ = jax.lax.top_k(grouped, 2)                            # [T, G, 2]
    group_score = best2[..., 0] + best2[..., 1]                     # [T, G]
  else:
    group_score = grouped[..., 0]
  chosen = _top_k_lowest_index_wins(group_score, topk_groups)       # [T, topk_groups]
  group_ok = jnp.zeros((t, n_groups), bool).at[
      jnp.arange(t)[:, None], chosen].set(True)                     # [T, G]
  return jnp.repeat(group_ok, per_group, axis=1)                    # [T, E]


def route(
    x: jax.Array,
    router: jax.Array,
    top_k: int,
    routing: RoutingConfig = RoutingConfig(),
    expert_bias: Optional[jax.Array] = None,
) -> RouterOutput:
  """Routes tokens `x` [T, H] over the experts of `router` [H, E]."""
  num_experts = router.shape[1]
  if routing.n_groups > 1 and num_experts % routing.n_groups:
    raise ValueError(
        f"n_groups={routing.n_groups} must divide the number of experts {num_experts}")
  eligible = num_experts // routing.n_groups * routing.topk_groups
  if not 1 <= top_k <= eligible:
    raise ValueError(f"top_k={top_k} must be in [1, {eligible}] (the experts of the "
                     f"topk_groups={routing.topk_groups} eligible groups)")
  logits = router_logits_bf16x3(x, router)                          # [T, E] f32
  if routing.score_fn == "softmax":
    scores = jax.nn.softmax(logits, axis=-1)
  elif routing.score_fn == "sigmoid":
    scores = jax.nn.sigmoid(logits)
  else:  # RoutingConfig validates; kept for configs built by dataclasses.replace
    raise ValueError(f"score_fn={routing.score_fn!r} is unknown")

  select = jax.lax.stop_gradient(scores)
  if expert_bias is not None:
    select = select + jax.lax.stop_gradient(expert_bias.astype(jnp.float32))[None, :]
  finite = finite_tokens(logits)[:, None]
  select = jnp.where(finite, select, -jnp.inf)
  if routing.n_groups > 1:
    eligible = _group_mask(select, routing.n_groups, routing.topk_groups)
    select = jnp.where(eligible, select, -jnp.inf)
  tie_break = jnp.where(finite, jax.lax.stop_gradient(logits), 0.0)
  topk_experts = _rank_experts(select, tie_break, top_k)            # [T, K]

  # a select over E (exactly one hit per slot), not a gather, so that the backward
  # pass holds no scatter-add
  hit = topk_experts[:, :, None] == jnp.arange(scores.shape[1], dtype=topk_experts.dtype)
  weights = jnp.sum(jnp.where(hit, scores[:, None, :], 0.0), axis=2)  # [T, K]
  if routing.normalize_topk:
    total = weights[:, 0]
    for k in range(1, top_k):  # fixed slot order
      total = total + weights[:, k]
    weights = weights / (total[:, None] + 1e-20)
  weights = weights * jnp.float32(routing.scale)
  return RouterOutput(logits=logits, scores=scores, topk_experts=topk_experts,
                      topk_weights=weights)


def finite_tokens(logits: jax.Array) -> jax.Array:
  """[T] bool: the tokens whose logits are all finite."""
  return jnp.all(jnp.isfinite(jax.lax.stop_gradient(logits)), axis=-1)


def local_aux_sums(out: RouterOutput, num_experts: int, routing: RoutingConfig):
  """Per-shard partial sums for the auxiliary losses (reduced over shards later).

  Returns (counts [E] int32, prob_sum [E] f32, z_sum f32 scalar). For sigmoid
  routing the per-token scores are normalised to sum to 1 before averaging.
  """
  t = out.topk_experts.shape[0]
  counts = jnp.zeros((num_experts,), jnp.int32).at[out.topk_experts.reshape(-1)].add(1)
  probs = out.scores
  if routing.score_fn == "sigmoid":
    probs = probs / (jnp.sum(probs, axis=-1, keepdims=True) + 1e-20)
  prob_sum = jnp.sum(probs, axis=0)                                 # [E]
  z = jax.nn.logsumexp(out.logits, axis=-1)                         # [T]
  z_sum = jnp.sum(z * z)
  del t
  return counts, prob_sum, z_sum


def aux_losses(counts, prob_sum, z_sum, num_tokens: int, top_k: int):
  """Switch-style load-balance loss and router z-loss from global sums.

  load_balance_loss = E * sum_e f_e * P_e, f_e = counts_e / (N * K) (no gradient),
  P_e = mean router probability of e. router_z_loss = mean_t logsumexp(logits_t)^2.
  """
  num_experts = counts.shape[0]
  f = jax.lax.stop_gradient(counts.astype(jnp.float32) / (num_tokens * top_k))
  p = prob_sum / num_tokens
  lb = num_experts * jnp.sum(f * p)
  z = z_sum / num_tokens
  return lb, z
