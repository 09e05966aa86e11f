"""Gradient sums over the mesh in an order we fix (uniep_jax/ordered_reduce.py, the training
CLI's `--grad-reduction ordered`): the sum is the rank-order float32 sum, bit for bit, and
a training step in that mode matches XLA's all-reduces to float tolerance while holding
no float all-reduce of gradient size."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from train import loop
from train.config import TrainConfig
from uniep_jax.ordered_reduce import ordered_psum

SMALL = dict(config="tiny", n_layers=2, batch=8, seq=32, steps=12, warmup=2, lr=3e-3, eval_every=6,
             eval_batches=1, progress=False, plot=False, out="unused")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("axes", [("data", "expert"), ("expert", "data"), ("expert",)])
def test_ordered_psum_is_the_rank_order_sum(dtype, check_vma, axes):
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  x = jax.random.normal(jax.random.key(0), (8, 7, 3), jnp.float32).astype(dtype)  # 21: padded
  spec = P(("data", "expert"))
  out_spec = P(*[tuple(a for a in ("data", "expert") if a not in axes) or None])
  fn = jax.jit(jax.shard_map(lambda a: ordered_psum(a, axes), mesh=mesh, in_specs=spec,
                             out_specs=out_spec, check_vma=check_vma))
  y = np.asarray(fn(jax.device_put(x, NamedSharding(mesh, spec))).astype(jnp.float32))
  xs = np.asarray(x.astype(jnp.float32)).reshape(2, 4, 1, 7, 3)  # [data, expert, shard]
  cur = {(d, e): xs[d, e] for d in range(2) for e in range(4)}
  for axis in axes:  # sum over each axis in rank order, float32, cast back to dtype
    size = 2 if axis == "data" else 4
    new = {}
    for (d, e) in cur:
      if (d if axis == "data" else e) != 0:
        continue
      terms = [cur[(r, e) if axis == "data" else (d, r)] for r in range(size)]
      acc = terms[0]
      for t in terms[1:]:
        acc = (acc + t).astype(np.float32)
      new[(d, e)] = np.asarray(jnp.asarray(acc).astype(dtype).astype(jnp.float32))
    cur = new
  expect = np.concatenate([cur[k] for k in sorted(cur)], axis=0)
  np.testing.assert_array_equal(y, expect)


@pytest.mark.parametrize("check_vma", [True, False])
def test_ordered_psum_over_a_size_one_axis_returns_a_replicated_value(check_vma):
  # a parameter replicated over data=1 is cast varying there before differentiation;
  # its summed gradient must come back typed replicated (out_specs P()), same bits
  mesh = jax.make_mesh((1, 4), ("data", "expert"))
  x = jax.random.normal(jax.random.key(1), (4, 5), jnp.float32).astype(jnp.bfloat16)

  def body(a):
    if check_vma:
      a = jax.lax.pcast(a, ("data",), to="varying")
    total = jnp.sum(a.astype(jnp.float32))  # a scalar, too
    return ordered_psum(a, ("data", "expert")), ordered_psum(total, ("data", "expert"))

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=(P(), P()),
                             check_vma=check_vma))
  y, total = fn(jax.device_put(x, NamedSharding(mesh, P("expert"))))
  y = np.asarray(y.astype(jnp.float32))
  xs = np.asarray(x.astype(jnp.float32))
  acc = xs[0:1]
  for r in range(1, 4):
    acc = (acc + xs[r:r + 1]).astype(np.float32)
  np.testing.assert_allclose(np.asarray(total), xs.sum(), rtol=1e-6)
  np.testing.assert_array_equal(y, np.asarray(jnp.asarray(acc).astype(jnp.bfloat16).astype(jnp.float32)))


def _float_all_reduce_sizes(hlo: str) -> list[int]:
  """Element counts of every float operand of the all-reduces (XLA may combine several
  into one tuple-shaped all-reduce)."""
  sizes = []
  for line in hlo.splitlines():
    m = re.search(r"= (.*?) all-reduce(-start)?\(", line)
    if m:
      for dims in re.findall(r"(?:f32|bf16|f16|f64)\[([\d,]*)\]", m.group(1)):
        sizes.append(int(np.prod([int(d) for d in dims.split(",") if d])))
  return sizes


def _moments_follow_the_params(s, params, opt_state):
  """Each Adam moment is sharded as its parameter (expert weights over the expert axis)."""
  moments = [leaf for leaf in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, dict))
             if isinstance(leaf, dict) and set(leaf) == set(params)]
  assert len(moments) == 2  # adam's mu and nu
  expert_weights = [k for k, sh in s.param_sh.items() if "expert" in str(sh.spec)]
  assert expert_weights
  for m in moments:
    for k, v in m.items():
      assert v.sharding.is_equivalent_to(s.param_sh[k], v.ndim), k


def _one_step(mode: str, check_layout: bool = False):
  """(float all-reduce sizes, new params, metrics) of one train step of the small config.
  check_layout: also asserts that the optimizer state follows the params and the compiled
  step holds no all-gather that XLA's partitioner added (test_train's small config and
  mesh: this is the program that test checked, compiled here once instead of twice)."""
  s = loop.make_setup(TrainConfig(**{**SMALL, "mesh": "data=2,expert=4", "grad_reduction": mode}))
  params, rest, opt_state = loop.init_state(s)
  if check_layout:
    _moments_follow_the_params(s, params, opt_state)
  opt_sh = jax.tree.map(lambda a: a.sharding, opt_state)
  step = loop.make_train_step(s, opt_sh)
  rng = np.random.default_rng(0)
  x, y = (jax.device_put(rng.integers(0, 256, (8, 32)).astype(np.int32), s.batch_sh) for _ in range(2))
  hlo = step.lower(params, rest, opt_state, x, y).compile().as_text()
  if check_layout:
    added = [l for l in hlo.splitlines() if "all-gather" in l and "is_spmd_generated" in l]
    assert added == [], added[:2]
  new_params, _, _, m = step(params, rest, opt_state, x, y)
  return _float_all_reduce_sizes(hlo), jax.device_get(new_params), jax.device_get(m)


def _assert_same_step(a, b):
  (_, pa, ma), (_, pb, mb) = a, b
  for k in ("loss", "ce", "grad_norm", "load_balance_loss"):
    np.testing.assert_allclose(mb[k], ma[k], rtol=2e-6, err_msg=k)
  jax.tree.map(lambda u, v: np.testing.assert_allclose(v, u, rtol=1e-5, atol=1e-6), pa, pb)


@pytest.fixture(scope="module")
def xla_step():
  return _one_step("xla", check_layout=True)


@pytest.fixture(scope="module")
def ordered_step():
  return _one_step("ordered", check_layout=True)


@pytest.mark.parametrize("grad_reduction", ["ordered", "xla"])
def test_optimizer_state_follows_the_params_and_the_step_gathers_nothing(grad_reduction, request):
  """Each Adam moment is sharded as its parameter (expert weights over the expert axis),
  and the compiled training step holds no all-gather that XLA's partitioner added: with
  the moments replicated, every step would all-gather the expert weights' moments after
  their sharded update (6 all-gathers, a third of a mixtral-like step on 4x H200).
  (Asserted by `_one_step(check_layout=True)` while it builds the fixture's step.)"""
  request.getfixturevalue(f"{grad_reduction}_step")


def test_ordered_train_step_matches_xla_and_sums_no_gradients_in_collectives(xla_step,
                                                                              ordered_step):
  xla, ordered = xla_step, ordered_step
  # XLA's all-reduces sum whole gradients; the ordered step leaves them no float sum
  # but a scalar (shard_map's transpose psums a constant: the same value on every
  # device); the MoE layer's router statistics are ordered too (`ordered_allsum`)
  assert max(xla[0]) >= 16 * 16
  assert max(ordered[0]) <= 1, ordered[0]
  _assert_same_step(xla, ordered)


def test_ordered_train_step_without_type_checks_matches_xla(monkeypatch, xla_step):
  # "pallas" and "uniep" run their shard_maps unchecked (check_vma=False), where a
  # psum's transpose is a psum: the ordered step's aux-loss weighting must hold there
  # too. The same maths with xla_dropless, its shard_maps forced unchecked.
  import uniep_jax.moe
  xla = xla_step
  monkeypatch.setattr(uniep_jax.moe, "shard_map_type_checked", lambda backend: False)
  monkeypatch.setattr(loop, "shard_map_type_checked", lambda backend: False)
  _assert_same_step(xla, _one_step("ordered"))


def test_grad_reduction_is_validated():
  with pytest.raises(ValueError, match="grad_reduction='sum'"):
    TrainConfig(grad_reduction="sum")


@pytest.mark.parametrize("check_vma", [True, False])
def test_ordered_psum_many_is_ordered_psum_per_value_in_one_chain(check_vma):
  # values grouped by (axes, dtype) into one buffer each: the same bits as one
  # ordered_psum per value, and one all_to_all per buffer and summed axis
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  from uniep_jax.ordered_reduce import ordered_psum_many
  ks = jax.random.split(jax.random.key(2), 4)
  xs = [jax.random.normal(ks[0], (8, 5, 3), jnp.float32),
        jax.random.normal(ks[1], (8, 7), jnp.float32),
        jax.random.normal(ks[2], (8, 6), jnp.float32).astype(jnp.bfloat16),
        jax.random.normal(ks[3], (8,), jnp.float32)]
  axes = [("data", "expert"), ("data", "expert"), ("data", "expert"), ("expert",)]
  spec = P(("data", "expert"))
  outs = (P(), P(), P(), P("data"))

  def many(*a):
    return tuple(ordered_psum_many(list(zip(a, axes))))

  def one_by_one(*a):
    return tuple(ordered_psum(x, ax) for x, ax in zip(a, axes))

  args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in xs]
  results = []
  for body in (many, one_by_one):
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 4, out_specs=outs,
                               check_vma=check_vma))
    results.append(fn(*args))
    if body is many:  # buffers: (data,expert) f32, (data,expert) bf16, (expert,) f32
      hlo = fn.lower(*args).as_text()
      assert hlo.count("all_to_all") == 2 + 2 + 1, hlo.count("all_to_all")
      assert hlo.count("optimization_barrier") == 2
  for a, b in zip(*results):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def test_ordered_psum_many_keeps_each_values_type_and_passes_empty_arrays():
  # a: varying over data only; b: over data and expert; both summed over data. One
  # shared buffer would come back varying over expert and fail a's out_specs P().
  from uniep_jax.ordered_reduce import ordered_psum_many
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  a = jax.device_put(jnp.arange(2 * 3, dtype=jnp.float32).reshape(2, 3), NamedSharding(mesh, P("data")))
  b = jax.device_put(jnp.arange(8 * 5, dtype=jnp.float32).reshape(8, 5),
                     NamedSharding(mesh, P(("data", "expert"))))

  def body(xa, xb):
    sa, sb, empty = ordered_psum_many([(xa, ("data",)), (xb, ("data",)),
                                       (jnp.zeros((0,), jnp.float32) + xa[0, 0], ("data",))])
    return sa, sb, empty

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P(("data", "expert"))),
                             out_specs=(P(), P("expert"), P()), check_vma=True))
  sa, sb, empty = fn(a, b)
  np.testing.assert_array_equal(np.asarray(sa), np.asarray(a).sum(0, keepdims=True))
  bb = np.asarray(b).reshape(2, 4, 1, 5)
  np.testing.assert_array_equal(np.asarray(sb), (bb[0] + bb[1]).reshape(4, 5))
  assert empty.shape == (0,)


