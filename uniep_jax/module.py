"""`UniEPMoE`: the MoE FFN as a Flax NNX module, on top of `uniep_jax.moe_ffn`.

Holds the router, the routed experts (sharded over the mesh's expert axis), an
optional DeepSeek-style shared expert (a dense SwiGLU applied to every token and
added to the routed output) and the auxiliary-loss-free balancing bias.

    uniep_jax.enable_xla_determinism()   # on GPUs, before JAX's first computation
    mesh = jax.make_mesh((2, 4), ("data", "expert"))
    moe = UniEPMoE(hidden=H, ffn=F, num_experts=E, top_k=K, mesh=mesh, rngs=rngs)
    with jax.set_mesh(mesh):        # un-jitted calls and their gradients need the mesh
      y = moe(x)                    # x, y: [B, S, H]; B * S must divide by the mesh size
    aux = moe.aux.get_value()       # None before the first call; then expert_counts [E],
                                    # load_balance_loss, router_z_loss, dropped,
                                    # nonfinite_tokens, rank_rows [R],
                                    # replica_weight_bytes (uniep_jax.moe_ffn)
    moe.update_expert_bias(aux["expert_counts"], rate=1e-3)

The bits repeat run after run on the CPU; on GPUs the whole program's do with XLA's
deterministic mode (`enable_xla_determinism`; the layer warns once without it).

Variables and their partitioning (the `out_sharding` metadata, read by
`nnx.get_partition_spec` / `nnx.get_named_sharding`):
  router       nnx.Param   [H, E] float32      replicated
  w_gate_up    nnx.Param   [E, H, 2F]          (expert_axis, None, None); [w_gate | w_up]
  w_down       nnx.Param   [E, F, H]           (expert_axis, None, None)
  expert_bias  ExpertBias  [E] float32         replicated; never trained by gradients
  shared       SwiGLU      [H, n_shared*F] ... replicated
  aux          nnx.Intermediate (written by every call)
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from uniep_jax.config import UniEPConfig
from uniep_jax.moe import moe_ffn
from uniep_jax.params import MoEParams, join_gate_up


class ExpertBias(nnx.Variable):
  """Per-expert selection bias of auxiliary-loss-free balancing (DeepSeek-V3).

  Not an `nnx.Param`: optimisers built on `nnx.Param` leave it alone, and
  `moe_ffn` wraps it in `stop_gradient`. It changes only through
  `UniEPMoE.update_expert_bias`.
  """


def sharding_metadata(sharding: tuple, mesh: Optional[jax.sharding.Mesh]) -> dict:
  """Partitioning metadata; eager placement only when a mesh is given."""
  if mesh is None:
    return dict(out_sharding=sharding, eager_sharding=False)
  return dict(out_sharding=sharding, mesh=mesh)


def _explicit_spec(x: jax.Array, mesh: Optional[jax.sharding.Mesh]) -> Optional[P]:
  """On a mesh with Explicit axes: x's [B, S, H] spec with S unsharded; else None."""
  if mesh is None or not any(t == AxisType.Explicit for t in mesh.axis_types):
    return None
  spec = tuple(jax.typeof(x).sharding.spec) + (None,) * 3
  return P(spec[0], None, spec[2])


def fan_in_normal(key, shape, fan_in: int, dtype) -> jax.Array:
  """Truncated normal with std 1/sqrt(fan_in)."""
  std = fan_in ** -0.5
  return (std * jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)).astype(dtype)


