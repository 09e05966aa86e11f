"""`UniEPConfig.slot_reduction="owner_partials"`: a token's slots summed per owner rank
first, in expert order (uniep_jax/combine.py): the two-level arithmetic bit for bit against a numpy
emulation, its backward, and the layer's backends agreeing bit for bit in the mode."""

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import uniep_jax
from conftest import make_mesh
from moe_testlib import host_stepped_loops, make_params, make_x, rel_err
from test_dedup import _moe_fns
from uniep_jax import UniEPConfig
from uniep_jax.combine import SlotOwners, owner_partial_sum, weighted_topk_sum
from uniep_jax.dispatch import replicate_slots

BF16 = ml_dtypes.bfloat16


def _round(a):
  """float32 -> bfloat16 -> float32 (to nearest even)."""
  return np.asarray(a, np.float32).astype(BF16).astype(np.float32)


def _emulated(terms, experts, per_owner):
  """The module docstring's sum, token by token: per owner (ascending), a float32 fold
  of its terms in ascending expert order starting from the first, rounded to bf16; then
  a float32 fold of the partials, rounded to bf16."""
  t, k, h = terms.shape
  out = np.zeros((t, h), np.float32)
  for i in range(t):
    outer = None
    for r in sorted(set((experts[i] // per_owner).tolist())):
      inner = None
      for j in np.argsort(experts[i]):
        if experts[i, j] // per_owner == r:
          inner = terms[i, j].copy() if inner is None else np.float32(inner + terms[i, j])
      partial = _round(inner)
      outer = partial if outer is None else np.float32(outer + partial)
    out[i] = _round(outer)
  return out


PER_OWNER = 8      # 32 experts over 4 owner ranks


def _inputs(seed, t=24, k=6, h=16):
  rng = np.random.default_rng(seed)
  y = rng.standard_normal((t, k, h)).astype(np.float32).astype(BF16)
  y[0, :, :3] = -0.0                             # signed zeros: a fold must not add +0.0
  w = rng.random((t, k)).astype(np.float32)
  experts = np.stack([rng.permutation(4 * PER_OWNER)[:k] for _ in range(t)]).astype(np.int32)
  experts[1] = 2 * PER_OWNER + np.arange(k)[::-1]   # one owner holds every slot, reversed
  experts[2] = [1, 9, 17, 25, 2, 10]                 # every owner present (0 1 2 3 0 1)
  # token 3, column 0: three slots of owner 0 whose sum depends on the order: in expert
  # order (slots 0, 2, 1) (1 - 1) + 2^-24 = 2^-24, in slot order (1 + 2^-24) - 1 = 0
  experts[3] = [5, 7, 6, 9, 17, 25]
  y[3, :, 0] = ORDER_COLUMN
  w[3] = 1.0
  return y, w, experts


ORDER_COLUMN = np.array([1.0, 2.0 ** -24, -1.0, 0.0, 0.0, 0.0], np.float32)


def test_owner_partial_sum_matches_numpy_bitwise():
  y, w, experts = _inputs(0)
  terms = _round(w[:, :, None] * y.astype(np.float32))
  got = jax.jit(lambda a, e: owner_partial_sum(a, e, PER_OWNER, jnp.bfloat16, jnp.bfloat16))(
      jnp.asarray(terms), jnp.asarray(experts))
  want = _emulated(terms, experts, PER_OWNER)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want.astype(BF16).view(np.uint16))
  assert np.signbit(want[0, :3]).all()            # the emulation kept -0.0; so did the sum
  assert want[3, 0] == 2.0 ** -24                 # expert order inside the owner


def test_owner_weighted_sum_forward_and_backward():
  """The combine in the mode: terms bf16(w * f32(y)) then the two-level sum (numpy);
  its backward is the plain combine's (roundings taken as identity), bit for bit; and
  it differs from the plain slot-order sum (the mode changes bits)."""
  y, w, experts = _inputs(1)
  yj, wj = jnp.asarray(y), jnp.asarray(w)
  oj = SlotOwners(jnp.asarray(experts), PER_OWNER)
  got = jax.jit(lambda a, b, o: weighted_topk_sum(a, b, jnp.bfloat16, owners=o))(yj, wj, oj)
  want = _emulated(_round(w[:, :, None] * y.astype(np.float32)), experts, PER_OWNER)
  np.testing.assert_array_equal(np.asarray(got).view(np.uint16), want.astype(BF16).view(np.uint16))
  plain = weighted_topk_sum(yj, wj, jnp.bfloat16)
  assert not np.array_equal(np.asarray(plain).view(np.uint16), np.asarray(got).view(np.uint16))

  def loss(a, b, o):
    out = weighted_topk_sum(a, b, jnp.bfloat16, owners=o)
    return jnp.sum(jnp.sin(out.astype(jnp.float32)))

  g = jax.jit(jax.grad(loss, argnums=(0, 1)))(yj, wj, oj)
  # the same cotangent (cos of the mode's output) through the plain combine's backward
  dy = jnp.cos(got.astype(jnp.float32)).astype(jnp.bfloat16)
  _, vjp = jax.vjp(lambda a, b: weighted_topk_sum(a, b, jnp.bfloat16), yj, wj)
  chex.assert_trees_all_equal(g, vjp(dy))


def test_float16_partials_keep_subnormals():
  """float16 (range to 6.1e-5 before subnormals): a partial that lands below it is
  rounded as a conversion rounds it (what a kernel's cvt.rn does, and what the owner-side
  pre-sum stores), not flushed to zero."""
  terms = np.zeros((2, 2, 4), np.float32)
  terms[0, :, 0] = [3.0e-5, 1.0e-6]          # one owner: partial 3.1e-5, an f16 subnormal
  terms[1, :, 1] = [-2.0e-7, 5.0]
  terms = terms.astype(np.float16).astype(np.float32)
  experts = np.array([[1, 2], [3, 12]], np.int32)
  got = owner_partial_sum(jnp.asarray(terms), jnp.asarray(experts), PER_OWNER,
                          jnp.float16, jnp.float32)
  want = np.float32(np.float16(np.float32(terms[0, 0, 0] + terms[0, 1, 0])))
  assert 0 < want < np.finfo(np.float16).tiny
  assert np.asarray(got)[0, 0] == want
  assert np.asarray(got)[1, 1] == np.float32(np.float16(terms[1, 0, 1])) + np.float32(5.0)


def test_replicate_slots_backward_sums_by_owner():
  """The dispatch's backward (dx = sum of a token's slot cotangents) in the mode: the
  two-level sum of the (already bf16) slot rows, bit for bit."""
  _, _, experts = _inputs(2)
  t, k = experts.shape
  x = jnp.zeros((t, 16), jnp.bfloat16)
  ct = np.random.default_rng(3).standard_normal((t, k, 16)).astype(np.float32)
  ct[3, :, 0] = ORDER_COLUMN                      # the order-sensitive token
  ct = jnp.asarray(ct.reshape(t * k, 16), jnp.bfloat16)
  owners = SlotOwners(jnp.asarray(experts), PER_OWNER)
  _, vjp = jax.vjp(lambda a: replicate_slots(a, k, owners), x)
  (dx,) = vjp(ct)
  want = _emulated(np.asarray(ct, np.float32).reshape(t, k, 16), experts, PER_OWNER)
  assert want[3, 0] == 2.0 ** -24
  np.testing.assert_array_equal(np.asarray(dx).view(np.uint16), want.astype(BF16).view(np.uint16))


def test_layer_backends_agree_bitwise_in_owner_mode():
  """EP 4: the dropless dispatch, the de-duplicated one and the capacity path
  (capacity large enough to drop nothing) give the same output and gradients bit for
  bit in the mode, as they do in slot order; within bf16 error of the float32 oracle;
  and different bits from slot order (forward and x's gradient: both sums changed)."""
  e, h, f, k = 8, 32, 24, 3
  mesh = make_mesh(1, 4)
  kx, kp = jax.random.split(jax.random.key(11))
  p = make_params(kp, experts=e, hidden=h, ffn=f, dtype=jnp.bfloat16)
  x = make_x(kx, 64, h, jnp.bfloat16)
  outs = {}
  for name, cfg in {
      "dropless": UniEPConfig(backend="xla_dropless", slot_reduction="owner_partials"),
      "dedup": UniEPConfig(backend="xla_dropless", dedup_tokens=True,
                           slot_reduction="owner_partials"),
      # the unique rows in (expert group, token) order: the partials' home positions too
      "dedup_groups": UniEPConfig(backend="xla_dropless", dedup_tokens=True,
                                  dedup_send_groups=2, slot_reduction="owner_partials"),
      "capacity": UniEPConfig(backend="xla_capacity", capacity_factor=float(e),
                              slot_reduction="owner_partials"),
      "slot_order": UniEPConfig(backend="xla_dropless")}.items():
    fwd, grad = _moe_fns(mesh, cfg, k)
    outs[name] = (fwd(x, p), grad(x, p))       # ((y, aux), gradients of x and params)
  chex.assert_trees_all_equal(outs["dedup"], outs["dropless"])
  chex.assert_trees_all_equal(outs["dedup_groups"], outs["dropless"])
  chex.assert_trees_all_equal(outs["capacity"][0], outs["dropless"][0])
  chex.assert_trees_all_equal(outs["capacity"][1][0], outs["dropless"][1][0])
  (y, _), (gx, _) = outs["dropless"]
  (y0, _), (gx0, _) = outs["slot_order"]
  assert not np.array_equal(np.asarray(y).view(np.uint16), np.asarray(y0).view(np.uint16))
  assert not np.array_equal(np.asarray(gx).view(np.uint16), np.asarray(gx0).view(np.uint16))
  y_ref, _ = uniep_jax.moe_ffn(x.astype(jnp.float32), jax.tree.map(
      lambda a: a.astype(jnp.float32), p), mesh=None, top_k=k,
      config=UniEPConfig(backend="dense_reference"))
  assert rel_err(y, y_ref) < 2e-2
  assert rel_err(y, y0) < 2e-2


def test_owner_presum_when_every_slot_sits_on_one_owner():
  """EP 2, K 3 <= 4 experts per rank, every token routed to rank 0's experts (a bias):
  each token's slots all on one owner, and rank 1 receives nothing (U[s, 1] = 0). The
  de-duplicated backward's pre-sum still equals the home-side sum bit for bit."""
  mesh = make_mesh(1, 2)
  kx, kp = jax.random.split(jax.random.key(13))
  bias = jnp.zeros(8).at[:4].set(100.0)
  p = make_params(kp, experts=8, hidden=32, ffn=24, dtype=jnp.bfloat16, bias=bias)
  x = make_x(kx, 32, 32, jnp.bfloat16)
  outs = []
  for dedup in (False, True):
    fwd, grad = _moe_fns(mesh, UniEPConfig(backend="xla_dropless", dedup_tokens=dedup,
                                       slot_reduction="owner_partials"), 3)
    outs.append((fwd(x, p), grad(x, p)))
  chex.assert_trees_all_equal(outs[1], outs[0])


def test_nvlink_owner_presum_plumbing_equals_padded_bitwise(monkeypatch):
  """The "nvlink" transport in the mode, with the NVLink transfer and the live-rows
  gather replaced by their contracts (tests/test_dedup.py's plumbing test): the
  backward's partials go back over `_dedup_nvlink`'s segments reversed and home folds
  them; output and gradients equal the padded transport's home-side sum bit for bit."""
  from test_dedup import nvlink_plumbing
  run = nvlink_plumbing(monkeypatch, 29, experts=8, hidden=32, ffn=24, top_k=3)
  mode = dict(slot_reduction="owner_partials")
  chex.assert_trees_all_equal(run("nvlink", dedup_tokens=True, **mode),
                              run("padded", dedup_tokens=False, **mode))


@pytest.mark.parametrize("bad,match", [
    (dict(slot_reduction="per_rank"), "slot_reduction"),
    (dict(backend="uniep", slot_reduction="owner_partials",
          fused=uniep_jax.FusedConfig(return_in_kernel=False)), "fused")])
def test_slot_reduction_config_errors(bad, match):
  with pytest.raises(ValueError, match=match):
    UniEPConfig(**bad)


def test_dedup_layer_lowers_without_a_while_loop():
  """The de-duplicated layer's forward and backward in both modes hold no while loop:
  XLA:GPU drives one from the host, a round trip per step (jnp.searchsorted's default
  "scan" bisection in the owner fold cost 0.77 ms of idle GPU per fwd+bwd at qwen3-like
  EP 4 on 4x H200; ragged.SEARCH_METHOD unrolls it)."""
  mesh = make_mesh(1, 4)
  p = make_params(jax.random.key(1), experts=16, hidden=32, ffn=32, dtype=jnp.bfloat16)
  x = make_x(jax.random.key(2), 64, 32, jnp.bfloat16)
  for mode in ("slot_order", "owner_partials"):
    cfg = UniEPConfig(backend="xla_dropless", transport="padded", dedup_tokens=True,
                      slot_reduction=mode)
    _, grad = _moe_fns(mesh, cfg, 4)
    text = grad.trace(x, p).lower().as_text()
    assert not host_stepped_loops(text), mode
