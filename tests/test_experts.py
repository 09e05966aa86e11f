"""The XLA experts' written-out backward pass (uniep_jax/experts.py): the same
gradients as JAX's autodiff of the forward maths, and, for 16-bit inputs, no
GEMM on float32 operands (JAX's own transpose feeds float32 cotangents in)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from uniep_jax.experts import swiglu_activation, swiglu_batched, swiglu_ragged_dot
from moe_testlib import rel_err

G, H, F = 3, 16, 24
SIZES = (5, 0, 7)   # an empty group, and 4 dead rows after the last one
M = sum(SIZES) + 4


def _autodiff_reference(x, w_gate_up, w_down, sizes):
  """Per group, the forward maths with JAX's autodiff; dead rows zero."""
  f32, out, start = jnp.float32, [], 0
  w_gate, w_up = w_gate_up[..., :F], w_gate_up[..., F:]
  for g, n in enumerate(sizes):
    xs = x[start:start + n]
    h = jnp.dot(xs, w_gate[g], precision="highest", preferred_element_type=f32)
    u = jnp.dot(xs, w_up[g], precision="highest", preferred_element_type=f32)
    a = swiglu_activation(h, u, x.dtype)
    out.append(jnp.dot(a, w_down[g], precision="highest", preferred_element_type=f32)
               .astype(x.dtype))
    start += n
  out.append(jnp.zeros((x.shape[0] - start, x.shape[1]), x.dtype))
  return jnp.concatenate(out)


def _inputs(dtype):
  k = jax.random.split(jax.random.key(3), 5)
  return (jax.random.normal(k[0], (M, H)).astype(dtype),
          (jax.random.normal(k[1], (G, H, 2 * F)) * H ** -0.5).astype(dtype),
          (jax.random.normal(k[3], (G, F, H)) * F ** -0.5).astype(dtype),
          jax.random.normal(k[4], (M, H)))


def test_ragged_and_batched_gradients_match_autodiff_float32():
  x, wgu, wd, ct = _inputs(jnp.float32)
  gs = jnp.asarray(SIZES, jnp.int32)
  loss = lambda f: lambda *a: jnp.sum(f(*a) * ct)  # noqa: E731
  # jitted: one program each, not an op-by-op dispatch that compiles every primitive
  ours = jax.jit(jax.grad(loss(lambda *a: swiglu_ragged_dot(*a, gs)), argnums=(0, 1, 2)))(
      x, wgu, wd)
  ref = jax.jit(jax.grad(loss(lambda *a: _autodiff_reference(*a, SIZES)), argnums=(0, 1, 2)))(
      x, wgu, wd)
  for a, b in zip(ours, ref):
    assert rel_err(a, b) < 1e-6
  assert np.all(np.asarray(ours[0])[sum(SIZES):] == 0)           # dead rows get no gradient
  # batched: groups of equal size, the same maths
  xb, ctb = x[:12].reshape(G, 4, H), ct[:12].reshape(G, 4, H)
  ours = jax.jit(jax.grad(lambda *a: jnp.sum(swiglu_batched(*a) * ctb), argnums=(0, 1, 2)))(
      xb, wgu, wd)
  ref = jax.jit(jax.grad(lambda *a: jnp.sum(_autodiff_reference(a[0].reshape(12, H), *a[1:],
                                                                (4,) * G)
                                            .reshape(G, 4, H) * ctb), argnums=(0, 1, 2)))(
      xb, wgu, wd)
  for a, b in zip(ours, ref):
    assert rel_err(a, b) < 1e-6


@pytest.mark.parametrize("which", ["ragged", "batched"])
def test_backward_gemms_take_16bit_operands(which):
  x, wgu, wd, _ = _inputs(jnp.bfloat16)
  if which == "ragged":
    gs = jnp.asarray(SIZES, jnp.int32)
    f = lambda *a: swiglu_ragged_dot(*a, gs)  # noqa: E731
  else:
    x = x[:12].reshape(G, 4, H)
    f = swiglu_batched
  jaxpr = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)),
                                  argnums=(0, 1, 2)))(x, wgu, wd)
  dots = [[str(v.aval.dtype) for v in e.invars[:2]] for e in jaxpr.jaxpr.eqns
          if e.primitive.name in ("dot_general", "ragged_dot_general")]
  # forward [h | u] = x @ w_gate_up, y; backward da, dx (K = 2F), dw_gate_up, dw_down
  assert len(dots) == 6
  assert all(d == ["bfloat16", "bfloat16"] for d in dots), dots


@pytest.mark.parametrize("x_spec,w_spec", [(("expert",), "expert"), ((), "expert"),
                                           ((None, "data"), None)])
def test_backward_types_inside_a_checked_shard_map(x_spec, w_spec):
  """Operands that vary over different mesh axes: each gradient gets its operand's
  type (summed over the axes only the other operands vary over), as autodiff does."""
  from jax.sharding import AxisType, PartitionSpec as P
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
  k = jax.random.split(jax.random.key(5), 4)
  # unsharded x meets each shard's 2 of the 8 weight groups: x holds 2 groups
  x = jax.random.normal(k[0], (2 if (x_spec, w_spec) == ((), "expert") else 8, 6, H))
  ws = [jax.random.normal(k[1], (8, H, 2 * F)) * 0.3, jax.random.normal(k[3], (8, F, H)) * 0.3]

  def reference(x, wgu, wd):
    h = jnp.einsum("gch,ghf->gcf", x, wgu[..., :F], precision="highest")
    u = jnp.einsum("gch,ghf->gcf", x, wgu[..., F:], precision="highest")
    return jnp.einsum("gcf,gfh->gch", jax.nn.silu(h) * u, wd, precision="highest")

  def grads(fn):
    def body(x, wgu, wd):
      v = jnp.sum(jnp.sin(fn(x, wgu, wd)))
      v = v + 0.0 * (jax.lax.axis_index("data") + jax.lax.axis_index("expert"))  # varies on both
      return jax.lax.psum(v, ("data", "expert"))
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(*x_spec), P(w_spec), P(w_spec)),
                      out_specs=P(), check_vma=True)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(x, *ws)

  for a, b in zip(grads(swiglu_batched), grads(reference)):
    assert rel_err(a, b) < 1e-5
