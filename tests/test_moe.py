"""The shared backend suite: every EP backend against `dense_reference`.

float32 inputs: tight tolerance; bfloat16: the tolerance of bf16 rounding of the
activations and outputs. Gradients of x and every parameter too.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import uniep_jax
from uniep_jax import RoutingConfig, UniEPConfig
from conftest import make_mesh
from moe_testlib import capacity_keep_mask, host_stepped_loops, make_params, make_x, rel_err

E, H, F = 8, 32, 48
BIG_CF = 1e3  # capacity large enough that nothing is dropped


def _cfg(backend, **kw):
  if backend == "xla_capacity":
    kw.setdefault("capacity_factor", BIG_CF)
  return UniEPConfig(backend=backend, **kw)


@functools.lru_cache(maxsize=None)
def _fwd(backend, data, ep, top_k, cfg):
  mesh = None if backend == "dense_reference" else make_mesh(data, ep)
  return jax.jit(lambda x, p: uniep_jax.moe_ffn(x, p, mesh=mesh, top_k=top_k, config=cfg))


@functools.lru_cache(maxsize=None)
def _loss(backend, data, ep, top_k, cfg):
  """The jitted gradient, one per (backend, mesh, top_k, cfg) in this module (as `_fwd`):
  the dense reference's, which every gradient test compares with, compiles once."""
  f = _fwd(backend, data, ep, top_k, cfg)

  def loss(x, p):
    y, aux = f(x, p)
    w = jnp.sin(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))
    return jnp.sum(y.astype(jnp.float32) * w) + aux["load_balance_loss"] + 0.1 * aux["router_z_loss"]

  return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _reference(x, p, top_k, routing=RoutingConfig()):
  cfg = UniEPConfig(backend="dense_reference", routing=routing)
  return _fwd("dense_reference", 1, 1, top_k, cfg)(x, p)


def _check_forward(backend, data, ep, *, tokens=64, top_k=2, routing=RoutingConfig(),
                   bias=None, dtype=jnp.float32, seed=0, router_scale=1.0):
  kx, kp = jax.random.split(jax.random.key(seed))
  p = make_params(kp, experts=E, hidden=H, ffn=F, dtype=dtype, bias=bias)
  p = p.replace(router=p.router * router_scale)
  x = make_x(kx, tokens, H, dtype)
  cfg = _cfg(backend, routing=routing)
  y, aux = _fwd(backend, data, ep, top_k, cfg)(x, p)
  y_ref, aux_ref = _reference(x, p, top_k, routing)
  assert y.dtype == dtype and y.shape == x.shape
  tol = 2e-6 if dtype == jnp.float32 else 2e-2
  assert rel_err(y, y_ref) < tol, rel_err(y, y_ref)
  np.testing.assert_array_equal(np.asarray(aux["expert_counts"]), np.asarray(aux_ref["expert_counts"]))
  assert int(aux["dropped"]) == 0
  np.testing.assert_allclose(float(aux["load_balance_loss"]), float(aux_ref["load_balance_loss"]), rtol=1e-5)
  np.testing.assert_allclose(float(aux["router_z_loss"]), float(aux_ref["router_z_loss"]), rtol=1e-5)
  return x, p, aux


