"""The oracle: a single-device, float32, every-expert-on-every-token MoE FFN.

No sorting, no communication, no grouping: each expert's FFN is applied to all
tokens and the top-k outputs are picked and weighted. Slow and memory hungry
(E x N x F), meant for tests on small shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from uniep_jax import routing as routing_lib
from uniep_jax.combine import weighted_topk_sum
from uniep_jax.config import UniEPConfig
from uniep_jax.params import MoEParams, split_gate_up


def dense_reference_moe(x, params: MoEParams, *, top_k: int, config: UniEPConfig = UniEPConfig()):
  """Returns (y [N, H] in x.dtype, aux dict), computed in float32."""
  f32 = jnp.float32
  hi = jax.lax.Precision.HIGHEST
  x32 = x.astype(f32)
  out = routing_lib.route(x32, params.router, top_k, config.routing, params.expert_bias)
  w_gate, w_up = split_gate_up(params.w_gate_up.astype(f32))
  h = jnp.einsum("nh,ehf->enf", x32, w_gate, precision=hi)
  u = jnp.einsum("nh,ehf->enf", x32, w_up, precision=hi)
  a = jax.nn.silu(h) * u
  y_all = jnp.einsum("enf,efh->enh", a, params.w_down.astype(f32), precision=hi)  # [E, N, H]
  n = x.shape[0]
  y_sel = y_all[out.topk_experts, jnp.arange(n)[:, None]]           # [N, K, H]
  y = weighted_topk_sum(y_sel, out.topk_weights, out_dtype=x.dtype)
  counts, prob_sum, z_sum = routing_lib.local_aux_sums(out, params.num_experts, config.routing)
  lb, z = routing_lib.aux_losses(counts, prob_sum, z_sum, n, top_k)
  aux = dict(expert_counts=counts, load_balance_loss=lb, router_z_loss=z,
             dropped=jnp.zeros((), jnp.int32),
             nonfinite_tokens=jnp.sum(~routing_lib.finite_tokens(out.logits), dtype=jnp.int32),
             rank_rows=jnp.full((1,), n * top_k, jnp.int32),
             replica_weight_bytes=jnp.zeros((), jnp.float32))
  return y, aux
