"""The shared backend suite: every EP backend against `dense_reference`.

float32 inputs: tight tolerance; bfloat16: the tolerance of bf16 rounding of the
activations and outputs. Gradients of x and every parameter too.
"""

import dataclasses
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
  cap = uniep_jax.moe.receive_rows(tps, top_k, ep, cfg)
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


def _simulated_transfer(src, seg_src, seg_dst, seg_len, *, out_rows, config, axis_name,
                        rank=0, src_index=None, interpret=None, garbage=1e4):
  """What pallas_kernels.ep_transfer.transfer_segments does, in plain JAX: row p's
  segments of `src` (of src[src_index] when given) land in rank p's output; rows no
  segment covers hold garbage (by default a large finite value: the real kernel leaves
  them unwritten)."""
  if src_index is not None:
    src = jnp.take(src, src_index, axis=0)
  r, el = seg_len.shape
  ns, h = src.shape
  i = jnp.arange(ns, dtype=jnp.int32)
  ends = jnp.cumsum(seg_len, axis=1)                                  # [R, El]

  def rows_for(p):
    seg = jnp.searchsorted(ends[p], i, side="right")
    valid = seg < el
    seg = jnp.minimum(seg, el - 1)
    within = i - (ends[p] - seg_len[p])[seg]
    src_row = jnp.clip(seg_src[p][seg] + within, 0, ns - 1)
    dst_row = jnp.where(valid, seg_dst[p][seg] + within, out_rows)   # out of range: dropped
    return jnp.where(valid[:, None], src[src_row], 0), dst_row

  bufs, dsts = jax.vmap(rows_for)(jnp.arange(r))                      # [R, ns, H], [R, ns]
  got = jax.lax.all_to_all(bufs, axis_name, 0, 0, tiled=True).reshape(r * ns, h)
  got_dst = jax.lax.all_to_all(dsts, axis_name, 0, 0, tiled=True).reshape(r * ns)
  out = jnp.full((out_rows, h), garbage, src.dtype)
  return out.at[got_dst].set(got, mode="drop")


