"""`MoEParams`: the weights of one MoE layer, as a pytree.

Shapes (E experts, H hidden, F expert FFN width):
  router      [H, E] float32      logits = x.astype(f32) @ router
  w_gate      [E, H, F] x.dtype   h = x @ w_gate[e]
  w_up        [E, H, F] x.dtype   u = x @ w_up[e]
  w_down      [E, F, H] x.dtype   y_e = (silu(h) * u).astype(x.dtype) @ w_down[e]
  expert_bias [E] float32 | None  added to the scores for top-k *selection only*
                                  (auxiliary-loss-free balancing); never trained
                                  by gradients (wrapped in stop_gradient).
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax


@flax.struct.dataclass
class MoEParams:
  router: jax.Array
  w_gate: jax.Array
  w_up: jax.Array
  w_down: jax.Array
  expert_bias: Optional[jax.Array] = None

  @property
  def num_experts(self) -> int:
    return self.w_gate.shape[0]

  @property
  def hidden(self) -> int:
    return self.w_gate.shape[1]

  @property
  def ffn(self) -> int:
    return self.w_gate.shape[2]
