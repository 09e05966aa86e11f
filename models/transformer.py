"""Decoder-only MoE transformer (Flax NNX): embedding, RMSNorm, RoPE, causal GQA
self-attention, `UniEPMoE` (or a dense SwiGLU) per layer, tied or untied head.

    model = Transformer(get_config("tiny"), mesh=mesh, backend="xla_dropless", rngs=nnx.Rngs(0))
    logits, aux = model(tokens)   # tokens [B, S] int32 -> logits [B, S, V] float32

`aux` stacks the routing statistics of the MoE layers (L_moe of them):
  expert_counts [L_moe, E] int32, load_balance_loss [L_moe], router_z_loss [L_moe], dropped [L_moe],
  nonfinite_tokens [L_moe], rank_rows [L_moe, R] int32, replica_weight_bytes [L_moe].
All weights except the routed experts are replicated; the batch is split over the
whole mesh (data parallel), the experts over the expert axis (expert parallel).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from models.config import ModelConfig
from uniep_jax.config import KernelConfig, OverlapConfig, UniEPConfig
from uniep_jax.module import SwiGLU, UniEPMoE, fan_in_normal, sharding_metadata

AUX_KEYS = ("expert_counts", "load_balance_loss", "router_z_loss", "dropped", "nonfinite_tokens",
            "rank_rows", "replica_weight_bytes")


class RMSNorm(nnx.Module):
  def __init__(self, dim: int, *, eps: float, mesh=None):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), jnp.float32), **sharding_metadata((None,), mesh))

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (y * self.scale[...]).astype(x.dtype)


def rope(x: jax.Array, theta: float) -> jax.Array:
  """Rotary position embedding (rotate-half form). x: [B, S, n, D] -> same."""
  B, S, n, D = x.shape
  inv_freq = theta ** (-jnp.arange(0, D, 2, dtype=jnp.float32) / D)  # [D/2]
  angles = jnp.arange(S, dtype=jnp.float32)[:, None] * inv_freq[None, :]  # [S, D/2]
  cos = jnp.cos(angles)[None, :, None, :]  # [1, S, 1, D/2]
  sin = jnp.sin(angles)[None, :, None, :]
  x32 = x.astype(jnp.float32)
  x1, x2 = x32[..., : D // 2], x32[..., D // 2:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
  """Causal grouped-query self-attention with RoPE; softmax in float32."""

  def __init__(self, c: ModelConfig, *, mesh=None, rngs: nnx.Rngs):
    self.c = c
    self.dtype = jnp.dtype(c.dtype)
    H, nh, nkv, hd = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim
    kw = sharding_metadata((None, None), mesh)
    self.wq = nnx.Param(fan_in_normal(rngs.params(), (H, nh * hd), H, jnp.float32), **kw)
    self.wk = nnx.Param(fan_in_normal(rngs.params(), (H, nkv * hd), H, jnp.float32), **kw)
    self.wv = nnx.Param(fan_in_normal(rngs.params(), (H, nkv * hd), H, jnp.float32), **kw)
    # GPT-2's scaled residual init: the output projection at 1/sqrt(2 * n_layers) of its
    # fan-in std. The part of every attention output that all tokens share (the causal
    # mean of the value vectors) otherwise piles up over the layers until the deeper
    # routers see nearly the same input for every token (docs/decisions.md).
    self.wo = nnx.Param(fan_in_normal(rngs.params(), (nh * hd, H), nh * hd, jnp.float32)
                        * (2 * c.n_layers) ** -0.5, **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    c, dt = self.c, self.dtype
    B, S, _ = x.shape
    nkv, g, hd = c.n_kv_heads, c.n_heads // c.n_kv_heads, c.head_dim
    q = (x @ self.wq[...].astype(dt)).reshape(B, S, c.n_heads, hd)  # [B, S, nh, hd]
    k = (x @ self.wk[...].astype(dt)).reshape(B, S, nkv, hd)  # [B, S, nkv, hd]
    v = (x @ self.wv[...].astype(dt)).reshape(B, S, nkv, hd)  # [B, S, nkv, hd]
    q, k = rope(q, c.rope_theta), rope(k, c.rope_theta)
    q = q.reshape(B, S, nkv, g, hd)  # [B, S, nkv, g, hd], query head = kv head * g + j
    scores = jnp.einsum("bsngd,btnd->bngst", q, k, preferred_element_type=jnp.float32) * hd ** -0.5
    causal = jnp.tril(jnp.ones((S, S), dtype=bool))  # [S(query), S(key)]
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)  # [B, nkv, g, S, S]
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    out = jnp.einsum("bngst,btnd->bsngd", probs, v)  # [B, S, nkv, g, hd]
    out = out.reshape(B, S, c.n_heads * hd)  # [B, S, nh*hd]
    return out @ self.wo[...].astype(dt)


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)); x + ffn(norm(x))."""

  def __init__(self, c: ModelConfig, layer: int, *, mesh, moe_config: UniEPConfig, rngs: nnx.Rngs):
    dt = jnp.dtype(c.dtype)
    self.attn_norm = RMSNorm(c.d_model, eps=c.norm_eps, mesh=mesh)
    self.attn = Attention(c, mesh=mesh, rngs=rngs)
    self.ffn_norm = RMSNorm(c.d_model, eps=c.norm_eps, mesh=mesh)
    self.is_moe = c.is_moe_layer(layer)
    if self.is_moe:
      self.ffn = UniEPMoE(c.d_model, c.d_expert, c.n_experts, c.top_k, n_shared=c.n_shared,
                          mesh=mesh, config=moe_config, use_expert_bias=c.use_expert_bias,
                          dtype=dt, rngs=rngs)
    else:
      self.ffn = SwiGLU(c.d_model, c.d_ff, mesh=mesh, dtype=dt, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.attn_norm(x))
    return x + self.ffn(self.ffn_norm(x))