@pytest.mark.parametrize("bound", [None, 1.0])
def test_nvlink_plumbing_equals_padded_bitwise(monkeypatch, bound):
  """The uniep transport's XLA side (segment tables, the zeroed window, the receive
  bound, the custom VJP pair) with the kernel replaced by `_simulated_transfer`:
  outputs and gradients equal the padded transport's bit for bit."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  import pallas_kernels.ep_transfer as ep
  monkeypatch.setattr(ep, "transfer_segments", _simulated_transfer)
  mesh = make_mesh(2, 4)
  axes = ("data", "expert")
  kx, kp = jax.random.split(jax.random.key(71))
  bias = jnp.zeros(E).at[3].set(100.0)                 # a hot expert: overflows the bound
  p = make_params(kp, experts=E, hidden=H, ffn=F, bias=bias)
  x = make_x(kx, 128, H)
  specs = uniep_jax.param_specs(p)
  x = jax.device_put(x, NamedSharding(mesh, P(axes)))
  p = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), p, specs)
  cfg = UniEPConfig(backend="xla_dropless", receive_capacity_factor=bound)

  def run(transport):
    def body(xl, pl):
      y, aux = uniep_jax.moe_ffn_shard(xl, pl, top_k=2, config=cfg, token_axes=axes,
                                       transport=transport)
      return y, aux["dropped"]

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(axes), specs), out_specs=(P(axes), P()),
                       check_vma=False)
    loss = lambda x, p: jnp.sum(jnp.sin(fn(x, p)[0]))  # noqa: E731
    return jax.jit(fn)(x, p), jax.jit(jax.grad(loss, argnums=(0, 1)))(x, p)

  (y_n, dropped_n), g_n = run("nvlink")
  (y_p, dropped_p), g_p = run("padded")
  assert int(dropped_n) == int(dropped_p) and (int(dropped_p) > 0) == (bound is not None)
  chex.assert_trees_all_equal(y_n, y_p)
  chex.assert_trees_all_equal(g_n, g_p)


@pytest.mark.parametrize("bound,fused,kernel,dedup,grad", [
    # v1's dispatch (dedup_tokens=False) with a receive bound (the XLA glue), tiles
    # walked in bands (the kernels' tile order) and cut at block_m-aligned row blocks
    # (group_aligned_tiles=False; the other cases lower the default, each expert's
    # tiles from its first row): independent, so one lowering covers all four. The default config (de-duplicated: v1's 10 kernels, the same kernel configs,
    # plus the owner's live-rows copy per dispatch) lowers in tests/test_dedup.py
    (1.5, None, uniep_jax.KernelConfig(raster_rows=8, group_aligned_tiles=False), False, True),
    # Kernels A and B; the forward only: its backward is v1's (the default's lowering
    # has those kernels), and each Mosaic GPU kernel costs ~1.7 CPU-s to lower
    (None, uniep_jax.FusedConfig(n_comm=16, recv_chunk_rows=256), None, False, False),
    # Kernel A, v1's down GEMM and return; the fused backward (dy dispatch + da in one launch)
    (None, uniep_jax.FusedConfig(n_comm=16, recv_chunk_rows=256, return_in_kernel=False,
                                 backward=True), None, False, True),
    # the forward's dispatch de-duplicated (v1's transfer reading the unique send rows by
    # index, TransferConfig.gather_rows, the live-rows copy, v1's gate/up
    # launch instead of Kernel A) + Kernel C + the dX return beside the wgrad + the
    # de-duplicated dy dispatch. Kernel A with de-duplication (fac_rbw_dd) is not a case of
    # its own: its forward kernels are Kernel A (the cases above) and this case's Kernel C,
    # its backward this case's. Nor the return beside the wgrad without Kernel C and
    # de-duplication: its kernels are this case's wgrad launch and, forward, the case above's
    (None, uniep_jax.FusedConfig(n_comm=16, recv_chunk_rows=256, return_in_kernel=False,
                                 down_return_ctas=16, wgrad_return_ctas=16,
                                 dispatch_in_kernel=False), None, True, True),
    # its forward with block-aligned row tiles (the case above has the default,
    # group-aligned ones: Kernel C's tiles signal the one or two chunks their rows touch)
    (None, uniep_jax.FusedConfig(n_comm=16, recv_chunk_rows=256, return_in_kernel=False,
                                 down_return_ctas=16, wgrad_return_ctas=16,
                                 dispatch_in_kernel=False),
     uniep_jax.KernelConfig(group_aligned_tiles=False), True, False),
    # Kernel D both ways: the de-duplicated dispatch, its expansion and the gate/up (da)
    # GEMM in one launch each (dedup_send_groups 2 of the 2 local experts)
    (None, uniep_jax.FusedConfig(n_comm=16, recv_chunk_rows=256, return_in_kernel=False,
                                 down_return_ctas=16, wgrad_return_ctas=16,
                                 dispatch_in_kernel=False, overlap_copy_ctas=16,
                                 overlap_copy_ctas_bwd=32), None, True, True)])
def test_uniep_layer_lowers_for_cuda(bound, fused, kernel, dedup, grad):
  """The whole uniep layer, forward and backward (NVLink transfers, the Pallas
  grouped GEMMs, the XLA glue), lowers for CUDA on this CPU-only machine: every
  kernel gets as far as the Mosaic GPU custom call (it runs on GPUs in
  bench/check_moe_gpu.py)."""
  hidden = 128 if fused is None else 256   # Kernel B: H a multiple of 2 * block_n
  overlap = fused is not None and fused.overlap_copy_ctas > 0
  cfg = UniEPConfig(backend="uniep", receive_capacity_factor=bound, fused=fused, kernel=kernel,
                    dedup_tokens=dedup, dedup_send_groups=2 if overlap else 1)
  text = lower_uniep_layer_for_cuda(cfg, hidden, grad=grad)
  # v1: 2 transfers forward + 2 backward, and the grouped GEMM kernels of both passes
  # (10 Mosaic GPU custom calls: forward gate/up, down; backward da, dx and 2 wgrads), and
  # without de-duplication the live-rows copy that gathers x's rows into sorted order;
  # fused: Kernels A and B forward (or A, v1's down GEMM and return), then v1's backward
  # (2 transfers + 4 GEMM kernels) or the fused one (dy dispatch + da in one launch, dx,
  # 2 wgrads, the return; with wgrad_return_ctas the return rides in the dw_gate_up launch);
  # dedup with fused: the dy dispatch sends its unique send rows (read by index in the
  # transfer; with gather_rows=False first gathered into a send buffer, one launch more),
  # then the owner's weighted live-rows copy (+1); without Kernel A
  # (dispatch_in_kernel=False): the unique send rows' transfer, the live-rows copy and
  # v1's gate/up launch in its place (+3 with the send buffer's gather); Kernel D: those
  # three launches as one, forward and backward (the dy transfer, weighted copy and da)
  send_buffer = 0 if cfg.transfer.gather_rows else 1
  if fused is None:   # v1's dispatch gathers x's rows into sorted order by the live-rows copy
    expected = 10 + (0 if cfg.use_dedup_tokens else 1)
  else:
    forward = ((1 if fused.dispatch_in_kernel else 3 + send_buffer)
               + (1 if fused.return_in_kernel or fused.down_return_ctas else 2))
    backward = ((5 if fused.backward else 6) - (1 if fused.wgrad_return_ctas else 0)
                + (1 + send_buffer if dedup else 0))
    if overlap:
      forward, backward = forward - 2, backward - 2
    expected = forward + (backward if grad else 0)
  assert text.count("stablehlo.custom_call @mosaic_gpu") == expected
  # the dy rows' weighted copy (inside Kernel D's backward launch with overlap)
  assert ("gather_live_rows_scaled" in text) == (dedup and grad and not overlap)
  assert ("dedup_dispatch_dswiglu" in text) == (overlap and grad)
  # no host-stepped loop between the kernels (XLA:GPU drives a while loop from the host;
  # ragged.SEARCH_METHOD)
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


def _simulated_fused_dispatch_gate_up(rows_sorted, seg_src, seg_dst, seg_len, group_sizes,
                                      w_gate_up, *, out_rows, axis_name, kernel, transfer,
                                      fused, zero_window=None, live_rows=None):
  """Kernel A's contract in plain JAX + the grouped GEMM's swiglu body: recv rows no
  segment covers hold garbage, as in the kernel."""
  from pallas_kernels import grouped_gemm as gg
  recv = _simulated_transfer(rows_sorted, seg_src, seg_dst, seg_len, out_rows=out_rows,
                             config=transfer, axis_name=axis_name)
  m_p = gg._round_up(out_rows, kernel.block_m)
  recv = jnp.pad(recv, ((0, m_p - out_rows), (0, 0)), constant_values=1e4)
  a, h, u = gg.gate_up_projection(recv, w_gate_up, group_sizes, config=kernel,
                                  zero_window=zero_window)
  return recv, a, h, u


def _simulated_fused_dispatch_dswiglu(dy_sorted, seg_src, seg_dst, seg_len, group_sizes, w_down,
                                      h, u, *, out_rows, axis_name, kernel, transfer, fused,
                                      zero_window=None, live_rows=None):
  """The backward twin's contract: dy pushed as the dispatch pushes rows, then the
  grouped GEMM's "dswiglu" launch on it. Rows no segment lands in hold NaN (unwritten
  memory may hold any bits): what reads them must not let them through (the dswiglu
  tiles store only their groups' rows; the wrapper zeroes the window the wgrad reads)."""
  from pallas_kernels import grouped_gemm as gg
  dy_recv = _simulated_transfer(dy_sorted, seg_src, seg_dst, seg_len, out_rows=out_rows,
                                config=transfer, axis_name=axis_name, garbage=jnp.nan)
  m_p, f_p = h.shape
  dy_recv = jnp.pad(dy_recv, ((0, m_p - out_rows), (0, 0)), constant_values=jnp.nan)
  (dhu,) = gg._row_tiled_call([dy_recv], [gg._pad_axis(w_down, 1, f_p)], group_sizes,
                              mode="dswiglu", transpose_b=True, out_dtype=dy_sorted.dtype,
                              save_hu=False, config=kernel, interpret=None, epi_inputs=(h, u),
                              zero_window=zero_window)
  return dy_recv, dhu


def _simulated_dedup_recv(x, dplan, index, live, *, out_rows, m_p, scale=None, garbage):
  """Kernel D's data movement in plain JAX (EP 1: the only owner is this rank): the
  unique rows x[unique_tokens] packed, receive row p = unique[index[p]] (weighted as
  `dedup._scale_rows`) for p < live, garbage after."""
  unique = jnp.take(x, dplan.unique_tokens, axis=0)
  rows = jnp.take(unique, index, axis=0)
  if scale is not None:
    rows = (rows.astype(jnp.float32) * scale[:, None]).astype(rows.dtype)
  rows = jnp.where((jnp.arange(out_rows) < live)[:, None], rows, garbage).astype(x.dtype)
  return jnp.pad(rows, ((0, m_p - out_rows), (0, 0)), constant_values=garbage)


def _simulated_dedup_dispatch_gate_up(x, dplan, index, live, group_sizes, w_gate_up, *,
                                      out_rows, axis_name, kernel, fused, n_copy,
                                      zero_window=None):
  """Kernel D's forward contract: the receive layout (rows >= live garbage) and the
  grouped GEMM's swiglu body on it."""
  from pallas_kernels import grouped_gemm as gg
  recv = _simulated_dedup_recv(x, dplan, index, live, out_rows=out_rows,
                               m_p=gg._round_up(out_rows, kernel.block_m), garbage=1e4)
  a, h, u = gg.gate_up_projection(recv, w_gate_up, group_sizes, config=kernel,
                                  zero_window=zero_window)
  return recv, a, h, u


def _simulated_dedup_dispatch_dswiglu(dy, dplan, index, scale, live, group_sizes, w_down, h, u,
                                      *, out_rows, axis_name, kernel, fused, n_copy,
                                      zero_window=None):
  """Kernel D's backward contract: the weighted receive layout (rows >= live NaN) and
  the grouped GEMM's "dswiglu" launch on it."""
  from pallas_kernels import grouped_gemm as gg
  m_p, f_p = h.shape
  dy_recv = _simulated_dedup_recv(dy, dplan, index, live, out_rows=out_rows, m_p=m_p,
                                  scale=scale, garbage=jnp.nan)
  (dhu,) = gg._row_tiled_call([dy_recv], [gg._pad_axis(w_down, 1, f_p)], group_sizes,
                              mode="dswiglu", transpose_b=True, out_dtype=dy.dtype,
                              save_hu=False, config=kernel, interpret=None, epi_inputs=(h, u),
                              zero_window=zero_window)
  return dy_recv, dhu


def _simulated_fused_gemm_return(a, w_down, seg_src, seg_dst, seg_len, *, out_rows, axis_name,
                                 kernel):
  """Kernel B's contract: v1's down-GEMM tiles, each row stored where the return puts it."""
  from pallas_kernels import grouped_gemm as gg
  y = gg.down_projection(a, w_down, jnp.sum(seg_len, axis=0), config=kernel)
  return _simulated_transfer(y[:, :w_down.shape[2]], seg_src, seg_dst, seg_len,
                             out_rows=out_rows, config=None, axis_name=axis_name)


def _simulated_wgrad_with_return(lhs, dout, group_sizes, rows, seg_src, seg_dst, seg_len, *,
                                 out_rows, axis_name, out_dtype=None, config, transfer, n_comm):
  """The wgrad + return launch's contract: the standalone wgrad and v1's return."""
  from pallas_kernels import grouped_gemm as gg
  dw = gg.gmm_wgrad(lhs, dout, group_sizes, out_dtype=out_dtype, config=config)
  return dw, _simulated_transfer(rows, seg_src, seg_dst, seg_len, out_rows=out_rows,
                                 config=transfer, axis_name=axis_name, garbage=jnp.nan)


def _simulated_down_gemm_return(a, w_down, group_sizes, seg_src, seg_dst, seg_len, *,
                                out_rows, live_rows, axis_name, kernel, transfer, chunk_rows,
                                n_comm, zero_window=None):
  """Kernel C's contract: v1's down GEMM, then v1's return of its rows."""
  from pallas_kernels import grouped_gemm as gg
  y = gg.down_projection(a, w_down, group_sizes, config=kernel, zero_window=zero_window)
  return y, _simulated_transfer(y[:, :w_down.shape[2]], seg_src, seg_dst, seg_len,
                                out_rows=out_rows, config=transfer, axis_name=axis_name,
                                garbage=jnp.nan)


_FUSED_PLUMBING_V1 = {}   # v1's outputs and gradients on the plumbing test's inputs


# Kernels A and B with v1's backward (fused._fused_ffn_bwd's plain dy dispatch); Kernel A,
# v1's down GEMM and return, the fused backward; without Kernel A (the forward's dispatch
# de-duplicated: the unique transfer, the live-rows copy, v1's gate/up launch), Kernel C
# (the down GEMM with the chunked return beside it), the de-duplicated dy dispatch (the
# combine inside the fused VJP, fused.fused_expert_ffn_combine, the weighted live-rows
# gather run in the interpret mode), the dX return beside the dw_gate_up wgrad. Kernel A
# with the de-duplicated dy dispatch is not a case of its own: it differs from the third
# only in the forward's first launch (the first case's) and in taking the sorted rows.
# (The fused backward WITH the return beside the wgrad is not a separate case either:
# `_fused_ffn_bwd` picks dhu's source and the tail independently, and each branch is
# covered; one interpret-mode case costs 1-2 min.)
@pytest.mark.parametrize("variant", [
    {}, dict(return_in_kernel=False, backward=True),
    dict(return_in_kernel=False, down_return_ctas=1, wgrad_return_ctas=1, dedup_tokens=True,
         dispatch_in_kernel=False),
    # Kernel D both ways (the de-duplicated dispatches inside the gate/up and da launches)
    dict(return_in_kernel=False, down_return_ctas=1, wgrad_return_ctas=1, dedup_tokens=True,
         dispatch_in_kernel=False, overlap_copy_ctas=1, overlap_copy_ctas_bwd=1)])
def test_fused_uniep_plumbing_equals_v1_bitwise(monkeypatch, variant):
  """`UniEPConfig.fused` (uniep_jax/fused.py) with Kernels A and B replaced by their
  contracts (`_simulated_fused_*`) and the v1 transfer by `_simulated_transfer`:
  outputs and gradients equal v1's bit for bit (the XLA side: segment tables, the
  zeroed window of the saved receive buffer, the receive bound, the custom VJP that
  reuses v1's backward kernels, or the fused backward's dy dispatch + da launch). EP = 1:
  the Pallas interpret mode runs one device (so no receive bound can drop;
  `zero_dropped_rows` is v1's, tested above; and the receive layout has no rows past
  the live ones, so the zeroed windows are not exercised here: the GPU sweep's)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  import pallas_kernels.ep_transfer as ep
  import pallas_kernels.fused_dispatch_gemm as fdg
  import pallas_kernels.fused_gemm_return as fgr
  import pallas_kernels.wgrad_return as wgr
  import pallas_kernels.down_gemm_return as dgr
  monkeypatch.setattr(ep, "transfer_segments", _simulated_transfer)
  monkeypatch.setattr(fdg, "fused_dispatch_gate_up", _simulated_fused_dispatch_gate_up)
  monkeypatch.setattr(fgr, "fused_gemm_return", _simulated_fused_gemm_return)
  monkeypatch.setattr(fdg, "fused_dispatch_dswiglu", _simulated_fused_dispatch_dswiglu)
  monkeypatch.setattr(wgr, "gmm_wgrad_with_return", _simulated_wgrad_with_return)
  monkeypatch.setattr(dgr, "down_gemm_return", _simulated_down_gemm_return)
  import pallas_kernels.dedup_dispatch_gemm as ddg
  monkeypatch.setattr(ddg, "dedup_dispatch_gate_up", _simulated_dedup_dispatch_gate_up)
  monkeypatch.setattr(ddg, "dedup_dispatch_dswiglu", _simulated_dedup_dispatch_dswiglu)
  mesh = make_mesh(1, 1)
  axes = ("data", "expert")
  e, h, f, top_k = 4, 64, 48, 2
  kx, kp = jax.random.split(jax.random.key(81))
  p = make_params(kp, experts=e, hidden=h, ffn=f, bias=jnp.zeros(e).at[1].set(3.0))
  specs = uniep_jax.param_specs(p)
  x = jax.device_put(make_x(kx, 24, h), NamedSharding(mesh, P(axes)))
  p = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), p, specs)

  def run(cfg):
    def body(xl, pl):
      y, aux = uniep_jax.moe_ffn_shard(xl, pl, top_k=top_k, config=cfg, token_axes=axes)
      return y, aux["dropped"]

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(axes), specs), out_specs=(P(axes), P()),
                       check_vma=False)

    def loss(x, p):  # one program: the outputs ride along as aux (one interpret-mode forward)
      y, dropped = fn(x, p)
      return jnp.sum(jnp.sin(y)), (y, dropped)

    g, out = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(x, p)
    return out, g

  # 2 CTAs in the persistent grids, not the 132 of an H100 that the interpret mode
  # would simulate (tiles are the same; which CTA runs one does not change its bits).
  # Each CTA is interpreted by its own threads whether it has tiles or not: 8 took ~25
  # CPU-s more over the four runs here (v1 + 3 variants) than 2; with 2, each CTA still
  # walks several tiles, and n_comm (1) < num_sms as on a GPU
  # v1: the plain dispatch (uniep's default de-duplicates; its nvlink plumbing is
  # tests/test_dedup.py's)
  v1 = UniEPConfig(backend="uniep", kernel=uniep_jax.KernelConfig(num_sms=2), dedup_tokens=False)
  variant = dict(variant)
  dedup = variant.pop("dedup_tokens", False)
  v2 = dataclasses.replace(v1, fused=uniep_jax.FusedConfig(n_comm=1, recv_chunk_rows=128,
                                                           **variant), dedup_tokens=dedup)
  if "v1" not in _FUSED_PLUMBING_V1:   # the same reference for every variant: run it once
    _FUSED_PLUMBING_V1["v1"] = run(v1)
  (y1, d1), g1 = _FUSED_PLUMBING_V1["v1"]
  (y2, d2), g2 = run(v2)
  assert int(d1) == int(d2) == 0
  assert float(jnp.max(jnp.abs(y1))) > 0
  chex.assert_trees_all_equal(y2, y1)
  chex.assert_trees_all_equal(g2, g1)
