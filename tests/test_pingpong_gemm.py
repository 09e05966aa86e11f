"""Tests of the EXPERIMENTAL ping-pong row-tiled GEMM (pallas_kernels/pingpong_gemm.py):
the same bits as grouped_gemm's row-tiled "plain" launch, in the CPU interpret mode with
the race detector (small shapes, several tiles per CTA so both rings, the turns and the
barrier phases wrap), and it lowers for CUDA."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_gemm as gg
from pallas_kernels import pingpong_gemm as pp
from uniep_jax.config import KernelConfig
from pallas_testlib import INTERPRET, INTERPRET_RACES, assert_no_races  # noqa: F401

BF16 = jnp.bfloat16
# whole 128-row tiles beside partial ones, empty groups, dead rows
GROUP_SIZES = np.array([0, 300, 37, 200, 0, 127], np.int32)   # sum 664 of M = 768


def _operands(transpose_b, m=768, k=256, n=256):
  ks = jax.random.split(jax.random.key(5), 2)
  g = len(GROUP_SIZES)
  a = jax.random.normal(ks[0], (m, k), jnp.float32).astype(BF16)
  shape = (g, n, k) if transpose_b else (g, k, n)
  b = (jax.random.normal(ks[1], shape, jnp.float32) * k ** -0.5).astype(BF16)
  return a, b, jnp.asarray(GROUP_SIZES)


@pytest.mark.parametrize("transpose_b,aligned,zero_window", [
    (False, True, None), (True, True, 64), (False, False, None)])
def test_pingpong_equals_row_tiled_bitwise(transpose_b, aligned, zero_window):
  """Two SMs (each walks ~10 tiles: both warpgroups several times), 2 stages (the rings
  wrap within a tile: K = 256 is 4 steps)."""
  config = KernelConfig(num_sms=2, max_concurrent_steps=2, group_aligned_tiles=aligned,
                        raster_rows=3)
  a, b, gs = _operands(transpose_b)
  ref = jax.jit(lambda a, b, s: gg._row_tiled_call(
      [a], [b], s, mode="plain", transpose_b=transpose_b, out_dtype=BF16, save_hu=False,
      config=config, interpret=INTERPRET, zero_window=zero_window)[0])(a, b, gs)
  got = jax.jit(lambda a, b, s: pp.pingpong_gmm(
      a, b, s, transpose_b=transpose_b, config=config, zero_window=zero_window,
      interpret=INTERPRET_RACES))(a, b, gs)
  assert_no_races()
  live = int(GROUP_SIZES.sum())
  if zero_window is None:
    chex.assert_trees_all_equal(got, ref)
  else:   # rows past round_up(live, zero_window) are undefined in both
    end = -(-live // zero_window) * zero_window
    chex.assert_trees_all_equal(got[:end], ref[:end])
  np.testing.assert_array_equal(np.asarray(got[live:live + 8], np.float32), 0.0)


def test_pingpong_stages_fit_and_lowering():
  assert pp._stages(KernelConfig(), 2, 232448) == 3
  with pytest.raises(ValueError, match="padded to the tile grid"):
    pp.pingpong_gmm(jnp.zeros((100, 64), BF16), jnp.zeros((1, 64, 128), BF16),
                    jnp.array([100], jnp.int32), interpret=True)
  s = jax.ShapeDtypeStruct
  for transpose_b in (False, True):
    rhs = (4, 512, 1024) if transpose_b else (4, 1024, 512)
    text = jax.jit(lambda a, b, g, t=transpose_b: pp.pingpong_gmm(
        a, b, g, transpose_b=t, interpret=False)).trace(
        s((4096, 1024), BF16), s(rhs, BF16), s((4,), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