@pytest.mark.parametrize("check_vma", [True, False])
def test_ordered_allsum_is_the_rank_order_sum_and_passes_the_cotangent(check_vma):
  from uniep_jax.ordered_reduce import ordered_allsum
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  spec = P(("data", "expert"))
  x = jax.device_put(jax.random.normal(jax.random.key(1), (8, 5)), NamedSharding(mesh, spec))
  fn = jax.shard_map(lambda a: ordered_allsum(a[0], ("data", "expert")), mesh=mesh,
                     in_specs=spec, out_specs=P(), check_vma=check_vma)
  xs = np.asarray(x)   # rank order: data-major, as the mesh lists its axes; a fixed tree
  acc = ((xs[0] + xs[1]) + (xs[2] + xs[3])) + ((xs[4] + xs[5]) + (xs[6] + xs[7]))
  np.testing.assert_array_equal(np.asarray(jax.jit(fn)(x)), acc)
  # every shard's part gets the sum's cotangent, in both shard_map modes
  w = jnp.cos(jnp.arange(5.0))
  g = jax.jit(jax.grad(lambda a: jnp.sum(fn(a) * w)))(x)
  np.testing.assert_array_equal(np.asarray(g), np.broadcast_to(np.asarray(w), (8, 5)))


@pytest.mark.parametrize("backend", ["xla_dropless", "pallas"])   # type-checked, unchecked
def test_moe_ffn_gradient_leaves_no_float_sum_to_an_all_reduce(backend):
  """The global form's float sums over devices (the router statistics forward, the
  router's and the expert weights' gradients over the axes they are replicated on)
  are ours, in rank order: the compiled gradient holds no float all-reduce, whose
  order NCCL would pick per program (left to NCCL, the router's gradient differs
  between "pallas" and "uniep" on 4x H200)."""
  import uniep_jax
  from conftest import make_mesh
  from moe_testlib import make_params, make_x
  mesh = make_mesh(2, 4)
  kx, kp = jax.random.split(jax.random.key(5))
  p = make_params(kp, experts=8, hidden=32, ffn=48, dtype=jnp.bfloat16)
  x = make_x(kx, 64, 32, jnp.bfloat16)
  cfg = uniep_jax.UniEPConfig(backend=backend)

  def loss(x, p):
    y, aux = uniep_jax.moe_ffn(x, p, mesh=mesh, top_k=2, config=cfg)
    return jnp.sum(y.astype(jnp.float32)) + aux["load_balance_loss"] + aux["router_z_loss"]

  hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, p).compile().as_text()
  assert "all-reduce" in hlo   # the integer counts still are (exact in any order)
  assert _float_all_reduce_sizes(hlo) == []