def _gather_embeddings(table: jax.Array, tokens: jax.Array, mesh) -> jax.Array:
  if mesh is None or not any(t == AxisType.Explicit for t in mesh.axis_types):
    return jnp.take(table, tokens, axis=0)
  spec = tuple(jax.typeof(tokens).sharding.spec)
  spec = spec + (None,) * (tokens.ndim - len(spec))
  return table.at[tokens].get(out_sharding=NamedSharding(mesh, P(*spec, None)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def embed_lookup(table: jax.Array, tokens: jax.Array, mesh, grad_dtype=None) -> jax.Array:
  """table [V, H], tokens [B, S] -> [B, S, H], sharded like tokens on Explicit meshes.

  The backward pass is one_hot(tokens)^T @ d_out, a matmul with float32 accumulation
  (full float32 products: precision HIGHEST), instead of XLA's transpose of the
  gather: a scatter-add whose colliding rows (every repeated token) are summed by
  atomics on the GPU, in an order that changes from run to run. grad_dtype: the
  dtype the caller casts the result to right away (the activations' dtype); d_out
  is then exactly a grad_dtype value, and the matmul runs on grad_dtype operands
  (bfloat16: the fast tensor-core path, still exact products). Cost: 2*B*S*V*H
  FLOPs: 4.3 TFLOP per step for mixtral-like's 16k tokens x 32k vocabulary x 4096, an
  estimated ~6 ms at the ~700 TFLOP/s bf16 rate measured on H200 (not measured itself).
  """
  return _gather_embeddings(table, tokens, mesh)


def _embed_fwd(table, tokens, mesh, grad_dtype):
  # the residual `like` is an empty [V, 0] array: the table's row count and dtype
  return _gather_embeddings(table, tokens, mesh), (tokens, jnp.zeros((table.shape[0], 0),
                                                                     table.dtype))


def _embed_bwd(mesh, grad_dtype, res, ct):
  tokens, like = res
  if grad_dtype is not None:
    ct = ct.astype(grad_dtype)                                     # exact (see above)
  one_hot = jax.nn.one_hot(tokens, like.shape[0], dtype=ct.dtype)  # exact 0/1
  kw = {}
  if mesh is not None and any(t == AxisType.Explicit for t in mesh.axis_types):
    kw["out_sharding"] = NamedSharding(mesh, P(None, None))
  grad = jnp.einsum("...v,...h->vh", one_hot, ct, preferred_element_type=jnp.float32,
                    precision=jax.lax.Precision.HIGHEST, **kw)
  return grad.astype(like.dtype), np.zeros(tokens.shape, jax.dtypes.float0)


embed_lookup.defvjp(_embed_fwd, _embed_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def lm_head_logits(x: jax.Array, w_head: jax.Array, mesh=None) -> jax.Array:
  """x [B, S, H] (the compute dtype), w_head [H, V] (float32 parameter) -> float32 logits.

  The forward GEMM runs on x's dtype with float32 accumulation. The backward casts
  the float32 logit cotangent to x's dtype before its two GEMMs (dx = dlogits @ w^T,
  dw = x^T @ dlogits, both accumulated in float32), as mixed-precision training does
  for the output layer. Left to autodiff, the float32 cotangent promotes both GEMMs
  to float32 operands: on H100 they run as TF32 kernels, 4.0 + 2.5 ms of a ~66 ms
  mixtral-like training step, for ~2.7 ms of bf16 work at the rate of the forward's
  bf16 head GEMM in the same profile (an estimate, not measured itself). With float32
  x this is the plain einsum."""
  return _head_fwd_logits(x, w_head)


def _head_fwd_logits(x, w_head):
  return jnp.einsum("bsh,hv->bsv", x, w_head.astype(x.dtype), preferred_element_type=jnp.float32)


def _lm_head_fwd(x, w_head, mesh):
  return _head_fwd_logits(x, w_head), (x, w_head)


def _lm_head_bwd(mesh, res, ct):
  x, w_head = res
  ct, w = ct.astype(x.dtype), w_head.astype(x.dtype)
  xs = x
  if jax.default_backend() == "cpu":
    # XLA:CPU cannot run some bf16 x bf16 -> f32 dots ("Unsupported element type for
    # DotThunk", the tied head's): the same exact products, in float32 operands
    ct, w, xs = ct.astype(jnp.float32), w.astype(jnp.float32), x.astype(jnp.float32)
  dx = jnp.einsum("bsv,hv->bsh", ct, w, preferred_element_type=jnp.float32)
  kw = {}
  if mesh is not None and any(t == AxisType.Explicit for t in mesh.axis_types):
    kw["out_sharding"] = NamedSharding(mesh, P(None, None))
  dw = jnp.einsum("bsh,bsv->hv", xs, ct, preferred_element_type=jnp.float32, **kw)
  return dx.astype(x.dtype), dw.astype(w_head.dtype)


lm_head_logits.defvjp(_lm_head_fwd, _lm_head_bwd)


class Transformer(nnx.Module):
  """tokens [B, S] int32 -> (logits [B, S, V] float32, aux of the MoE layers)."""

  def __init__(self, c: ModelConfig, *, mesh: Optional[jax.sharding.Mesh] = None,
               backend: str = "xla_dropless", capacity_factor: float = 1.25,
               kernel_stages: Optional[int] = None, overlap: bool = False,
               replica_slots: int = 0, precision: str = "bf16", rngs: nnx.Rngs):
    self.c, self.mesh = c, mesh
    self.dtype = jnp.dtype(c.dtype)
    kernel = (KernelConfig() if kernel_stages is None
              else KernelConfig(max_concurrent_steps=kernel_stages))
    moe_config = UniEPConfig(backend=backend, routing=c.routing, capacity_factor=capacity_factor,
                             kernel=kernel, overlap=OverlapConfig() if overlap else None,
                             replica_slots=replica_slots, precision=precision)
    kw = sharding_metadata((None, None), mesh)
    # The table [V, H] holds rows of std 1/sqrt(H) and the forward multiplies them by
    # sqrt(H): the residual stream starts at std ~1 (0.88, truncated normal), the scale
    # of the other activations. Rows of std 1/sqrt(H) drown in the component the first
    # attention adds that is nearly the same for every token (the causal mean of the
    # value vectors, on text dominated by a few tokens): after the next RMSNorm every
    # token looks alike and routes to the same experts. Scaled in the forward (Gemma's
    # form) rather than stored at std 1: Adam's steps have a fixed size, so a std-1
    # table would learn sqrt(H) times slower relative to its scale, and the tied head
    # reads the table as it is (logits of std ~1 at initialisation). docs/decisions.md
    # has the measurements.
    self.embed = nnx.Param(fan_in_normal(rngs.params(), (c.vocab_size, c.d_model), c.d_model,
                                          jnp.float32), **kw)
    self.embed_scale = float(c.d_model) ** 0.5
    self.layers = nnx.List([Block(c, i, mesh=mesh, moe_config=moe_config, rngs=rngs)
                            for i in range(c.n_layers)])
    self.final_norm = RMSNorm(c.d_model, eps=c.norm_eps, mesh=mesh)
    self.head = (None if c.tie_embeddings else
                 nnx.Param(fan_in_normal(rngs.params(), (c.d_model, c.vocab_size), c.d_model,
                                          jnp.float32), **kw))

  def moe_modules(self) -> list[UniEPMoE]:
    return [blk.ffn for blk in self.layers if blk.is_moe]

  def __call__(self, tokens: jax.Array) -> tuple[jax.Array, dict]:
    dt = self.dtype
    # scaled after the cast: the lookup's cotangent stays a `dt` value (embed_lookup)
    x = embed_lookup(self.embed[...], tokens, self.mesh, dt).astype(dt) * jnp.asarray(
        self.embed_scale, dt)  # [B, S, H]
    for blk in self.layers:
      x = blk(x)
    x = self.final_norm(x)
    w_head = self.embed[...].T if self.head is None else self.head[...]  # [H, V]
    # all float32 already: the plain einsum, autodiff's own transpose
    logits = (_head_fwd_logits(x, w_head) if dt == jnp.float32
              else lm_head_logits(x, w_head, self.mesh))
    moes = self.moe_modules()
    aux = {k: jnp.stack([jnp.asarray(m.aux.get_value()[k]) for m in moes]) for k in AUX_KEYS}
    return logits, aux
