"""Tests of the Pallas grouped GEMM (pallas_kernels.grouped_gemm).

On the CPU every kernel runs in Mosaic GPU interpret mode, with the race detector on
for the launches a test checks with `assert_no_races` (`INTERPRET_RACES`,
tests/pallas_testlib.py); shapes are small (each case takes seconds). The oracle is `lax.ragged_dot` with float32 accumulation on
float32 copies of the bf16 inputs; the kernel's bf16 output may then differ from
it by one bf16 rounding (relative 2^-8) plus float32 summation-order noise.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_gemm as gg
from pallas_kernels.grouped_gemm import KernelConfig
from pallas_testlib import INTERPRET, INTERPRET_RACES, ON_GPU, assert_no_races, fresh_interpret_state  # noqa: F401

# Two simulated SMs: every CTA walks several tiles (exercises the persistent loop,
# barrier phase reuse across tiles and the epilogue slot reuse); two stages.
CONFIG = KernelConfig(num_sms=2, max_concurrent_steps=2)
BF16 = jnp.bfloat16
BF16_RTOL = 2.0**-8  # one bf16 rounding of the output


def rand(key, shape, scale=1.0):
  return (jax.random.normal(key, shape, jnp.float32) * scale).astype(BF16)


def f32(x):
  return np.asarray(jnp.asarray(x, jnp.float32))


def assert_bf16_close(out, ref_f32, atol=1e-4):
  """out (bf16) equals the f32 reference up to one bf16 rounding."""
  np.testing.assert_allclose(f32(out), f32(ref_f32), rtol=BF16_RTOL, atol=atol)


# Empty first, middle and last groups; boundaries not aligned to 64; dead rows.
GROUP_SIZES = np.array([0, 37, 0, 90, 61, 0], np.int32)  # sum 188 of M = 256


def test_row_tile_plan_covers_every_row_once():
  m, block_m = 300, 64
  gs = jnp.array([0, 70, 0, 5, 100, 0], jnp.int32)
  plan = np.asarray(gg._row_tile_plan(gs, m, block_m)).reshape(5, -1)
  group, load_row, lo, hi, kind = plan
  owner = np.full(m, -1)
  for t in np.nonzero(kind)[0]:
    assert load_row[t] <= lo[t] < hi[t] <= load_row[t] + block_m
    assert np.all(owner[lo[t]:hi[t]] == -1), "a row is stored twice"
    owner[lo[t]:hi[t]] = group[t] if kind[t] == gg._COMPUTE else 99
  ends = np.cumsum(np.asarray(gs))
  expected = np.concatenate([np.full(int(s), g) for g, s in enumerate(np.asarray(gs))] +
                            [np.full(m - ends[-1], 99)])
  np.testing.assert_array_equal(owner, expected)


def test_forward_ragged_k_n_empty_groups_dead_rows_zero():
  m, k, n = 256, 96, 200  # K and N not multiples of 64
  kx, kw = jax.random.split(jax.random.key(0))
  x = rand(kx, (m, k))
  w = rand(kw, (len(GROUP_SIZES), k, n), k**-0.5)
  gs = jnp.asarray(GROUP_SIZES)
  out = gg.gmm(x, w, gs, config=CONFIG, interpret=INTERPRET_RACES)
  assert_no_races()
  assert out.shape == (m, n) and out.dtype == BF16
  ref = gg.reference_gmm(x.astype(jnp.float32), w.astype(jnp.float32), gs)
  assert_bf16_close(out, ref)
  total = int(GROUP_SIZES.sum())
  np.testing.assert_array_equal(f32(out[total:]), 0.0)  # documented: dead rows are zero


def test_dgrad_ragged_k_n():
  m, k, n = 256, 200, 96
  kd, kw = jax.random.split(jax.random.key(1))
  dout = rand(kd, (m, n))
  w = rand(kw, (len(GROUP_SIZES), k, n), n**-0.5)
  gs = jnp.asarray(GROUP_SIZES)
  out = gg.gmm_dgrad(dout, w, gs, config=CONFIG, interpret=INTERPRET_RACES)
  assert_no_races()
  assert out.shape == (m, k)
  ref = gg.reference_gmm_dgrad(dout.astype(jnp.float32), w.astype(jnp.float32), gs)
  assert_bf16_close(out, ref)
  np.testing.assert_array_equal(f32(out[int(GROUP_SIZES.sum()):]), 0.0)


def test_wgrad_unaligned_groups_empty_groups_zero():
  m, k, n = 256, 96, 200
  kx, kd = jax.random.split(jax.random.key(2))
  x = rand(kx, (m, k))
  dout = rand(kd, (m, n))
  gs = jnp.asarray(GROUP_SIZES)
  out = gg.gmm_wgrad(x, dout, gs, out_dtype=jnp.float32, config=CONFIG, interpret=INTERPRET_RACES)
  assert_no_races()
  assert out.shape == (len(GROUP_SIZES), k, n)
  ref = gg.reference_gmm_wgrad(x.astype(jnp.float32), dout.astype(jnp.float32), gs,
                               out_dtype=jnp.float32)
  np.testing.assert_allclose(f32(out), f32(ref), rtol=1e-5, atol=1e-4)
  for g in np.nonzero(GROUP_SIZES == 0)[0]:
    np.testing.assert_array_equal(f32(out[g]), 0.0)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_pipeline_stages_clamped_to_k_steps_and_smem(stages):
  """A launch's SMEM stages are min(max_concurrent_steps, its k-steps, what fits in
  shared memory beside its epilogue): row-tiled launches of 5 k-steps (K 320) take
  max_concurrent_steps, of 2 (K 128) at most 2, of 1 (K 64) 1; the wgrad takes
  max_concurrent_steps over its row blocks. At max_concurrent_steps 4 the plain
  launch's 4th stage fits beside its epilogue (one buffer per warpgroup), the
  "dswiglu" launch's does not (two epilogue buffers, h and u): it keeps 3."""
  cfg = KernelConfig(num_sms=2, max_concurrent_steps=stages)
  params = lambda k, cfg, mode="plain": gg.row_tiled_params(  # noqa: E731
      256, k, 256, len(GROUP_SIZES), mode=mode, transpose_b=False, out_dtype=BF16,
      in_dtype=BF16, save_hu=False, config=cfg)
  assert params(320, cfg)["stages"] == stages
  assert params(128, cfg)["stages"] == min(stages, 2)
  assert params(64, cfg)["stages"] == 1
  assert gg.wgrad_params(256, 2, BF16, BF16, cfg)["stages"] == stages
  four = KernelConfig(max_concurrent_steps=4)
  assert params(4096, four)["stages"] == 4
  assert params(4096, four, "dswiglu")["stages"] == 3