BACKENDS = ["xla_dropless", "xla_capacity"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("data,ep", [(1, 1), (1, 2), (2, 4), (1, 8)])
def test_forward_matches_reference(backend, data, ep):
  _check_forward(backend, data, ep, routing=RoutingConfig(score_fn="softmax"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigmoid_group_limited_with_bias(backend):
  bias = jnp.linspace(-0.2, 0.2, E)
  _check_forward(backend, 2, 4, top_k=3, bias=bias,
                 routing=RoutingConfig(score_fn="sigmoid", n_groups=4, topk_groups=2, scale=1.5))


@pytest.mark.parametrize("backend", BACKENDS)
def test_expert_without_tokens_and_all_to_one(backend):
  # A bias of -100 on expert 5 means it is never picked; +100 on expert 2
  # sends every token's first slot there.
  bias = jnp.zeros(E).at[5].set(-100.0).at[2].set(100.0)
  _, _, aux = _check_forward(backend, 1, 4, bias=bias, routing=RoutingConfig(score_fn="sigmoid"))
  counts = np.asarray(aux["expert_counts"])
  assert counts[5] == 0 and counts[2] == 64
  # top_k=1 with that bias: all tokens to one expert, every other expert empty
  _, _, aux = _check_forward(backend, 1, 8, top_k=1, bias=bias, routing=RoutingConfig(score_fn="sigmoid"))
  assert np.asarray(aux["expert_counts"]).tolist() == [0, 0, 64, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_equals_num_experts_and_odd_token_counts(backend):
  _check_forward(backend, 1, 4, top_k=E, tokens=12)       # 3 tokens per shard
  _check_forward(backend, 2, 2, top_k=3, tokens=20)       # 5 tokens per shard


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16(backend):
  _check_forward(backend, 2, 4, dtype=jnp.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("data,ep", [(1, 2), (2, 4), (1, 8)])
def test_gradients_match_reference(backend, data, ep):
  kx, kp = jax.random.split(jax.random.key(11))
  p = make_params(kp, experts=E, hidden=H, ffn=F)
  x = make_x(kx, 64, H)
  g = _loss(backend, data, ep, 2, _cfg(backend))(x, p)
  g_ref = _loss("dense_reference", 1, 1, 2, UniEPConfig(backend="dense_reference"))(x, p)
  for name, a, b in [("x", g[0], g_ref[0]), ("router", g[1].router, g_ref[1].router),
                     ("w_gate_up", g[1].w_gate_up, g_ref[1].w_gate_up),
                     ("w_down", g[1].w_down, g_ref[1].w_down)]:
    assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))


def test_capacity_drops_are_counted_and_zeroed():
  top_k, tokens, ep = 2, 64, 4
  kx, kp = jax.random.split(jax.random.key(21))
  bias = jnp.zeros(E).at[0].set(100.0)    # every token's first choice is expert 0
  p = make_params(kp, experts=E, hidden=H, ffn=F, bias=bias)
  x = make_x(kx, tokens, H)
  cfg = UniEPConfig(backend="xla_capacity", capacity_factor=1.0)
  y, aux = _fwd("xla_capacity", 1, ep, top_k, cfg)(x, p)
  out = uniep_jax.route(x, p.router, top_k, cfg.routing, p.expert_bias)
  topk = np.asarray(out.topk_experts)
  cap = int(np.ceil(1.0 * (tokens // ep) * top_k / E))
  # per shard, assignments beyond `cap` per expert in (expert, token, slot) order are dropped
  keep = capacity_keep_mask(topk, ep, cap, E)
  assert int(aux["dropped"]) == int((~keep).sum()) > 0
  # the reference with dropped slots' weights set to zero
  ref_w = np.where(keep, np.asarray(out.topk_weights), 0.0)
  p32 = jax.tree.map(lambda a: a, p)
  w_gate, w_up = uniep_jax.split_gate_up(p32.w_gate_up)
  h = jnp.einsum("nh,ehf->enf", x, w_gate)
  u = jnp.einsum("nh,ehf->enf", x, w_up)
  y_all = jnp.einsum("enf,efh->enh", jax.nn.silu(h) * u, p32.w_down)
  y_sel = np.asarray(y_all)[topk, np.arange(tokens)[:, None]]
  y_ref = np.einsum("tk,tkh->th", ref_w, y_sel)
  assert rel_err(y, y_ref) < 2e-5


@pytest.mark.parametrize("backend", ["dense_reference"] + BACKENDS)
def test_bitwise_deterministic_under_jit(backend):
  kx, kp = jax.random.split(jax.random.key(31))
  p = make_params(kp, experts=E, hidden=H, ffn=F, dtype=jnp.bfloat16)
  x = make_x(kx, 64, H, jnp.bfloat16)
  cfg = _cfg(backend)
  if backend == "xla_capacity":
    cfg = UniEPConfig(backend=backend, capacity_factor=1.0)   # with drops
  f = _fwd(backend, 2, 4, 2, cfg)
  g = _loss(backend, 2, 4, 2, cfg)
  runs = [(f(x, p), g(x, p)) for _ in range(3)]
  chex.assert_trees_all_equal(runs[0], runs[1])
  chex.assert_trees_all_equal(runs[0], runs[2])


def test_per_shard_form_inside_shard_map():
  from jax.sharding import PartitionSpec as P
  mesh = make_mesh(2, 4)
  kx, kp = jax.random.split(jax.random.key(41))
  p = make_params(kp, experts=E, hidden=H, ffn=F)
  x = make_x(kx, 64, H)
  axes = ("data", "expert")

  def body(xl, pl):
    return uniep_jax.moe_ffn_shard(xl, pl, top_k=2, token_axes=axes)

  specs = uniep_jax.param_specs(p)
  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axes), specs),
                             out_specs=(P(axes), {k: P() for k in uniep_jax.moe.AUX_KEYS})))
  from jax.sharding import NamedSharding
  y_ref, _ = _reference(x, p, 2)
  x = jax.device_put(x, NamedSharding(mesh, P(axes)))
  p = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), p, specs)
  y, _ = fn(x, p)
  assert rel_err(y, y_ref) < 2e-6


