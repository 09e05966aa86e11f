"""One rank on the expert axis (every expert on every device: data parallel only).

Nothing moves between devices then: the dropless backends take the "local" transport,
whose receive layout is the sorted order itself (send and return are the identity; with
a receive bound a gather and its transpose), and "uniep" runs as "pallas"
(`UniEPConfig.one_rank_form`): its NVLink kernels would have no peer.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import uniep_jax
from uniep_jax import KernelConfig, OverlapConfig, UniEPConfig
from uniep_jax import combine as combine_lib
from uniep_jax import dispatch as dispatch_lib
from uniep_jax import rows as rows_lib
from uniep_jax.layout import local_group_sizes, make_plan
from conftest import make_mesh
from moe_testlib import all_eqns, make_params, make_x

E, H, F, TOKENS, TOP_K = 8, 32, 48, 64, 2


def _grads(cfg, mesh, x, p):
  def loss(x, p):
    y, aux = uniep_jax.moe_ffn(x, p, mesh=mesh, top_k=TOP_K, config=cfg)
    w = jnp.sin(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))
    return jnp.sum(y.astype(jnp.float32) * w) + aux["load_balance_loss"], (y, aux)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, p)


def _inputs(seed, dtype=jnp.bfloat16, bias=None):
  kx, kp = jax.random.split(jax.random.key(seed))
  return (make_x(kx, TOKENS, H, dtype),
          make_params(kp, experts=E, hidden=H, ffn=F, dtype=dtype, bias=bias))


@pytest.mark.parametrize("bound", [None, 0.5])
def test_local_transport_equals_padded_bitwise(bound):
  """transport None on an expert axis of size 1 picks "local"; its outputs, aux values
  and gradients are the padded transport's bit for bit, with a receive bound that drops
  (0.5: the tail of the sorted order) too."""
  mesh = make_mesh(2, 1)
  bias = jnp.zeros(E).at[0].set(100.0) if bound else None   # every token to expert 0
  x, p = _inputs(3, bias=bias)
  local = UniEPConfig(backend="xla_dropless", receive_capacity_factor=bound)
  padded = UniEPConfig(backend="xla_dropless", receive_capacity_factor=bound, transport="padded")
  got, want = _grads(local, mesh, x, p), _grads(padded, mesh, x, p)
  chex.assert_trees_all_equal(got, want)
  assert (int(got[0][1][1]["dropped"]) > 0) == (bound is not None)


def test_local_transport_moves_nothing():
  """At one rank the layer's forward and backward hold no all_to_all over the expert axis
  and no scatter of token rows: the receive layout is the sorted order (the padded transport's program
  has both). (The ordered sums of the aux values and the router's gradient run their own
  all_to_alls over the token axes.)"""
  mesh = make_mesh(2, 1)
  x, p = _inputs(5)

  def ops(cfg):
    fn = lambda x, p: _grads(cfg, mesh, x, p)   # noqa: E731
    eqns = all_eqns(jax.make_jaxpr(fn)(x, p))
    return ([e for e in eqns if e.primitive.name == "all_to_all"
             and "expert" in np.atleast_1d(e.params["axis_name"])],
            [e for e in eqns if e.primitive.name.startswith("scatter")   # of token rows
             and e.outvars[0].aval.shape[-1:] == (H,)])

  local, padded = ops(UniEPConfig(backend="xla_dropless")), ops(UniEPConfig(
      backend="xla_dropless", transport="padded"))
  assert padded[0] and padded[1]
  assert not local[0] and not local[1], local


# The Pallas kernels run in the interpret mode on the CPU, one device per program
# (tests/test_moe_pallas.py): a 1 x 1 mesh, two simulated SMs, shapes the kernels tile.
PE, PH, PF = 4, 64, 128


def test_uniep_at_one_rank_runs_as_pallas():
  """backend "uniep" with an expert axis of size 1 has no peer for its NVLink kernels: it
  runs as "pallas" over the "local" transport (on the CPU too, where "uniep" otherwise
  needs GPUs), whatever its overlap setting, with the bits of "pallas" over the padded
  transport."""
  mesh = make_mesh(1, 1)
  kernel = KernelConfig(num_sms=2)
  kx, kp = jax.random.split(jax.random.key(7))
  x = make_x(kx, TOKENS, PH, jnp.bfloat16)
  p = make_params(kp, experts=PE, hidden=PH, ffn=PF, dtype=jnp.bfloat16)
  want = _grads(UniEPConfig(backend="pallas", transport="padded", kernel=kernel), mesh, x, p)
  cfg = UniEPConfig(backend="uniep", kernel=kernel,
                    overlap=OverlapConfig(down_return_ctas=4, wgrad_return_ctas=4, chunk_rows=64))
  chex.assert_trees_all_equal(_grads(cfg, mesh, x, p), want)
  for c in (cfg, UniEPConfig(backend="uniep")):   # no overlap at one rank
    assert c.one_rank_form().overlap is None
  assert UniEPConfig(backend="uniep").one_rank_form().backend == "pallas"
  assert UniEPConfig(backend="uniep").one_rank_form().transport == "local"
  # an explicit transport of a non-uniep backend is kept (the A/B against "local")
  assert UniEPConfig(backend="pallas", transport="padded").one_rank_form().transport == "padded"
  assert UniEPConfig(backend="xla_capacity").one_rank_form() == UniEPConfig(backend="xla_capacity")


def test_local_transport_needs_one_rank():
  mesh = make_mesh(2, 4)
  x, p = _inputs(9, jnp.float32)
  with pytest.raises(ValueError, match="transport='local' moves no row between ranks"):
    uniep_jax.moe_ffn(x, p, mesh=mesh, top_k=TOP_K,
                      config=UniEPConfig(backend="xla_dropless", transport="local"))


def test_sort_rows_is_the_permuted_slot_copies_bitwise():
  """`sort_rows` gathers each sorted row from x directly (one gather); forward and
  backward give the bits of the K slot copies permuted into sorted order, and its
  backward has no scatter."""
  t, k, h = 48, 4, 16
  kx, ke, kc = jax.random.split(jax.random.key(11), 3)
  x = make_x(kx, t, h, jnp.bfloat16)
  topk = jax.random.randint(ke, (t, k), 0, E)
  counts = local_group_sizes(topk, E)[None]
  plan = make_plan(topk, counts, 0)
  ct = make_x(kc, t * k, h, jnp.bfloat16)

  def old(x):
    return rows_lib.permute_rows(rows_lib.replicate_slots(x, k), plan.sort_order,
                                 plan.sorted_position)

  new = lambda x: dispatch_lib.sort_rows(x, plan)   # noqa: E731
  (y_new, vjp_new), (y_old, vjp_old) = jax.vjp(new, x), jax.vjp(old, x)
  chex.assert_trees_all_equal((y_new, vjp_new(ct)), (y_old, vjp_old(ct)))
  np.testing.assert_array_equal(np.asarray(y_new, np.float32),
                                np.asarray(x, np.float32)[np.asarray(plan.sort_order) // k])
  bwd = jax.make_jaxpr(lambda x, ct: jax.vjp(new, x)[1](ct))(x, ct)
  assert not any(e.primitive.name.startswith("scatter") for e in all_eqns(bwd))
  # the Pallas backends' gather on GPUs (the live-rows copy kernel; interpret mode here)
  kern = lambda x: dispatch_lib.sort_rows(x, plan, row_kernel=True)   # noqa: E731
  y_kern, vjp_kern = jax.vjp(kern, x)
  chex.assert_trees_all_equal((y_kern, vjp_kern(ct)), (y_old, vjp_old(ct)))
  assert not dispatch_lib.compiled_row_kernels(128, jnp.bfloat16)   # the CPU: XLA's gather
  from pallas_kernels import device as device_lib
  with device_lib.lowering_for_gpu():
    assert dispatch_lib.compiled_row_kernels(128, jnp.bfloat16)
    # rows the kernel's TMA boxes cannot hold on a GPU: XLA's gather (the same rows)
    for hidden in (16, 24, 40, 64, 136):
      assert not dispatch_lib.compiled_row_kernels(hidden, jnp.bfloat16)


def test_combine_sorted_rows_is_the_plain_combine_bitwise():
  """The one-rank combine on GPUs (`combine.combine_sorted_rows`: its backward forms each
  sorted row's cotangent dtype(w * f32(dy)) with the weighted live-rows copy kernel,
  interpret mode here) gives the plain combine's bits (`collect` over the local transport,
  then `weighted_topk_sum`): y, the sorted rows' cotangent and d_weights."""
  t, k, h = 48, 4, 16
  ky, ke, kw, kc = jax.random.split(jax.random.key(13), 4)
  topk = jax.random.randint(ke, (t, k), 0, E)
  plan = make_plan(topk, local_group_sizes(topk, E)[None], 0)
  y_sorted = make_x(ky, t * k, h, jnp.bfloat16)
  weights = jax.nn.softmax(jax.random.normal(kw, (t, k)), axis=-1)
  dy = make_x(kc, t, h, jnp.bfloat16)

  def plain(y, w):
    return combine_lib.combine(y, w, plan, axis_name=None, transport="local",
                               out_dtype=jnp.bfloat16)

  fused = lambda y, w: combine_lib.combine_sorted_rows(y, w, plan, jnp.bfloat16)   # noqa: E731
  (o_new, vjp_new), (o_old, vjp_old) = jax.vjp(fused, y_sorted, weights), jax.vjp(
      plain, y_sorted, weights)
  chex.assert_trees_all_equal((o_new, vjp_new(dy)), (o_old, vjp_old(dy)))