# Groups holding whole 128-row tiles beside partial ones (group-aligned tiles: the
# expert at row 337 starts its tiles at row 336, so its first tile is partial too); 104
# dead rows. Full tiles take the swizzled epilogue path, partial ones the ladder.
GROUP_SIZES_FULL_TILES = np.array([0, 300, 37, 200, 0, 127], np.int32)  # sum 664 of M = 768


@pytest.mark.parametrize("mode,group_sizes", [("swiglu", GROUP_SIZES), ("dswiglu", GROUP_SIZES),
                                              ("swiglu", GROUP_SIZES_FULL_TILES),
                                              ("dswiglu", GROUP_SIZES_FULL_TILES)])
def test_fused_modes_no_races(mode, group_sizes):
  """The fused variants of the row-tiled kernel against their definition."""
  m = 256 if group_sizes is GROUP_SIZES else 768
  k, n = 128, 128
  ks = jax.random.split(jax.random.key(3), 4)
  gs = jnp.asarray(group_sizes)
  g = len(group_sizes)
  if mode == "swiglu":
    # on w_gate_up [g, k, 2n] = [w_gate | w_up], read at column offsets 0 and n
    x = rand(ks[0], (m, k))
    wgu = rand(ks[1], (g, k, 2 * n), k**-0.5)
    a, h, u = gg._row_tiled_call([x], [wgu, wgu], gs, mode="swiglu", transpose_b=False,
                                 out_dtype=BF16, save_hu=True, config=CONFIG, interpret=INTERPRET_RACES,
                                 b_col_offsets=(0, n))
    assert_no_races()
    assert a.shape == h.shape == u.shape == (m, n)
    xf = x.astype(jnp.float32)
    h_ref = gg.reference_gmm(xf, wgu[:, :, :n].astype(jnp.float32), gs, jnp.float32)
    u_ref = gg.reference_gmm(xf, wgu[:, :, n:].astype(jnp.float32), gs, jnp.float32)
    assert_bf16_close(h, h_ref)
    assert_bf16_close(u, u_ref)
    assert_bf16_close(a, jax.nn.silu(h_ref) * u_ref)
    with pytest.raises(ValueError, match="b_col_offsets"):
      gg._row_tiled_call([x], [wgu, wgu], gs, mode="swiglu", transpose_b=False, out_dtype=BF16,
                         save_hu=True, config=CONFIG, interpret=INTERPRET, b_col_offsets=(0, 64))
  else:
    # dy [m, k] @ w_down^T (w_down [g, n, k] read transposed) -> da, then the SwiGLU
    # derivative with the saved h, u [m, n] into one [m, 2n] buffer [dh | du]; dead
    # rows (past the groups) come back zero
    n = 256                                   # a plain-width launch: CTA tile 2 x 128
    dy, wd = rand(ks[0], (m, k)), rand(ks[1], (g, n, k), k**-0.5)
    total = int(group_sizes.sum())
    h, u = rand(ks[2], (m, n)).at[total:].set(0), rand(ks[3], (m, n)).at[total:].set(0)
    (dhu,) = gg._row_tiled_call([dy], [wd], gs, mode="dswiglu", transpose_b=True,
                                out_dtype=BF16, save_hu=False, config=CONFIG,
                                interpret=INTERPRET_RACES, epi_inputs=(h, u))
    assert_no_races()
    assert dhu.shape == (m, 2 * n)
    dh, du = dhu[:, :n], dhu[:, n:]
    da = gg.reference_gmm_dgrad(dy.astype(jnp.float32), wd.astype(jnp.float32), gs, jnp.float32)
    hf, uf = h.astype(jnp.float32), u.astype(jnp.float32)
    sg = jax.nn.sigmoid(hf)
    assert_bf16_close(dh, da * uf * sg * (1.0 + hf * (1.0 - sg)))
    assert_bf16_close(du, da * hf * sg)
    np.testing.assert_array_equal(f32(dhu[total:]), 0.0)
    with pytest.raises(ValueError, match="epi_inputs"):
      gg._row_tiled_call([dy], [wd], gs, mode="dswiglu", transpose_b=True, out_dtype=BF16,
                         save_hu=False, config=CONFIG, interpret=INTERPRET)


