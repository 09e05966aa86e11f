"""The router's float32 logits x @ router on bfloat16 tensor cores.

Why: the router multiplies in float32 (routing is discrete; a bfloat16 product would
move near-ties), and XLA:GPU runs a float32 GEMM at `Precision.HIGHEST` on CUDA cores,
several times slower than these bfloat16 GEMMs at the same accuracy within float32
rounding (docs/decisions.md has the measurements).

How: a float32 value a is the exact sum of three bfloat16 pieces a = a0 + a1 + a2
(a0 = a truncated to bfloat16's 8 significant bits, a1 = (a - a0) truncated the same
way, a2 = a - a0 - a1: each difference is exact in float32, three 8-bit significands
cover float32's 24, and bfloat16 has float32's exponent range, so only values near the
subnormal range lose bits). A bfloat16
operand is one piece. A product of two pieces is exact in float32, so a GEMM of pieces
with float32 accumulation adds exact products, as the float32 GEMM does, in the GEMM's
own fixed order. With level s = sum over i + j = s of a_i @ b_j (terms in increasing i):

    a @ b  ~=  (level_2 + level_1) + level_0

The dropped levels (i + j >= 3) are below 2^-24 of the leading product. A bfloat16 x
(one piece) and a float32 x holding the same values give the same bits: the float32
x's extra pieces are zeros, and adding an exact zero changes nothing.

Forward: logits = x @ router (levels <= 2). Backward (custom VJP), d = d_logits [T, E]
float32 in three pieces:
  d_router = x^T @ d             levels <= 2 (a float32 parameter's gradient)
  d_x      = d @ router^T        levels <= 1 when x is bfloat16 (d_x is rounded to
                                 bfloat16: the dropped level is ~2^-16 of it), as one
                                 GEMM over the three pairs side by side along E; else
                                 levels <= 2 as the others
Elsewhere one GEMM per piece of the left operand (its right pieces side by side along
the output), so bf16 x with a float32 router costs 3 GEMM launches of 3x the bf16 FLOPs.
Deterministic: fixed pieces, fixed GEMMs, fixed order of the level sums.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from uniep_jax.rows import varying_axes, widen_varying

MAX_LEVEL = 2


def split_bf16(a: jax.Array, pieces: int) -> list[jax.Array]:
  """[a0, a1, ...] bfloat16 with a == a0 + a1 + ... (exact for float32 and 3 pieces).

  Each piece is the float32 rest with its low 16 bits cleared (truncation, an integer
  mask), which a bfloat16 holds exactly. Not `rest.astype(bf16)` and back: XLA:GPU may
  drop a float32 -> bfloat16 -> float32 round trip (`xla_allow_excess_precision`, on by
  default), which makes every rest after the first piece zero (on an H100 the logits
  come out 1.7e-3 off float64, a bfloat16 product's error; the CPU keeps the rounding)."""
  out, rest = [], a.astype(jnp.float32)
  for i in range(pieces):
    bits = jax.lax.bitcast_convert_type(rest, jnp.uint32)
    head = jax.lax.bitcast_convert_type(bits & jnp.uint32(0xFFFF0000), jnp.float32)
    out.append(head.astype(jnp.bfloat16))   # exact: head has 8 significant bits
    if i + 1 < pieces:
      rest = rest - head                    # exact: the bits head left out
  return out


def num_pieces(dtype) -> int:
  """bfloat16 operands are one piece; everything else is split into three."""
  return 1 if np.dtype(dtype) == np.dtype(jnp.bfloat16) else 3


def leveled_dot(a_pieces, b_pieces, a_contract: int, b_contract: int, max_level: int) -> jax.Array:
  """sum_{i + j <= max_level} a_i . b_j of 2-D pieces, contracting a's dim `a_contract`
  with b's `b_contract`, in float32: (level_max + ... ) + level_0, each level's terms in
  increasing i. One GEMM per a piece: its b pieces concatenated along b's free dim."""
  b_free = 1 - b_contract
  width = b_pieces[0].shape[b_free]
  terms = {}
  for i, a in enumerate(a_pieces):
    js = [j for j in range(len(b_pieces)) if i + j <= max_level]
    if not js:
      continue
    b = jnp.concatenate([b_pieces[j] for j in js], axis=b_free) if len(js) > 1 else b_pieces[js[0]]
    prod = jax.lax.dot_general(a, b, (((a_contract,), (b_contract,)), ((), ())),
                               preferred_element_type=jnp.float32)   # [a free, len(js) * width]
    for n, j in enumerate(js):
      terms[(i, j)] = prod[:, n * width:(n + 1) * width]
  total = None
  for level in range(max_level, -1, -1):
    level_sum = None
    for i in range(len(a_pieces)):
      t = terms.get((i, level - i))
      if t is not None:
        level_sum = t if level_sum is None else level_sum + t
    if level_sum is not None:
      total = level_sum if total is None else total + level_sum
  return total


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _logits(x, router, x_dtype, router_dtype):
  return _logits_fwd(x, router, x_dtype, router_dtype)[0]


def _logits_fwd(x, router, x_dtype, router_dtype):
  xs = split_bf16(x, num_pieces(x_dtype))
  rs = split_bf16(router, num_pieces(router_dtype))
  return leveled_dot(xs, rs, 1, 0, MAX_LEVEL), (xs, rs)


def _logits_bwd(x_dtype, router_dtype, res, g):
  xs, rs = res
  gs = split_bf16(g, 3)
  d_router = leveled_dot(xs, gs, 0, 0, MAX_LEVEL)                    # [H, E]
  if num_pieces(x_dtype) == 1:
    # rounded to bfloat16: levels <= 1 as ONE GEMM over the pairs side by side along the
    # contracted dim, [g0 | g0 | g1] @ [r0 | r1 | r0]^T, accumulated in float32 inside
    # it (no [T, 2H] float32 partial products to write and add)
    pairs = [(i, j) for i in range(len(gs)) for j in range(len(rs)) if i + j <= 1]
    lhs = jnp.concatenate([gs[i] for i, _ in pairs], axis=1)         # [T, n*E]
    rhs = jnp.concatenate([rs[j] for _, j in pairs], axis=1)         # [H, n*E]
    d_x = jax.lax.dot_general(lhs, rhs, (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.float32)    # [T, H]
  else:
    d_x = leveled_dot(gs, rs, 1, 1, MAX_LEVEL)                       # [T, H]
  return d_x.astype(x_dtype), d_router.astype(router_dtype)


_logits.defvjp(_logits_fwd, _logits_bwd)


def router_logits_bf16x3(x: jax.Array, router: jax.Array) -> jax.Array:
  """x [T, H] @ router [H, E] -> [T, E] float32, by bfloat16 pieces (module docstring)."""
  if x.ndim != 2 or router.ndim != 2 or x.shape[1] != router.shape[0]:
    raise ValueError(f"router_logits_bf16x3: x {x.shape} and router {router.shape} must be "
                     f"[T, H] and [H, E]")
  # Inside a type-checked shard_map the two may vary over different mesh axes (x over
  # the token axes, a replicated router over fewer): widen both to the union first, as
  # jnp.dot does, so that the custom VJP sees operands typed alike and the widening's
  # transpose (outside it) sums the router's cotangent as the plain product's would.
  axes = varying_axes(x) | varying_axes(router)
  x, router = widen_varying(x, axes), widen_varying(router, axes)
  return _logits(x, router, np.dtype(x.dtype), np.dtype(router.dtype))