@pytest.mark.parametrize("bound", [None, 1.0])
def test_ragged_transport_traces_with_gradients(bound):
  """ragged_all_to_all does not compile on the CPU (moe_ffn refuses it there), but
  its forward and backward must trace and lower: the shard_map type check runs at
  trace time. Uses the per-shard form, which leaves the transport to the caller."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = make_mesh(2, 4)
  axes = ("data", "expert")
  kx, kp = jax.random.split(jax.random.key(51))
  p = make_params(kp, experts=E, hidden=H, ffn=F)
  x = make_x(kx, 64, H)
  cfg = UniEPConfig(backend="xla_dropless", receive_capacity_factor=bound)
  specs = uniep_jax.param_specs(p)

  def body(xl, pl):
    y, _ = uniep_jax.moe_ffn_shard(xl, pl, top_k=2, config=cfg, token_axes=axes,
                                   transport="ragged")
    return y

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P(axes), specs), out_specs=P(axes))
  x = jax.device_put(x, NamedSharding(mesh, P(axes)))
  p = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), p, specs)
  loss = lambda x, p: jnp.sum(fn(x, p) ** 2)  # noqa: E731
  text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, p).as_text()
  assert text.count("ragged_all_to_all") >= 4   # dispatch, combine and their transposes


def _expected_receive_drops(topk, data, ep, tokens_per_shard, cap, experts):
  """[N, K] bool kept mask under a receive bound of `cap` rows per rank: per data
  replica and destination rank, rows in (local expert, source, token, slot)
  order past `cap` are dropped."""
  n, k = topk.shape
  el = experts // ep
  keep = np.ones_like(topk, bool)
  for d in range(data):
    for me in range(ep):
      rows = []
      for s in range(ep):
        base = (d * ep + s) * tokens_per_shard
        for t in range(tokens_per_shard):
          for kk in range(k):
            e = topk[base + t, kk]
            if e // el == me:
              rows.append((e - me * el, s, t, kk, base + t))
      for pos, (_, _, _, kk, tok) in enumerate(sorted(rows)):
        keep[tok, kk] = pos < cap
  return keep


@pytest.mark.parametrize("data,ep", [(1, 4), (2, 2)])
def test_receive_bound_drops_deterministically_and_counts(data, ep):
  tokens, top_k = 128, 2
  kx, kp = jax.random.split(jax.random.key(61))
  bias = jnp.zeros(E).at[0].set(100.0).at[1].set(100.0)    # every token to experts 0 and 1
  p = make_params(kp, experts=E, hidden=H, ffn=F, bias=bias)
  x = make_x(kx, tokens, H)
  cfg = UniEPConfig(backend="xla_dropless", receive_capacity_factor=1.0)
  y, aux = _fwd("xla_dropless", data, ep, top_k, cfg)(x, p)
  tps = tokens // (data * ep)
  cap = uniep_jax.layout.receive_rows(tps, top_k, ep, cfg.receive_capacity_factor)
  assert cap is not None and cap < ep * tps * top_k
  out = uniep_jax.route(x, p.router, top_k, cfg.routing, p.expert_bias)
  keep = _expected_receive_drops(np.asarray(out.topk_experts), data, ep, tps, cap, E)
  assert int(aux["dropped"]) == int((~keep).sum()) > 0
  w_gate, w_up = uniep_jax.split_gate_up(p.w_gate_up)
  h = jnp.einsum("nh,ehf->enf", x, w_gate, precision="highest")
  u = jnp.einsum("nh,ehf->enf", x, w_up, precision="highest")
  y_all = jnp.einsum("enf,efh->enh", jax.nn.silu(h) * u, p.w_down, precision="highest")
  y_sel = np.asarray(y_all)[np.asarray(out.topk_experts), np.arange(tokens)[:, None]]
  y_ref = np.einsum("tk,tkh->th", np.where(keep, np.asarray(out.topk_weights), 0.0), y_sel)
  assert rel_err(y, y_ref) < 2e-5
  # the same bound without overflow is exactly the dropless result
  cfg_big = UniEPConfig(backend="xla_dropless", receive_capacity_factor=float(ep))
  y_big, aux_big = _fwd("xla_dropless", data, ep, top_k, cfg_big)(x, p)
  y_free, _ = _fwd("xla_dropless", data, ep, top_k, UniEPConfig(backend="xla_dropless"))(x, p)
  assert int(aux_big["dropped"]) == 0
  chex.assert_trees_all_equal(y_big, y_free)
  # gradients flow through the kept assignments only, deterministically
  g = _loss("xla_dropless", data, ep, top_k, cfg)
  chex.assert_trees_all_equal(g(x, p), g(x, p))


@pytest.mark.parametrize("bound,kernel,overlap,grad", [
    # a receive bound (the XLA glue that drops the tail), tiles walked in bands
    (1.5, uniep_jax.KernelConfig(raster_rows=8, wgrad_raster=2), None, True),
    # only one of the two overlapped launches on: the other half runs as two launches
    (None, None, uniep_jax.OverlapConfig(down_return_ctas=16, wgrad_return_ctas=0,
                                         chunk_rows=256), True),
    (1.5, None, uniep_jax.OverlapConfig(down_return_ctas=0, wgrad_return_ctas=8), True)])
def test_uniep_layer_lowers_for_cuda(bound, kernel, overlap, grad):
  """The whole uniep layer, forward and backward (the NVLink transfers, the Pallas grouped
  GEMMs, the overlapped launches, the XLA glue), lowers for CUDA on this CPU-only
  machine: every kernel gets as far as the Mosaic GPU custom call (they run on GPUs in
  bench/check_moe_gpu.py). 12 kernels without overlap (tests/test_dedup.py); the down
  GEMM with its return is one launch instead of two, the dw_gate_up wgrad with the dX
  return one instead of two. No host-stepped loop between the kernels."""
  cfg = UniEPConfig(backend="uniep", receive_capacity_factor=bound, overlap=overlap,
                    **({} if kernel is None else dict(kernel=kernel)))
  text = lower_uniep_layer_for_cuda(cfg, 256)
  expected = 12 - (overlap is not None and overlap.down_return_ctas > 0) - (
      overlap is not None and overlap.wgrad_return_ctas > 0)
  assert text.count("stablehlo.custom_call @mosaic_gpu") == expected
  assert ("down_gemm_return" in text) == (overlap is not None and overlap.down_return_ctas > 0)
  assert ("wgrad_with_return" in text) == (overlap is not None and overlap.wgrad_return_ctas > 0)
  assert not host_stepped_loops(text)


def lower_uniep_layer_for_cuda(cfg, hidden, grad=True):
  """The StableHLO text of the uniep layer's gradient (or with grad=False its forward;
  mesh data=2, expert=4, bf16, 256 tokens, E=8, F=192, top-2) lowered for CUDA on this
  CPU-only machine."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from pallas_kernels import device as device_lib
  mesh = make_mesh(2, 4)
  axes = ("data", "expert")
  p = make_params(jax.random.key(0), experts=E, hidden=hidden, ffn=192, dtype=jnp.bfloat16)
  specs = uniep_jax.param_specs(p)

  def body(xl, pl):
    y, _ = uniep_jax.moe_ffn_shard(xl, pl, top_k=2, config=cfg, token_axes=axes)
    return y

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P(axes), specs), out_specs=P(axes),
                     check_vma=False)
  loss = lambda x, p: jnp.sum(fn(x, p).astype(jnp.float32) ** 2)  # noqa: E731
  sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s))  # noqa: E731
  x = jax.ShapeDtypeStruct((256, hidden), jnp.bfloat16, sharding=NamedSharding(mesh, P(axes)))
  ps = jax.tree.map(sds, p, specs)
  with device_lib.lowering_for_gpu():
    return jax.jit(jax.grad(loss, argnums=(0, 1)) if grad else fn).trace(x, ps).lower(
        lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("backend", ["xla_dropless", "xla_capacity", "dense_reference"])
def test_nonfinite_tokens_are_counted_and_routed_to_the_first_experts(backend):
  """A token with a NaN (or inf) in x has non-finite logits: it goes to experts 0..K-1
  (every selection score -inf, ties to the lowest index), aux["nonfinite_tokens"] counts
  it, and the other tokens' outputs stay finite."""
  kx, kp = jax.random.split(jax.random.key(91))
  p = make_params(kp, experts=E, hidden=H, ffn=F)
  x = make_x(kx, 64, H).at[5, 3].set(jnp.nan).at[40, 0].set(jnp.inf)
  cfg = _cfg(backend)
  y, aux = _fwd(backend, 1, 1 if backend == "dense_reference" else 4, 3, cfg)(x, p)
  assert int(aux["nonfinite_tokens"]) == 2
  out = uniep_jax.route(x, p.router, 3, cfg.routing, None)
  np.testing.assert_array_equal(np.asarray(out.topk_experts)[[5, 40]], [[0, 1, 2], [0, 1, 2]])
  finite = np.ones(64, bool)
  finite[[5, 40]] = False
  assert np.isfinite(np.asarray(y)[finite]).all()
  _, aux_clean = _fwd(backend, 1, 1 if backend == "dense_reference" else 4, 3, cfg)(
      make_x(kx, 64, H), p)
  assert int(aux_clean["nonfinite_tokens"]) == 0
