"""Backend "uniep" with `UniEPConfig.overlap` (uniep_jax/overlap.py): the down GEMM's
return and the backward's dX return inside GEMM launches give the bits of the same
backend without overlap, and of "pallas" over the padded transport: outputs, dropped
counts and every gradient, with and without a receive bound that drops, at EP 2 and 4.

The NVLink transfers, the live-rows copy, the grouped GEMM's launches and the two
overlapped launches are replaced by their contracts in XLA (tests/simulated.py; rows
the kernels leave unwritten hold garbage there), so this checks the layer's plumbing
(segment tables, chunked returns, zeroed windows, dropped rows, the custom VJP) on the
CPU; the kernels are checked on their own (interpret mode) and on GPUs
(bench/check_moe_gpu.py)."""

import chex
import jax.numpy as jnp
import pytest

import simulated
from uniep_jax import OverlapConfig, UniEPConfig

E, H, F = 8, 256, 256   # no padding of H and F at the default tiling


@pytest.mark.parametrize("data,ep,bound,hot", [(1, 4, None, None), (2, 2, 1.0, 3)])
def test_overlap_equals_uniep_and_pallas_bitwise(monkeypatch, data, ep, bound, hot):
  simulated.patch_nvlink(monkeypatch)
  simulated.patch_grouped_gemm(monkeypatch)
  import uniep_jax.moe as moe
  from uniep_jax.experts import swiglu_pallas
  monkeypatch.setattr(moe, "swiglu_pallas", swiglu_pallas)   # the real one: its launches simulated
  bias = None if hot is None else jnp.zeros(E).at[hot].set(100.0)
  run = simulated.layer_runner(91, data=data, ep=ep, experts=E, hidden=H, ffn=F, top_k=2,
                               tokens=128, bias=bias)
  (y_p, d_p), g_p = run(UniEPConfig(backend="pallas", receive_capacity_factor=bound),
                        transport="padded")
  assert (int(d_p) > 0) == (bound is not None)
  assert not bool(jnp.any(jnp.isnan(y_p.astype(jnp.float32))))
  (y_u, d_u), g_u = run(UniEPConfig(backend="uniep", receive_capacity_factor=bound))
  chex.assert_trees_all_equal((y_u, d_u, g_u), (y_p, d_p, g_p))
  for overlap in (OverlapConfig(chunk_rows=128),
                  OverlapConfig(down_return_ctas=4, wgrad_return_ctas=0, chunk_rows=256),
                  OverlapConfig(down_return_ctas=0, wgrad_return_ctas=4)):
    got = run(UniEPConfig(backend="uniep", receive_capacity_factor=bound, overlap=overlap))
    chex.assert_trees_all_equal(got, ((y_p, d_p), g_p))