class SwiGLU(nnx.Module):
  """Dense SwiGLU FFN: y = (silu(x @ w_gate) * (x @ w_up)) @ w_down, replicated weights.

  w_gate, w_up: [H, F]; w_down: [F, H]. Computes in `dtype`.
  """

  def __init__(self, hidden: int, ffn: int, *, mesh=None, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    kw = sharding_metadata((None, None), mesh)
    self.dtype = dtype
    self.w_gate = nnx.Param(fan_in_normal(rngs.params(), (hidden, ffn), hidden, param_dtype), **kw)
    self.w_up = nnx.Param(fan_in_normal(rngs.params(), (hidden, ffn), hidden, param_dtype), **kw)
    self.w_down = nnx.Param(fan_in_normal(rngs.params(), (ffn, hidden), ffn, param_dtype), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    xc = x.astype(self.dtype)
    h = xc @ self.w_gate[...].astype(self.dtype)  # [..., F]
    u = xc @ self.w_up[...].astype(self.dtype)  # [..., F]
    return ((jax.nn.silu(h) * u) @ self.w_down[...].astype(self.dtype)).astype(x.dtype)


class UniEPMoE(nnx.Module):
  """Expert-parallel MoE FFN layer.

  Args:
    hidden, ffn, num_experts, top_k: H, F (width of one routed expert), E, K.
    n_shared: width of the shared expert in units of F (0: none).
    mesh: the device mesh passed to `moe_ffn`; also places the variables eagerly.
    config: `UniEPConfig` (backend, routing, capacity).
    expert_axis: the mesh axis the experts are split over.
    use_expert_bias: keep an `ExpertBias` for auxiliary-loss-free balancing.
    dtype: compute dtype of the experts (weights are cast to it; the router is
      always float32). param_dtype: storage dtype of the expert weights.
  """

  def __init__(self, hidden: int, ffn: int, num_experts: int, top_k: int, *,
               n_shared: int = 0, mesh: Optional[jax.sharding.Mesh] = None,
               config: UniEPConfig = UniEPConfig(), expert_axis: str = "expert",
               use_expert_bias: bool = False, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    if not 1 <= top_k <= num_experts:
      raise ValueError(f"{top_k=} must be in [1, {num_experts=}]")
    if mesh is not None and expert_axis in mesh.shape and num_experts % mesh.shape[expert_axis]:
      raise ValueError(
          f"{num_experts=} must be divisible by the mesh's {expert_axis!r} size {mesh.shape[expert_axis]}")
    self.hidden, self.ffn, self.num_experts, self.top_k = hidden, ffn, num_experts, top_k
    self.mesh, self.config, self.expert_axis, self.dtype = mesh, config, expert_axis, dtype

    rep = sharding_metadata((None, None), mesh)
    ep = sharding_metadata((expert_axis, None, None), mesh)
    E, H, F = num_experts, hidden, ffn
    self.router = nnx.Param(fan_in_normal(rngs.params(), (H, E), H, jnp.float32), **rep)
    w_gate = fan_in_normal(rngs.params(), (E, H, F), H, param_dtype)   # two draws, one array
    w_up = fan_in_normal(rngs.params(), (E, H, F), H, param_dtype)
    self.w_gate_up = nnx.Param(join_gate_up(w_gate, w_up), **ep)
    self.w_down = nnx.Param(fan_in_normal(rngs.params(), (E, F, H), F, param_dtype), **ep)
    self.expert_bias = (ExpertBias(jnp.zeros((E,), jnp.float32), **sharding_metadata((None,), mesh))
                        if use_expert_bias else None)
    self.shared = (SwiGLU(H, n_shared * F, mesh=mesh, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                   if n_shared else None)
    self.aux = nnx.data(None)  # nnx.Intermediate(aux dict) after a call

  def moe_params(self) -> MoEParams:
    """The routed-expert weights as `moe_ffn` takes them (experts cast to `dtype`)."""
    return MoEParams(
        router=self.router[...],
        w_gate_up=self.w_gate_up[...].astype(self.dtype),
        w_down=self.w_down[...].astype(self.dtype),
        expert_bias=None if self.expert_bias is None else self.expert_bias[...],
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    """x: [B, S, H] -> y: [B, S, H]; the routing statistics land in `self.aux`."""
    B, S, H = x.shape
    bsh_spec = _explicit_spec(x, self.mesh)
    if bsh_spec is None:  # no mesh, or Auto axes: plain reshapes
      x_nh = x.reshape(B * S, H)  # [N, H], N = B*S tokens
    else:  # Explicit axes: the batch dim's sharding carries over to the token dim
      ns = lambda *spec: NamedSharding(self.mesh, P(*spec))
      x = jax.sharding.reshard(x, ns(*bsh_spec))
      x_nh = x.reshape(B * S, H, out_sharding=ns(bsh_spec[0], bsh_spec[2]))  # [N, H]
    y_nh, aux = moe_ffn(x_nh.astype(self.dtype), self.moe_params(), mesh=self.mesh,
                        top_k=self.top_k, config=self.config, expert_axis=self.expert_axis)
    if bsh_spec is None:
      y = y_nh.reshape(B, S, H)  # [B, S, H]
    else:
      y_nh = jax.sharding.reshard(y_nh, ns(bsh_spec[0], bsh_spec[2]))
      y = y_nh.reshape(B, S, H, out_sharding=ns(*bsh_spec))  # [B, S, H]
    y = y.astype(x.dtype)
    if self.shared is not None:
      y = y + self.shared(x)
    self.aux = nnx.Intermediate(dict(aux))
    return y

  def update_expert_bias(self, expert_counts: jax.Array, rate: float) -> None:
    """Auxiliary-loss-free balancing: bias += rate * sign(mean load - load).

    Overloaded experts (load above the mean) get their selection bias lowered,
    underloaded ones raised. expert_counts: [E] assignments per expert (global).
    """
    if self.expert_bias is None:
      raise ValueError("update_expert_bias needs use_expert_bias=True")
    load = expert_counts.astype(jnp.float32)  # [E]
    step = rate * jnp.sign(jnp.mean(load) - load)  # [E]
    self.expert_bias[...] = self.expert_bias[...] + step
