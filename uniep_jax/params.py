"""`MoEParams`: the weights of one MoE layer, as a pytree.

Shapes (E experts, H hidden, F expert FFN width):
  router      [H, E] float32      logits = x.astype(f32) @ router
  w_gate_up   [E, H, 2F] x.dtype  [w_gate | w_up] along the last axis:
                                  h = x @ w_gate_up[e, :, :F], u = x @ w_gate_up[e, :, F:]
  w_down      [E, F, H] x.dtype   y_e = (silu(h) * u).astype(x.dtype) @ w_down[e]
  expert_bias [E] float32 | None  added to the scores for top-k *selection only*
                                  (auxiliary-loss-free balancing); never trained
                                  by gradients (wrapped in stop_gradient).

Why one gate/up array: the grouped GEMM's backward computes dx = [dh | du] @ w_gate_up^T
as ONE launch over K = 2F and [dw_gate | dw_up] as one wgrad over N = 2F
(docs/decisions.md has the measurement); with two separate arrays each step would copy
all expert weights into this layout and their gradients back (2 x 3.8 GB per layer on
deepseek-like). Megatron's grouped MLP stores its gated fc1 the same way.
`join_gate_up` / `split_gate_up` convert.
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from pallas_kernels.grouped_gemm import split_gate_up  # noqa: F401  (the layout's inverse)


@flax.struct.dataclass
class MoEParams:
  router: jax.Array
  w_gate_up: jax.Array
  w_down: jax.Array
  expert_bias: Optional[jax.Array] = None

  @property
  def num_experts(self) -> int:
    return self.w_gate_up.shape[0]

  @property
  def hidden(self) -> int:
    return self.w_gate_up.shape[1]

  @property
  def ffn(self) -> int:
    return self.w_gate_up.shape[2] // 2


def join_gate_up(w_gate: jax.Array, w_up: jax.Array) -> jax.Array:
  """[..., F] and [..., F] -> [..., 2F] = [w_gate | w_up] (the `w_gate_up` layout)."""
  if w_gate.shape != w_up.shape:
    raise ValueError(f"w_gate shape {w_gate.shape} must equal w_up shape {w_up.shape}")
  return jnp.concatenate([w_gate, w_up], axis=-1)


def place(a, sharding: NamedSharding):
  """Puts `a` on `sharding`: device_put for concrete arrays; inside a trace,
  `reshard` on meshes with Explicit axes, a sharding constraint otherwise."""
  if not isinstance(a, jax.core.Tracer):
    return jax.device_put(a, sharding)
  explicit = any(t == jax.sharding.AxisType.Explicit for t in sharding.mesh.axis_types)
  if explicit:
    return jax.sharding.reshard(a, sharding)
  return jax.lax.with_sharding_constraint(a, sharding)