def test_grouped_matmul_gradients():
  m, k, n = 256, 96, 128
  ks = jax.random.split(jax.random.key(4), 3)
  x, w, dy = rand(ks[0], (m, k)), rand(ks[1], (len(GROUP_SIZES), k, n), k**-0.5), rand(ks[2], (m, n))
  gs = jnp.asarray(GROUP_SIZES)
  y, vjp = jax.vjp(lambda a, b: gg.grouped_matmul(a, b, gs, config=CONFIG, interpret=INTERPRET),
                   x, w)
  dx, dw = vjp(dy)
  ref_fn = lambda a, b: gg.reference_gmm(a, b, gs, jnp.float32)
  y_ref, vjp_ref = jax.vjp(ref_fn, x.astype(jnp.float32), w.astype(jnp.float32))
  dx_ref, dw_ref = vjp_ref(dy.astype(jnp.float32))
  assert dx.dtype == x.dtype and dw.dtype == w.dtype
  assert_bf16_close(y, y_ref)
  assert_bf16_close(dx, dx_ref)
  assert_bf16_close(dw, dw_ref, atol=1e-3)


# the block_k window past the live rows (GROUP_SIZES) that zero_dead_rows=False still zeroes
LIVE_ROWS = int(GROUP_SIZES.sum())
WINDOW_END = -(-LIVE_ROWS // CONFIG.block_k) * CONFIG.block_k


def _ffn_operands(seed: int, m: int, h: int = 128, f: int = 96):
  """x [m, h], w_gate_up [G, h, 2f], w_down [G, f, h], a cotangent dy [m, h] and the
  group sizes of a SwiGLU FFN test (F = 96: not a multiple of 64, each half padded)."""
  g = len(GROUP_SIZES)
  ks = jax.random.split(jax.random.key(seed), 5)
  x = rand(ks[0], (m, h))
  w_gate_up = rand(ks[1], (g, h, 2 * f), h**-0.5)
  w_down = rand(ks[3], (g, f, h), f**-0.5)
  return x, w_gate_up, w_down, rand(ks[4], (m, h)), jnp.asarray(GROUP_SIZES)


# the zeroing-mode tests' operands: 196 dead rows of 384 (a dead row tile past the
# block_k window of the rows after the live ones); the cotangent is random on every row
FFN_SEED, FFN_ROWS = 9, 384


@functools.lru_cache(maxsize=None)
def _zeroing_mode_ffn():
  """y and (dx, dw_gate_up, dw_down) of the FFN in its default mode (zero_dead_rows=True)
  on `_ffn_operands(FFN_SEED, FFN_ROWS)`: checked against the reference by
  test_swiglu_ffn_forward_and_gradients and the bits that
  test_swiglu_ffn_skipping_dead_rows_changes_no_live_bit compares with, so its six
  interpreted launches run once per module."""
  x, w_gate_up, w_down, dy, gs = _ffn_operands(FFN_SEED, FFN_ROWS)
  ffn = lambda *a: gg.grouped_swiglu_ffn(*a, gs, config=CONFIG, interpret=INTERPRET)  # noqa
  y, vjp = jax.vjp(ffn, x, w_gate_up, w_down)
  return y, vjp(dy)


def test_swiglu_ffn_forward_and_gradients():
  """The FFN (gate/up, down; backward: [dh | du] in da's "dswiglu" epilogue, dx and the
  two wgrads) against the ragged_dot reference, forward and gradients."""
  x, w_gate_up, w_down, dy, gs = _ffn_operands(FFN_SEED, FFN_ROWS)
  y, grads = _zeroing_mode_ffn()
  # Forward: exactly the documented casts (a rounded to bf16), f32 accumulation.
  y_ref = gg.reference_swiglu_ffn(x, w_gate_up, w_down, gs)
  rel = np.linalg.norm(f32(y) - f32(y_ref)) / np.linalg.norm(f32(y_ref))
  assert rel < 4e-3, rel
  np.testing.assert_array_equal(f32(y[int(GROUP_SIZES.sum()):]), 0.0)
  # Gradients vs jax.grad of the ragged_dot reference in float32. The kernel path
  # rounds h, u (saved) and dh, du (GEMM inputs) to bf16: allow bf16-level error.
  ref = lambda *a: gg.reference_swiglu_ffn(*[v.astype(jnp.float32) for v in a], gs)
  _, vjp_ref = jax.vjp(ref, x, w_gate_up, w_down)
  grads_ref = vjp_ref(dy.astype(jnp.float32))
  f = w_down.shape[1]
  split = lambda g: (g[0], g[1][..., :f], g[1][..., f:], g[2])  # noqa: E731  gate, up apart
  for name, got, want in zip(("dx", "dw_gate", "dw_up", "dw_down"), split(grads),
                             split(grads_ref)):
    assert got.shape == want.shape and got.dtype == BF16, name
    rel = np.linalg.norm(f32(got) - f32(want)) / np.linalg.norm(f32(want))
    assert rel < 1e-2, (name, rel)


def test_swiglu_ffn_skipping_dead_rows_changes_no_live_bit():
  """zero_dead_rows=False (the MoE layer's mode): the kernels skip the dead row
  tiles past a block_k window. Live rows of y and dx and every weight gradient are
  bitwise those of the zeroing mode; the window rows are zero; the cotangent's
  dead rows past the window are never read (NaN there changes nothing)."""
  x, w_gate_up, w_down, dy, gs = _ffn_operands(FFN_SEED, FFN_ROWS)   # 196 dead rows of 384
  total, window_end = LIVE_ROWS, WINDOW_END
  # the cotangent stays random (finite) in the window; the zeroing mode's run has it
  # random on every dead row
  dy_nan = dy.at[window_end:].set(jnp.nan)
  y0, g0 = _zeroing_mode_ffn()
  ffn = lambda *a: gg.grouped_swiglu_ffn(*a, gs, config=CONFIG, interpret=INTERPRET,  # noqa
                                         zero_dead_rows=False)
  y1, vjp = jax.vjp(ffn, x, w_gate_up, w_down)
  g1 = vjp(dy_nan)
  bits = lambda v: np.asarray(v).view(np.uint16)  # noqa: E731
  np.testing.assert_array_equal(bits(y1[:total]), bits(y0[:total]))
  np.testing.assert_array_equal(bits(g1[0][:total]), bits(g0[0][:total]))
  for a, b in zip(g1[1:], g0[1:]):
    np.testing.assert_array_equal(bits(a), bits(b))
  np.testing.assert_array_equal(f32(y1[total:window_end]), 0.0)
  np.testing.assert_array_equal(f32(g1[0][total:window_end]), 0.0)


def test_swiglu_ffn_never_copies_the_weights():
  """With F a multiple of the tiles (every benchmark shape), neither pass copies
  w_gate_up or its gradient: gate/up reads it at two column offsets, dx contracts
  over its 2F columns and the wgrad writes [dw_gate | dw_up] in place. The program
  of the forward and backward holds no concatenate, pad or slice producing a
  weight-sized array (the two-array layout copied 2 x 3.8 GB per layer and step on
  deepseek-like)."""
  f = gg._swiglu_padded_f(1, CONFIG)
  x, w_gate_up, w_down, dy, gs = _ffn_operands(13, 256, h=f, f=f)
  ffn = lambda *a: gg.grouped_swiglu_ffn(  # noqa: E731
      *a, gs, config=CONFIG, interpret=INTERPRET, zero_dead_rows=False)
  grads = jax.jit(lambda *a: jax.vjp(ffn, *a)[1](dy))
  hlo = grads.lower(x, w_gate_up, w_down).as_text()
  g, h = w_gate_up.shape[:2]
  for shape in (f"{g}x{h}x{2 * f}", f"{g}x{h}x{f}"):
    copies = [line for line in hlo.splitlines()
              if f"tensor<{shape}xbf16>" in line.split("->")[-1]
              and any(op in line for op in ("concatenate", "stablehlo.pad", "stablehlo.slice"))]
    assert not copies, copies


def _layer_mode_ffn(cfg, x, w_gate_up, w_down, dy, gs):
  """The FFN's forward and backward as the MoE layer runs it (dead rows skipped, dh and
  du in da's epilogue; the cotangent zero on the dead rows): y and dx over the live
  rows and the weight gradients."""
  dy = dy.at[LIVE_ROWS:].set(0.0)
  ffn = lambda *a: gg.grouped_swiglu_ffn(*a, gs, config=cfg, interpret=INTERPRET,  # noqa
                                         zero_dead_rows=False)
  y, vjp = jax.vjp(ffn, x, w_gate_up, w_down)
  dx, dwgu, dwd = vjp(dy)
  return y[:LIVE_ROWS], dx[:LIVE_ROWS], dwgu, dwd


@functools.lru_cache(maxsize=None)
def _knob_operands():
  """The operands of the test that changes KernelConfig's tile orders (raster_rows,
  wgrad_raster) and compares bits with CONFIG: 2 column tiles, each with live columns, in the
  gate/up launch (F = 256, CTA tile 128) and in the down and dx launches (H = 320 padded
  to 512, CTA tile 256)."""
  return _ffn_operands(23, 256, h=320, f=256)


@functools.lru_cache(maxsize=None)
def _knob_reference():
  """`_layer_mode_ffn` with CONFIG (row-major row tiles, wgrad tiles in the auto bands) on
  `_knob_operands`: the tile-order test compares with it."""
  return _layer_mode_ffn(CONFIG, *_knob_operands())


@pytest.mark.parametrize("rows,num_tiles,n_tiles", [(1, 5, 3), (2, 5, 3), (3, 7, 4), (8, 5, 2),
                                                    (4, 8, 112)])
def test_raster_is_a_bijection_in_bands(rows, num_tiles, n_tiles):
  order = [int(gg._raster(jnp.int32(s), num_tiles, n_tiles, rows))
           for s in range(num_tiles * n_tiles)]
  assert sorted(order) == list(range(num_tiles * n_tiles))
  t, nt = np.divmod(np.array(order), n_tiles)
  if rows == 1:
    assert order == list(range(num_tiles * n_tiles))
  # in a band, column tiles outer and the band's row tiles inner
  for s, (ti, ni) in enumerate(zip(t, nt)):
    band = s // (rows * n_tiles)
    height = min(num_tiles - band * rows, rows)
    within = s - band * rows * n_tiles
    assert (ti, ni) == (band * rows + within % height, within // height)


def test_raster_auto_bands_only_launches_whose_weight_leaves_l2():
  """KernelConfig.raster_rows=None: bands of 4 row tiles where a group's weight is >= 96
  MiB (mixtral-like: measured faster than 8), of 8 where it is >= 16 MiB (deepseek-like:
  measured faster than row-major, level with 4), row-major where it stays in L2
  (qwen3-like, small-experts: measured slower in bands)."""
  def raster(k, n, mode="plain", cfg=KernelConfig()):
    return gg.row_tiled_params(1024, k, n, 4, mode=mode, transpose_b=False, out_dtype=BF16,
                               in_dtype=BF16, save_hu=True, config=cfg)["raster_rows"]
  assert raster(4096, 14336, "swiglu") == 4      # mixtral-like gate/up: 235 MB
  assert raster(14336, 4096) == 4                # mixtral-like down: 117 MB
  assert raster(7168, 2048, "swiglu") == 8       # deepseek-like gate/up: 59 MB
  assert raster(2048, 7168) == 8                 # deepseek-like down: 29 MB
  assert raster(2048, 768, "swiglu") == 1        # qwen3-like gate/up: 6.3 MB
  assert raster(512, 1536) == 1                  # small-experts down (F padded): 1.5 MB
  assert raster(2048, 768, "swiglu", KernelConfig(raster_rows=16)) == 16   # explicit


def test_raster_order_changes_no_bit():
  """Two KernelConfig knobs that must not change a bit, in one variant run (each only
  changes the order the persistent CTAs walk the tiles in; a bug in either changes the
  variant's bits):
  - raster_rows=3: tiles walked in bands of 3 row tiles (a short last band) instead of
    row-major.
  - wgrad_raster=1: the wgrads' tiles walked row-major (one k tile's n tiles after
    another) instead of CONFIG's auto bands of 4 k tiles (here: every k tile of a group
    in one band, n tiles outer; dw_gate_up has 2 k tiles x 4 n tiles).
  The FFN's forward and backward in the MoE layer's mode and a plain forward give the
  same bits as CONFIG (row-major row tiles, banded wgrad tiles)."""
  import dataclasses
  operands = _knob_operands()   # 2 column tiles
  x, _, w_down, _, gs = operands
  plain = lambda cfg: gg.gmm(x, w_down.swapaxes(1, 2), gs, config=cfg, interpret=INTERPRET_RACES)  # noqa: E731

  reference = _knob_reference() + (plain(CONFIG),)
  variant_config = dataclasses.replace(CONFIG, raster_rows=3, wgrad_raster=1)
  variant = _layer_mode_ffn(variant_config, *operands) + (plain(variant_config),)
  assert_no_races()
  chex.assert_trees_all_equal(variant, reference)
  with pytest.raises(ValueError, match="raster_rows=0 must be >= 1"):
    KernelConfig(raster_rows=0)
  with pytest.raises(ValueError, match="wgrad_raster=0 must be >= 1"):
    KernelConfig(wgrad_raster=0)
  assert gg.wgrad_params(256, 2, BF16, BF16, CONFIG)["raster_k"] == gg.WGRAD_RASTER_AUTO
  assert gg.wgrad_params(256, 2, BF16, BF16, variant_config)["raster_k"] == 1


@pytest.mark.parametrize("m,block_m,seed", [(300 + 84, 64, 0), (1024, 128, 1), (2048, 128, 2)])
def test_row_tile_plan_group_aligned_tiles(m, block_m, seed):
  """`_row_tile_plan`: every row once (live rows by their group's tiles, dead rows by
  ZERO tiles), within the static length; a live tile's rows are one group's, its load
  box [load_row, + block_m) lies inside [0, m) and holds them, load_row is a multiple
  of 8 and at most 7 rows before its group (or clamped to m - block_m); each group has
  cdiv(rows + start % 8, block_m) tiles, so only its last can be partial: fewer tiles
  than block-aligned row blocks (which compute a block straddling a group boundary
  once per group in it) wherever boundaries are unaligned."""
  rng = np.random.default_rng(seed)
  g = 24
  sizes = rng.multinomial(m - 37, np.full(g, 1.0 / g)).astype(np.int32)
  sizes[[3, 11]] = 0                                    # empty groups; the rest stays dead
  gs = jnp.asarray(sizes)
  nt = gg.num_row_tiles(m, g, block_m)
  plan = np.asarray(gg._row_tile_plan(gs, m, block_m)).reshape(5, -1)
  assert plan.shape[1] == nt
  group, load_row, lo, hi, kind = plan
  owner = np.full(m, -1)
  starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
  for t in np.nonzero(kind)[0]:
    assert 0 <= load_row[t] <= lo[t] < hi[t] <= load_row[t] + block_m <= m
    assert load_row[t] % 8 == 0
    assert np.all(owner[lo[t]:hi[t]] == -1), "a row is stored twice"
    owner[lo[t]:hi[t]] = group[t] if kind[t] == gg._COMPUTE else 99
    if kind[t] == gg._COMPUTE:
      first = starts[group[t]] // 8 * 8
      assert load_row[t] == min(first + (lo[t] - first) // block_m * block_m, m - block_m)
  expected = np.concatenate([np.full(int(n), gi) for gi, n in enumerate(sizes)]
                            + [np.full(m - sizes.sum(), 99)])
  np.testing.assert_array_equal(owner, expected)
  tiles = np.bincount(group[kind == gg._COMPUTE], minlength=g)
  np.testing.assert_array_equal(tiles, -(-(sizes + starts % 8) // block_m) * (sizes > 0))
  # fewer MMA tiles than block-aligned row blocks: a group's blocks are
  # [start // block_m, cdiv(end, block_m))
  ends = starts + sizes
  block_aligned = np.sum((-(-ends // block_m) - starts // block_m) * (sizes > 0))
  assert np.sum(kind == gg._COMPUTE) < block_aligned


def test_group_sizes_past_m_are_clipped():
  """Sizes summing past M: the groups are clipped in order (a group past M is empty, no
  two groups share a row) and the plan fits its static length. (Before, starts were
  computed from the clipped ends, so [100, 100] over 128 rows gave group 1 rows 28..127.)"""
  m, block_m = 128, 64
  for sizes in ([100, 100], [128] * 5, [30, 200, 7]):
    gs = jnp.asarray(sizes, jnp.int32)
    starts, ends = (np.asarray(a) for a in gg._group_bounds(gs, m))
    want_ends = np.minimum(np.cumsum(sizes), m)
    np.testing.assert_array_equal(ends, want_ends)
    np.testing.assert_array_equal(starts, np.minimum(np.cumsum(sizes) - sizes, m))
    plan = np.asarray(gg._row_tile_plan(gs, m, block_m))
    group, _, lo, hi, kind = plan.reshape(5, -1)
    owner = np.full(m, -1)
    for t in np.nonzero(kind == gg._COMPUTE)[0]:
      assert np.all(owner[lo[t]:hi[t]] == -1)
      owner[lo[t]:hi[t]] = group[t]
    want = np.concatenate([np.full(int(e - st), gi) for gi, (st, e) in enumerate(zip(starts, ends))])
    np.testing.assert_array_equal(owner[:len(want)], want)


def test_row_tile_load_clamp_changes_no_bit():
  """A tile whose block_m rows would run past M loads from M - block_m (its rows further
  down the stage): its rows get the bits of the same rows in a launch where their tile
  is not clamped. Group 2 starts at row 150 -> tile from 144, clamped to 128 (M 256,
  block_m 128); alone from row 0 of a 128-row launch, its tile loads from row 0."""
  m, k, n = 256, 64, 256
  kx, kw = jax.random.split(jax.random.key(41))
  x = rand(kx, (m, k))
  w = rand(kw, (3, k, n), k**-0.5)
  gs = jnp.array([100, 50, 90], jnp.int32)
  alone = jnp.array([0, 0, 90], jnp.int32)

  def group_2_loads(sizes, rows):
    group, load_row, _, _, kind = np.asarray(gg._row_tile_plan(sizes, rows, 128)).reshape(5, -1)
    return load_row[(kind == gg._COMPUTE) & (group == 2)]

  np.testing.assert_array_equal(group_2_loads(gs, m), [128])     # the clamped load
  np.testing.assert_array_equal(group_2_loads(alone, 128), [0])  # not clamped
  run = lambda a, sizes: gg.gmm(a, w, sizes, config=CONFIG, interpret=INTERPRET)  # noqa: E731
  whole = run(x, gs)
  assert_bf16_close(whole, gg.reference_gmm(x.astype(jnp.float32), w.astype(jnp.float32), gs))
  chex.assert_trees_all_equal(whole[150:240], run(x[150:240], alone)[:90])


def test_row_split_invariance_bitwise():
  """The same rows give the same bits whether launched together or split."""
  m, k, n = 256, 128, 128
  kx, kw = jax.random.split(jax.random.key(6))
  x = rand(kx, (m, k))
  w = rand(kw, (2, k, n), k**-0.5)
  run = functools.partial(gg.gmm, config=CONFIG, interpret=INTERPRET)
  whole = run(x, w, jnp.array([100, 156], jnp.int32))
  first = run(x[:128], w, jnp.array([100, 28], jnp.int32))
  second = run(x[128:], w, jnp.array([0, 128], jnp.int32))
  chex.assert_trees_all_equal(whole, jnp.concatenate([first, second]))
  # A row in another position of its tile (shifted by 37 rows) is still bitwise equal.
  shifted = run(jnp.concatenate([x[:37], x]), w, jnp.array([137, 156], jnp.int32))
  chex.assert_trees_all_equal(whole, shifted[37:])


def test_deterministic_under_jit():
  m, k, n = 256, 128, 128
  kx, kw = jax.random.split(jax.random.key(7))
  x = rand(kx, (m, k))
  w = rand(kw, (len(GROUP_SIZES), k, n), k**-0.5)
  gs = jnp.asarray(GROUP_SIZES)
  f = jax.jit(lambda a, b, s: gg.gmm_wgrad(a, b, s, config=CONFIG, interpret=INTERPRET))
  outs = [f(x, x[:, :n], gs) for _ in range(3)]
  chex.assert_trees_all_equal(outs[0], outs[1])
  chex.assert_trees_all_equal(outs[0], outs[2])


def test_no_python_unrolling_over_groups():
  """The traced program does not grow with G (256 groups traces like 4)."""
  m, k, n = 256, 64, 128
  x = jnp.zeros((m, k), BF16)

  def size(g):
    w = jnp.zeros((g, k, n), BF16)
    gs = jnp.zeros((g,), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda a, b, s: gg.gmm(a, b, s, config=CONFIG,
                                                  interpret=INTERPRET))(x, w, gs)
    return len(str(jaxpr))

  small, large = size(4), size(256)
  assert large < 1.05 * small, (small, large)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_gpu_medium_shapes():
  m, k, n, g = 4096, 1536, 480, 16
  ks = jax.random.split(jax.random.key(8), 3)
  x, w, d = rand(ks[0], (m, k)), rand(ks[1], (g, k, n), k**-0.5), rand(ks[2], (m, n))
  gs = jnp.asarray(np.random.default_rng(0).multinomial(m - 100, np.ones(g) / g).astype(np.int32))
  cfg = KernelConfig()
  assert_bf16_close(gg.gmm(x, w, gs, config=cfg),
                    gg.reference_gmm(x.astype(jnp.float32), w.astype(jnp.float32), gs), atol=1e-3)
  assert_bf16_close(gg.gmm_dgrad(d, w, gs, config=cfg),
                    gg.reference_gmm_dgrad(d.astype(jnp.float32), w.astype(jnp.float32), gs),
                    atol=1e-3)
