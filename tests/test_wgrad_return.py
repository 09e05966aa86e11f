"""CPU tests of the wgrad + dX return launch (pallas_kernels/wgrad_return.py).

What runs here: the wgrad body on a CTA subset (the launch's wgrad role) bitwise equal
to the standalone wgrad (Mosaic GPU interpret mode, race detector on), the argument
checks, and the LOWERING of the whole communicating launch for CUDA (remote refs and
semaphores do not run in interpret mode; the uniep layer with it runs on GPUs in
bench/determinism_sweep.py and bench/moe_layer.py). The plumbing around it in
uniep_jax/overlap.py: tests/test_overlap.py (the launch replaced by its contract,
bitwise against "uniep" without overlap and "pallas").
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels import device as device_lib
from pallas_kernels import grouped_gemm as gg
from pallas_kernels import wgrad_return as wgr
from pallas_kernels.ep_transfer import TransferConfig
from pallas_kernels.grouped_gemm import KernelConfig
from pallas_testlib import INTERPRET, INTERPRET_RACES, assert_no_races, fresh_interpret_state  # noqa: F401


def test_wgrad_body_on_cta_subset_is_bitwise_equal():
  """The wgrad role (tiles on CTAs [offset, offset + count) only, CTA 0 idle as a
  transfer CTA) gives the standalone wgrad's bits: ragged, empty and unaligned groups.
  The role walks each group's 3 k tiles x 2 n tiles in bands of 2 k tiles (a short last
  band), the standalone reference row-major."""
  m, kdim, n = 384, 768, 256
  ks = jax.random.split(jax.random.key(5), 2)
  gs = jnp.array([100, 0, 170, 60], jnp.int32)          # empty group, unaligned ends
  lhs = jax.random.normal(ks[0], (m, kdim)).astype(jnp.bfloat16)
  dout = jax.random.normal(ks[1], (m, n)).astype(jnp.bfloat16)
  cfg = KernelConfig(num_sms=3, max_concurrent_steps=2, wgrad_raster=2)
  ref = gg.gmm_wgrad(lhs, dout, gs, config=dataclasses.replace(cfg, wgrad_raster=1),
                     interpret=INTERPRET)
  params = gg.wgrad_params(m, gs.shape[0], jnp.bfloat16, jnp.bfloat16, cfg)
  assert params["raster_k"] == 2
  offset, count = 1, 2

  def body(bounds_gmem, lhs_gmem, dout_gmem, out_gmem):
    @pl.when(jax.lax.axis_index("sm") >= offset)
    def _():
      gg._wgrad_kernel(bounds_gmem, lhs_gmem, dout_gmem, out_gmem, cta_offset=offset,
                       num_ctas=count, **params)

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((gs.shape[0], kdim, n), jnp.bfloat16),
      grid=(offset + count,), grid_names=("sm",), num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=gg.resolve_interpret(INTERPRET_RACES))
  got = kernel(gg.wgrad_bounds(gs, m), lhs, dout)
  assert_no_races()
  assert float(jnp.max(jnp.abs(ref.astype(jnp.float32)))) > 0
  chex.assert_trees_all_equal(got, ref)


def _lower(mesh, r, *, n_comm, num_sms=8, m=512, h=256, n=128, el=2, ns=256):
  cfg = KernelConfig(num_sms=num_sms, max_concurrent_steps=2)

  def body(lhs, dout, rows, seg_src, seg_dst, seg_len):
    dw, back = wgr.gmm_wgrad_with_return(
        lhs, dout, jnp.full((el,), m // (2 * el), jnp.int32), rows, seg_src[0], seg_dst[0],
        seg_len[0], out_rows=ns, axis_name="expert", config=cfg,
        transfer=TransferConfig(chunk_rows=64), n_comm=n_comm)
    return dw[None], back

  spec = P("expert")
  fn = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 6, out_specs=(spec, spec),
                     check_vma=False)
  sh = NamedSharding(mesh, spec)
  sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
  args = (sds((r * m, h), jnp.bfloat16), sds((r * m, n), jnp.bfloat16),
          sds((r * m, h), jnp.bfloat16), *(sds((r, r, el), jnp.int32),) * 3)
  with device_lib.lowering_for_gpu():
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def test_wgrad_with_return_lowers_for_cuda(mesh_factory):
  """Both roles (the transfer's remote stores and semaphores, the wgrad on a CTA
  subset) lower to one Mosaic GPU custom call for CUDA on this CPU-only machine."""
  r = 4
  text = _lower(mesh_factory(1, r), r, n_comm=3).as_text()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 1


def test_wgrad_with_return_checks_n_comm(mesh_factory):
  with pytest.raises(ValueError, match="n_comm=8 must be in"):
    _lower(mesh_factory(1, 4), 4, n_comm=8)