@pytest.mark.parametrize("explicit", [False, True])
def test_stack_replicas_outside_jit_places_one_copy_per_device(explicit, monkeypatch):
  """Called eagerly, `stack_replicas` gives what it gives under jit, with each device
  holding only its own copy (built there, not n copies on one device first)."""
  from uniep_jax import ordered_reduce
  from uniep_jax.ordered_reduce import stack_replicas, stacked_spec
  eager_broadcasts = []
  real = jnp.broadcast_to

  def spy(a, shape):
    if not isinstance(a, jax.core.Tracer):
      eager_broadcasts.append(shape)
    return real(a, shape)

  monkeypatch.setattr(ordered_reduce.jnp, "broadcast_to", spy)
  kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(kind,) * 2)
  specs = (P(), P("expert"))
  a = jax.device_put(jnp.arange(12.0).reshape(3, 4), NamedSharding(mesh, specs[0]))
  b = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(mesh, specs[1]))
  eager = stack_replicas((a, b), mesh, specs)
  jitted = jax.jit(lambda a, b: stack_replicas((a, b), mesh, specs))(a, b)
  for e, j, src, spec in zip(eager, jitted, (a, b), specs):
    np.testing.assert_array_equal(np.asarray(e), np.asarray(j))
    assert e.sharding.is_equivalent_to(NamedSharding(mesh, stacked_spec(mesh, spec)), e.ndim)
    n = e.shape[0]
    np.testing.assert_array_equal(np.asarray(e), np.broadcast_to(np.asarray(src), (n,) + src.shape))
    assert {s.data.shape[0] for s in e.addressable_shards} == {1}   # one copy per device
  assert eager_broadcasts == []   # the n copies were never built outside a trace
  # an input committed elsewhere (one device) is placed first, as device_put would
  one = jax.device_put(np.arange(12.0, dtype=np.float32).reshape(3, 4), jax.devices()[0])
  (c,) = stack_replicas((one,), mesh, (P(),))
  np.testing.assert_array_equal(np.asarray(c), np.broadcast_to(np.asarray(one), (8, 3, 4)))
