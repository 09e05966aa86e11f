"""The "pallas" backend on the CPU (Mosaic GPU interpret mode) at EP 1, 2 and 4: forward
and gradients against "xla_dropless" and the float32 `dense_reference`, bit for bit
across EP degrees where the math is the same, and repeatable.

At EP > 1 each device's kernels run alone as one-device programs
(`pallas_kernels.device.kernel`: the interpreter keeps one state for every device it
simulates). "uniep" needs NVLink: its plumbing is checked with the kernels' contracts
(tests/test_dedup.py, tests/test_overlap.py) and on GPUs by bench/check_moe_gpu.py.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import pytest

import uniep_jax
from uniep_jax import KernelConfig, UniEPConfig
from conftest import make_mesh
from moe_testlib import make_params, make_x, rel_err

E, H, F = 4, 64, 128
# 2 simulated SMs: the persistent CTAs each walk several of the launches' tiles, and the
# interpret mode runs fewer threads; which CTA computes a tile does not change its bits
PALLAS = UniEPConfig(backend="pallas", kernel=KernelConfig(num_sms=2))


@functools.lru_cache(maxsize=None)
def _fns(cfg, mesh):
  """The jitted forward and gradient of `cfg` on `mesh`, one pair per (cfg, mesh) in this
  module: each program (the interpreted kernels' most of all) is compiled once, and a
  test that calls a pair after another test has runs the same compiled program again."""
  def fwd(x, p):
    return uniep_jax.moe_ffn(x, p, mesh=mesh, top_k=2, config=cfg)[0]

  def loss(x, p):
    return jnp.sum(fwd(x, p).astype(jnp.float32) * jnp.cos(jnp.arange(H, dtype=jnp.float32)))

  return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1)))


@functools.lru_cache(maxsize=None)
def _inputs():
  """The tests' params and tokens (64 tokens, top-2 of E experts)."""
  p = make_params(jax.random.key(0), experts=E, hidden=H, ffn=F, dtype=jnp.bfloat16)
  x = make_x(jax.random.key(1), 64, H, jnp.bfloat16)
  return p, x


@functools.lru_cache(maxsize=None)
def _first_call(cfg, mesh, which: int):
  """The first call of `_fns(cfg, mesh)[which]` (0: forward, 1: gradients) on `_inputs()`,
  kept for the module: a later test compares with these bits instead of running the
  interpreted kernels once more. Determinism checks call the function again."""
  p, x = _inputs()
  return _fns(cfg, mesh)[which](x, p)


@functools.lru_cache(maxsize=None)
def _second_call(cfg, mesh, which: int):
  """A second call of the same compiled function on the same inputs, compared bit for
  bit with `_first_call` by the determinism checks: both tests check the gradients of
  `PALLAS` this way, and when they run in one process the interpreted kernels run that
  second time once (alone, each test still makes its own second call)."""
  p, x = _inputs()
  return _fns(cfg, mesh)[which](x, p)


def test_pallas_backend_matches_xla_dropless_and_reference():
  mesh = make_mesh(1, 1)
  p, x = _inputs()
  f_xla, g_xla = _fns(UniEPConfig(backend="xla_dropless"), mesh)
  f_ref, g_ref = _fns(UniEPConfig(backend="dense_reference"), None)
  y = _first_call(PALLAS, mesh, 0)
  # Same rows, same math; XLA's ragged_dot and our kernel sum over K in
  # different orders, so they agree to bf16 rounding, not bitwise (the bitwise
  # guarantee is between "pallas" and "uniep", which share the GEMM).
  y_xla = f_xla(x, p)
  assert rel_err(y, y_xla) < 2e-3
  assert float(jnp.mean((y != y_xla).astype(jnp.float32))) < 0.01
  assert rel_err(y, f_ref(x, p)) < 1e-2
  g = _first_call(PALLAS, mesh, 1)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref(x, p))):
    assert rel_err(a, b) < 2e-2
  # determinism: a second call gives the same bits
  chex.assert_trees_all_equal(g, _second_call(PALLAS, mesh, 1))


@functools.lru_cache(maxsize=None)
def _on_host(cfg, ep):
  """Forward and gradients of `cfg` on a (1, ep) mesh, on the host (results of different
  meshes are compared)."""
  mesh = None if cfg.backend == "dense_reference" else make_mesh(1, ep)
  f, g = _fns(cfg, mesh)
  p, x = _inputs()
  return jax.device_get((f(x, p), g(x, p)))


@pytest.mark.parametrize("ep", [2, 4])
def test_pallas_at_ep_2_and_4_matches_the_references(ep):
  """Each device's interpreted kernels run alone (`device.kernel`): the forward and
  every gradient agree with "xla_dropless" on the same mesh and with the float32 oracle
  to bf16 rounding, and equal the same backend at EP 1 bit for bit where the math is the
  same (y, dx and the experts' gradients: the same rows through the same tiles; the
  router's float32 gradient sums the token shards' parts)."""
  y, (dx, dp) = _on_host(PALLAS, ep)
  y_x, (dx_x, dp_x) = _on_host(UniEPConfig(backend="xla_dropless"), ep)
  y_r, (dx_r, dp_r) = _on_host(UniEPConfig(backend="dense_reference"), 1)
  assert rel_err(y, y_x) < 2e-3 and rel_err(y, y_r) < 1e-2
  for a, b, c in zip(jax.tree.leaves((dx, dp)), jax.tree.leaves((dx_x, dp_x)),
                     jax.tree.leaves((dx_r, dp_r))):
    assert rel_err(a, b) < 2e-2 and rel_err(a, c) < 2e-2
  y1, (dx1, dp1) = _on_host(PALLAS, 1)
  chex.assert_trees_all_equal((y, dx, dp.w_gate_up, dp.w_down),
                              (y1, dx1, dp1.w_gate_up, dp1.w_down))
  assert rel_err(dp.router, dp1.router) < 1e-6
  # repeatable: the compiled program run again
  p, x = _inputs()
  chex.assert_trees_all_equal(jax.device_get(_fns(PALLAS, make_mesh(1, ep))[1](x, p)), (dx, dp))
