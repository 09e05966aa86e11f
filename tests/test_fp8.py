"""FP8: the e4m3 block quantisation (pallas_kernels/fp8.py), the FP8 grouped GEMM in the
Mosaic GPU interpret mode against a float64 oracle of the quantised operands
(pallas_kernels/fp8_gemm.py), and the FP8 SwiGLU FFN with its VJP."""


import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import fp8
from pallas_kernels import fp8_gemm as fg
from pallas_kernels import grouped_gemm as gg
from pallas_kernels.grouped_gemm import KernelConfig
import uniep_jax
from uniep_jax import UniEPConfig
from conftest import make_mesh
from moe_testlib import make_params, make_x, rel_err

CFG = fg.Fp8Config(num_sms=4)


# --- quantisation -------------------------------------------------------------------


def test_round_trip_is_exact_on_representable_values():
  """Values that are e4m3 numbers times the block's power-of-two scale come back bit
  for bit; the scale is the smallest power of two that keeps the block within 448."""
  rng = np.random.default_rng(0)
  grid = np.asarray(jnp.arange(256, dtype=jnp.uint8).view(jnp.float8_e4m3fn)
                    .astype(jnp.float32))
  grid = grid[np.isfinite(grid)]
  q = rng.choice(grid, size=(6, 256)).astype(np.float32)
  q[:, 0] = 448.0                       # every block reaches the top of the range
  q[:, 128] = -448.0
  scale = 2.0 ** rng.integers(-20, 20, size=(6, 2))
  x = (q.reshape(6, 2, 128) * scale[:, :, None]).reshape(6, 256).astype(np.float32)
  xq, s = jax.jit(fp8.quantise_rows)(jnp.asarray(x))
  np.testing.assert_array_equal(np.asarray(s), scale.astype(np.float32))
  np.testing.assert_array_equal(np.asarray(fp8.dequantise_rows(xq, s)), x)


def test_saturation_zero_blocks_and_non_finite():
  x = np.zeros((3, 256), np.float32)
  x[0, :128] = np.linspace(-1000.0, 1000.0, 128)   # amax 1000: scale 4, max 250
  x[0, 5] = 1792.0                                  # 448 * 4: exactly the largest e4m3
  x[2, 130] = np.nan
  xq, s = fp8.quantise_rows(jnp.asarray(x))
  s = np.asarray(s)
  assert s[0, 0] == 4.0 and s[0, 1] == 1.0 and s[1, 0] == 1.0        # zero blocks: scale 1
  assert float(jnp.max(jnp.abs(xq[0].astype(jnp.float32)))) == 448.0   # within range
  assert np.all(np.asarray(xq[1].astype(jnp.float32)) == 0.0)
  assert np.isnan(s[2, 1]) and s[2, 0] == 1.0      # a NaN block's scale is NaN, not hidden
  w = jnp.zeros((2, 200, 130)).at[1, 150, 129].set(-3.0)
  wq, ws = fp8.quantise_blocks(w)
  assert wq.shape == (2, 256, 256) and ws.shape == (2, 2, 2)
  assert float(ws[1, 1, 1]) == 2.0 ** -7 and float(ws[0, 0, 0]) == 1.0
  np.testing.assert_array_equal(np.asarray(fp8.dequantise_blocks(wq, ws))[:, :200, :130],
                                np.asarray(w))


def test_scale_edge_cases():
  """amax exactly 448 * 2^e gives 2^e and the next float above it 2^(e+1); a block too
  small for a normal ratio takes the smallest normal scale 2^-126 (not 1, which would
  quantise it to zeros); inf gives NaN like NaN does."""
  e = np.float32(2.0 ** -20)
  amax = jnp.array([448 * e, np.nextafter(np.float32(448 * e), np.float32(1)), 1e-36, 3e-38,
                    np.inf, 448 * 2.0 ** 100], jnp.float32)
  s = np.asarray(fp8.scale_and_inverse(amax)[0])
  np.testing.assert_array_equal(s[:4], np.float32([e, 2 * e, 2.0 ** -126, 2.0 ** -126]))
  assert np.isnan(s[4]) and s[5] == np.float32(2.0 ** 100)
  xq, xs = fp8.quantise_rows(jnp.full((1, 128), 1e-36, jnp.float32))
  assert float(xq[0, 0].astype(jnp.float32)) * float(xs[0, 0]) == pytest.approx(1e-36, rel=0.07)


def test_k_major_weight_copy_is_the_transpose_bit_for_bit():
  """quantise_blocks(transposed=True) quantises w^T's blocks directly: its copy must be
  swapaxes(q) bit for bit, with K and N not multiples of 128, block scales spread over
  2^-9 .. 2^8 (at least 8 distinct of 18 blocks), an all-zero block and a NaN block."""
  _, w = _operands(5, 8, 300, 200, 3, spread=9)
  w = w.at[1, :128, 128:].set(0.0).at[2, 140, 7].set(jnp.nan)
  q, s, q_t = jax.jit(lambda w: fp8.quantise_blocks(w, transposed=True))(w)
  q1, s1 = fp8.quantise_blocks(w)
  bits = lambda a: np.asarray(a).view(np.uint8)
  np.testing.assert_array_equal(bits(q), bits(q1))
  np.testing.assert_array_equal(np.asarray(s), np.asarray(s1))
  np.testing.assert_array_equal(bits(q_t), bits(jnp.swapaxes(q1, 1, 2)))
  assert float(s[1, 0, 1]) == 1.0 and np.isnan(float(s[2, 1, 0]))
  assert len(np.unique(np.asarray(s)[np.isfinite(np.asarray(s))])) >= 8   # of 18 blocks


def test_scales_are_deterministic_powers_of_two():
  x = jax.random.normal(jax.random.key(3), (64, 384)) * 37.0
  f = jax.jit(fp8.quantise_rows)
  chex.assert_trees_all_equal(f(x), f(x))
  s = np.asarray(f(x)[1])
  mant, _ = np.frexp(s)
  assert np.all(mant == 0.5)
  amax = np.abs(np.asarray(x)).reshape(64, 3, 128).max(-1)
  assert np.all(amax / s <= 448.0) and np.all(amax / s > 224.0)


# --- the FP8 grouped GEMM against the float64 oracle ----------------------------------


def _oracle(x, w, group_sizes, transpose):
  """float64 product of the dequantised operands per group (numpy)."""
  xq, xs = fp8.quantise_rows(x)
  wq, ws = fp8.quantise_blocks(w)
  xd = np.asarray(fp8.dequantise_rows(xq, xs), np.float64)
  wd = np.asarray(fp8.dequantise_blocks(wq, ws), np.float64)
  if transpose:
    wd = np.swapaxes(wd, 1, 2)
  out = np.zeros((x.shape[0], wd.shape[2]))
  start = 0
  for g, n in enumerate(np.asarray(group_sizes)):
    out[start:start + n] = xd[start:start + n, :wd.shape[1]] @ wd[g]
    start += n
  width = w.shape[1] if transpose else w.shape[2]
  return out[:, :width]


def _operands(seed, m, k, n, g, spread: int = 0):
  """x [M, K] and w [G, K, N] bf16; spread > 0 multiplies every row of x and every
  128 x 128 block of w by its own power of two in [2^-spread, 2^spread), so that the
  scales differ from block to block (a layout error then shows)."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((m, k)) * 3.0
  w = rng.standard_normal((g, k, n)) / np.sqrt(k)
  if spread:
    x *= 2.0 ** rng.integers(-spread, spread, (m, 1))
    blocks = 2.0 ** rng.integers(-spread, spread, (g, -(-k // 128), -(-n // 128)))
    w *= np.repeat(np.repeat(blocks, 128, 1), 128, 2)[:, :k, :n]
  return jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)


def _bits(a):
  return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize("m", [192, 256], ids=["rows64", "rows128"])
def test_row_quantisation_kernel_gives_the_bits_of_xla(m):
  """fp8_quantise.quantise_rows_t (Mosaic GPU, interpret mode) against fp8.quantise_rows:
  q and the transposed scales bit for bit, with row scales spread over 2^-9 .. 2^8, a
  zero block, values at the top of a block's range, bf16 and float32 inputs, both row
  tiles (64 and 128 rows)."""
  from pallas_kernels import fp8_quantise
  x, _ = _operands(11, m, 384, 128, 1, spread=9)
  x = x.at[3, 128:256].set(0.0).at[5, 7].set(448.0 * 2.0 ** 8)
  for xi in (x, x.astype(jnp.float32) * 1.0001):
    q, s_t = jax.jit(fp8_quantise.quantise_rows_t)(xi)
    q0, s0 = fp8.quantise_rows(xi)
    np.testing.assert_array_equal(_bits(q), _bits(q0))
    np.testing.assert_array_equal(np.asarray(s_t), np.asarray(s0).T)
  assert float(s_t[1, 3]) == 1.0 and len(np.unique(np.asarray(s_t))) >= 10


def test_weight_quantisation_kernel_gives_the_bits_of_xla():
  """fp8_quantise.quantise_weight_t against fp8.quantise_blocks(transposed=True) and
  fp8.column_scales: q, the K-major copy (made by the identity wgmma) and both scale
  layouts bit for bit; 128 x 128 block scales spread over 2^-9 .. 2^8, an all-zero
  block; bf16 and f16. The one documented difference: the K-major copy holds +0 where
  q holds -0 (it is I @ q^T, and 1 * -0 + 0 = +0), and the FP8 GEMM's result with it
  is the same bit for bit."""
  from pallas_kernels import fp8_quantise
  _, w = _operands(12, 8, 256, 384, 2, spread=9)
  w = w.at[1, :128, 128:256].set(0.0)
  for wi in (w, w.astype(jnp.float16)):
    q, q_t, s_fwd, s_dgrad = jax.jit(fp8_quantise.quantise_weight_t)(wi)
    q0, s0, q0_t = fp8.quantise_blocks(wi, transposed=True)
    np.testing.assert_array_equal(_bits(q), _bits(q0))
    expected = _bits(q0_t).copy()
    negative_zeros = expected == 0x80   # e4m3 -0
    expected[negative_zeros] = 0
    np.testing.assert_array_equal(_bits(q_t), expected)
    np.testing.assert_array_equal(np.asarray(s_fwd), np.asarray(fp8.column_scales(s0, 2)))
    np.testing.assert_array_equal(np.asarray(s_dgrad), np.asarray(fp8.column_scales(s0, 1)))
  assert negative_zeros.any()   # tiny negative values: the case above is exercised
  x, _ = _operands(13, 64, 256, 8, 1)
  xq, xs = fp8.quantise_rows(x)
  gs = jnp.array([40, 24], jnp.int32)
  gmm = jax.jit(lambda b, bs: fg.fp8_gmm(xq, xs, b, bs, gs, config=CFG))
  chex.assert_trees_all_equal(gmm(q_t, s_fwd), gmm(q0_t, fp8.column_scales(s0, 2)))
  assert float(s_fwd[1, 0, 200]) == 1.0 and len(np.unique(np.asarray(s_fwd))) >= 6
  # (a NaN block's scale: the interpreter's max drops NaNs, the GPU's max.NaN keeps
  # them; bench/fp8_quant.py checks it on the device)


def test_quantisation_kernels_refuse_bad_input():
  from pallas_kernels import fp8_quantise
  with pytest.raises(ValueError, match="x.shape"):
    fp8_quantise.quantise_rows_t(jnp.zeros((64, 200), jnp.bfloat16))
  with pytest.raises(ValueError, match="x.dtype"):
    fp8_quantise.quantise_rows_t(jnp.zeros((64, 128), jnp.int8))
  with pytest.raises(ValueError, match="w.dtype"):
    fp8_quantise.quantise_weight_t(jnp.zeros((1, 128, 128), jnp.float32))
  with pytest.raises(ValueError, match="w.shape"):
    fp8_quantise.quantise_weight_t(jnp.zeros((1, 128, 100), jnp.bfloat16))
  # pre-quantised rows that do not match x
  qw = fg.quantise_weight(jnp.zeros((1, 200, 128), jnp.bfloat16))
  x = jnp.zeros((64, 200), jnp.bfloat16)
  good = fp8.quantise_rows(x)
  gs = jnp.array([64], jnp.int32)
  for bad in ((good[0][:, :128], good[1]), (good[0], good[1][:, :1]),
              (good[0].astype(jnp.float32), good[1])):
    with pytest.raises(ValueError, match="x_quantised"):
      fg.gmm_fp8(x, qw, gs, x_quantised=bad)


# the interpret mode's dot is exact float32; Hopper's e4m3 tensor cores accumulate at
# reduced precision (~1.3e-4 relative on an H200: bench/results/grouped_gemm_fp8_*.json)
_INTERPRET_ATOL = 2e-6


@pytest.mark.parametrize("tiles", [(64, 128, 1), (128, 64, 1), (64, 128, 2)],
                         ids=["64x128", "128x64", "64x128-raster2"])
@pytest.mark.parametrize("transpose", [False, True], ids=["fwd", "dgrad"])
def test_fp8_gmm_matches_the_float64_oracle(transpose, tiles):
  """Row and block scales that differ everywhere (2^-8 .. 2^7), K and N not multiples of
  128, more K blocks than pipeline stages, an empty group, a group ending mid-tile,
  dead rows; both tilings, and the tile walk in bands of 2 row tiles.
  Each row's error is judged against that row's own magnitude."""
  m, k, n = 200, 300, 640 if transpose else 520
  sizes = jnp.array([70, 0, 37, 61], jnp.int32)   # 168 live rows of 200
  cfg = fg.Fp8Config(block_m=tiles[0], block_n=tiles[1], raster_rows=tiles[2],
                     max_concurrent_steps=2, num_sms=3)
  if transpose:   # dy [M, N] against w [G, K, N]
    x, w = _operands(0, m, n, k, 4, spread=8)
    w = jnp.swapaxes(w, 1, 2)
  else:
    x, w = _operands(0, m, k, n, 4, spread=8)
  qw = fg.quantise_weight(w)
  out = jax.jit(lambda x, s: fg.gmm_fp8(x, qw, s, transpose=transpose, out_dtype=jnp.float32,
                                        config=cfg))(x, sizes)
  ref = _oracle(x, w, sizes, transpose)
  out = np.asarray(out, np.float64)
  row_scale = np.abs(ref).max(axis=1, keepdims=True)[:168]
  assert np.all(np.abs(out[:168] - ref[:168]) <= _INTERPRET_ATOL * row_scale)
  assert np.all(out[168:] == 0.0)
  # the same check fails for the unquantised product: the oracle sees the quantisation
  bf = np.asarray((gg.reference_gmm_dgrad if transpose else gg.reference_gmm)(
      x, w, sizes, out_dtype=jnp.float32), np.float64)
  assert np.abs(bf - ref)[:168].max() > 100 * _INTERPRET_ATOL * row_scale.max()


def test_fp8_gmm_256_groups_and_row_split_invariance():
  """256 groups (most of them 1-3 rows, some empty); a row's bits do not depend on which
  tile or group cut computes it: the rows of a group split in two (same weights) equal
  the rows computed as one group, bit for bit."""
  rng = np.random.default_rng(1)
  sizes = rng.integers(0, 4, size=256).astype(np.int32)
  m = int(sizes.sum()) + 9
  x, w = _operands(2, m, 128, 128, 256, spread=4)
  qw = fg.quantise_weight(w)
  f = jax.jit(lambda x, q, s: fg.gmm_fp8(x, q, s, out_dtype=jnp.float32, config=CFG))
  out = f(x, qw, jnp.asarray(sizes))
  np.testing.assert_allclose(np.asarray(out, np.float64), _oracle(x, w, sizes, False),
                             rtol=0, atol=_INTERPRET_ATOL * float(jnp.max(jnp.abs(out))))
  # one group of 150 rows, then the same rows as 61 + 89 with the weights repeated
  x2, w2 = _operands(3, 160, 256, 256, 1, spread=4)
  one = f(x2, fg.quantise_weight(w2), jnp.array([150], jnp.int32))
  split = f(x2, fg.quantise_weight(jnp.concatenate([w2, w2])), jnp.array([61, 89], jnp.int32))
  chex.assert_trees_all_equal(one[:150], split[:150])


@pytest.mark.parametrize("k, walks", [
    (512, ((1, 1, 4), (2, 4, 2), (7, 2, 3), (64, 1, 1))),   # 4 K blocks: chained
    (640, ((2, 1, 4), (3, 2, 3), (64, 1, 4)))],              # 5 K blocks: one pipeline per tile
    ids=["chained", "unchained"])
def test_fp8_gmm_bits_do_not_depend_on_the_tile_walk(k, walks):
  """A CTA runs its tiles as one pipeline of pipelines (the next tile's first K blocks
  fetched while a tile is stored) where the stages divide the K blocks (`_stages`),
  else one pipeline per tile: the bits do not depend on how many tiles a CTA gets (one
  CTA: all of them; 64 CTAs: at most one each, a plain pipeline), on the bands or on
  the pipeline's depth. ZERO tiles (the dead rows before the zero window's end) are
  written as zeros; the rows past it are not written at all."""
  m, n = 256, 512
  sizes = jnp.array([70, 0, 37, 61], jnp.int32)   # 168 live rows; window 64: 192 written
  x, w = _operands(4, m, k, n, 4, spread=8)
  qw = fg.quantise_weight(w)
  outs, chained = [], set()
  for num_sms, raster, stages in walks:
    cfg = fg.Fp8Config(num_sms=num_sms, raster_rows=raster, max_concurrent_steps=stages)
    chained.add(fg._stages(cfg, 4, k // 128)[1])
    f = jax.jit(lambda x, s: fg.gmm_fp8(x, qw, s, out_dtype=jnp.float32, config=cfg,
                                        zero_window=64))
    outs.append(f(x, sizes)[:192])
  assert chained == {k == 512}   # the walks the case is named for
  ref = _oracle(x, w, sizes, False)
  row_scale = np.abs(ref).max(axis=1, keepdims=True)[:168]
  assert np.all(np.abs(np.asarray(outs[0], np.float64)[:168] - ref[:168])
                <= _INTERPRET_ATOL * row_scale)
  assert np.all(np.asarray(outs[0])[168:] == 0.0)
  for out in outs[1:]:
    chex.assert_trees_all_equal(out, outs[0])


# --- the FP8 FFN ---------------------------------------------------------------------


def _ffn_inputs():
  """x with a dead tail, weights whose 128 x 128 blocks carry different powers of two."""
  rng = np.random.default_rng(5)
  g, h, f = 4, 128, 192
  x = jnp.asarray(rng.standard_normal((256, h)), jnp.bfloat16)

  def weight(shape, fan_in):
    w = rng.standard_normal(shape) / np.sqrt(fan_in)
    blocks = 2.0 ** rng.integers(-3, 4, (shape[0], -(-shape[1] // 128), -(-shape[2] // 128)))
    return jnp.asarray(w * np.repeat(np.repeat(blocks, 128, 1), 128, 2)[:, :shape[1], :shape[2]],
                       jnp.bfloat16)

  return x, weight((g, h, 2 * f), h), weight((g, f, h), f), jnp.array([50, 0, 120, 60], jnp.int32)


def test_fp8_ffn_matches_the_quantised_reference_and_is_deterministic():
  """Forward and backward against `reference_fp8_swiglu_vjp` (the same quantised math in
  plain JAX): y and dx to float32 accumulation order, the weight gradients to the bf16
  rounding of their outputs; against the bf16 FFN only to FP8's precision (e4m3 keeps 3
  mantissa bits). With zero_dead_rows=False the rows past the window stay unwritten
  and the live rows keep their bits. Every result repeats bit for bit under jit."""
  x, w1, w2, gs = _ffn_inputs()
  live = int(gs.sum())
  dy = jnp.asarray(np.cos(np.arange(256 * 128)).reshape(256, 128), jnp.bfloat16)
  kw = dict(config=CFG, wgrad_config=KernelConfig(num_sms=4))

  def run(zero_dead_rows):
    ffn = lambda x, w1, w2: fg.fp8_grouped_swiglu_ffn(x, w1, w2, gs, zero_dead_rows=zero_dead_rows,
                                                      **kw)
    y, vjp = jax.vjp(ffn, x, w1, w2)
    return (y,) + vjp(dy)

  f = jax.jit(run, static_argnums=0)
  y, dx, dw1, dw2 = f(True)
  y_r, dx_r, dw1_r, dw2_r = fg.reference_fp8_swiglu_vjp(x, w1, w2, gs, dy)
  assert rel_err(y, y_r) < 1e-3 and rel_err(dx, dx_r) < 1e-3
  assert rel_err(dw1, dw1_r) < 5e-3 and rel_err(dw2, dw2_r) < 5e-3
  assert dw1.dtype == w1.dtype and dw2.dtype == w2.dtype and dx.dtype == x.dtype
  assert np.all(np.asarray(y[live:]) == 0) and np.all(np.asarray(dx[live:]) == 0)
  assert 5e-3 < rel_err(y, gg.reference_swiglu_ffn(x, w1, w2, gs)) < 0.1
  chex.assert_trees_all_equal((y, dx, dw1, dw2), f(True))
  # the layer's mode: rows past round_up(live, 64) are never written; the rest is the same
  y2, dx2, dw1_2, dw2_2 = f(False)
  chex.assert_trees_all_equal((y2[:256 - 64], dx2[:256 - 64], dw1_2, dw2_2),
                              (y[:256 - 64], dx[:256 - 64], dw1, dw2))


# --- the layer with precision="fp8" --------------------------------------------------

E, H, F = 4, 128, 128
FP8 = UniEPConfig(backend="pallas", kernel=KernelConfig(num_sms=2), precision="fp8")


@functools.lru_cache(maxsize=None)
def _layer_fn(cfg, ep):
  """jit of the gradients of a loss of y, with (y, aux), in one program."""
  mesh = None if cfg.backend == "dense_reference" else make_mesh(1, ep)

  def loss(x, p):
    y, aux = uniep_jax.moe_ffn(x, p, mesh=mesh, top_k=2, config=cfg)
    return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(H, dtype=jnp.float32))), (y, aux)

  return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))


@functools.lru_cache(maxsize=None)
def _layer(cfg, ep):
  p = make_params(jax.random.key(0), experts=E, hidden=H, ffn=F, dtype=jnp.bfloat16)
  x = make_x(jax.random.key(1), 64, H, jnp.bfloat16)
  return jax.device_get(_layer_fn(cfg, ep)(x, p)), (x, p)


@jax.custom_vjp
def _quantised_values(x):
  """q(x)'s values in x.dtype, x's gradient passed straight through."""
  return fp8.dequantise_rows(*fp8.quantise_rows(x))[:, :x.shape[1]].astype(x.dtype)


_quantised_values.defvjp(lambda x: (_quantised_values(x), None), lambda _, ct: (ct,))


@pytest.mark.parametrize("bound", [None, 40], ids=["unbounded", "receive-bound"])
def test_fp8_dispatch_sends_the_quantised_tokens(bound):
  """dispatch_fp8 (each token quantised once, e4m3 rows and scales sent) delivers, bit
  for bit, the rows the bf16 dispatch delivers of q(x)'s values, each token's own
  e4m3 row and scales, and the gradient of x that passes straight through q (one rank:
  the "local" transport, with and without a receive bound that drops rows)."""
  from uniep_jax import dispatch as dispatch_lib
  from uniep_jax.layout import local_group_sizes, make_plan
  t, k, e, h = 24, 3, 4, 200
  x, _ = _operands(21, t, h, 8, 1, spread=6)
  rng = np.random.default_rng(5)
  topk = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
  plan = make_plan(topk, local_group_sizes(topk, e)[None], 0, recv_rows=bound)
  ct = jax.random.normal(jax.random.key(2), (bound or t * k, h)).astype(x.dtype)

  def fp8_path(x):
    rows, q, s = dispatch_lib.dispatch_fp8(x, plan, "expert", "local")
    return rows, (q, s)

  def bf16_path(x):
    return dispatch_lib.dispatch(_quantised_values(x), plan, axis_name="expert",
                                 transport="local")

  (rows, (q, s)), vjp8 = jax.jit(lambda x: jax.vjp(fp8_path, x, has_aux=False))(x)
  rows16, vjp16 = jax.jit(lambda x: jax.vjp(bf16_path, x))(x)
  chex.assert_trees_all_equal(rows, rows16)
  # q and s are each token's own quantisation, moved like its rows
  q0, s0 = fp8.quantise_rows(x)
  moved = lambda a: dispatch_lib.dispatch(a, plan, axis_name="expert", transport="local")
  live = np.asarray(plan.recv_valid)
  np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32))[live],
                                np.asarray(moved(q0.astype(jnp.float32)))[live])
  np.testing.assert_array_equal(np.asarray(s)[live], np.asarray(moved(s0))[live])
  zeros = (jnp.zeros_like(q), jnp.zeros_like(s))
  chex.assert_trees_all_equal(vjp8((ct, zeros))[0], vjp16(ct)[0])
  assert bound is None or int(plan.dropped) > 0   # the bound drops rows


def test_layer_fp8_against_the_reference():
  """"pallas" with precision="fp8" at EP 1, 2 and 4: output and gradients within FP8's
  precision of the float32 oracle, nothing dropped, repeatable under jit. y and dx equal
  EP 1's bit for bit (each row's result depends only on that row and its expert's
  weights and scales). The experts' weight gradients agree to float32 rounding: the
  wgrad kernel sums a group's rows in block_k-aligned row blocks of the buffer, so
  their bits depend on where the expert's rows start in it, which moves with EP (as
  for bf16); the router's float32 gradient sums the shards' parts."""
  ref_grads, (y_r, _) = _layer(UniEPConfig(backend="dense_reference"), 1)[0]
  y_x = _layer(UniEPConfig(backend="xla_dropless"), 1)[0][1][0]
  runs = {ep: _layer(FP8, ep) for ep in (1, 2, 4)}   # each EP degree run once
  for ep, (out, _) in runs.items():
    grads, (y, aux) = out
    assert int(aux["dropped"]) == 0
    assert rel_err(y, y_r) < 0.1
    assert rel_err(y, y_x) > 5e-3     # FP8 really ran (bf16 backends agree to ~2e-3)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
      assert rel_err(a, b) < 0.15
  (dx1, dp1), (y1, _) = runs[1][0]
  for ep in (2, 4):
    (dx2, dp2), (y2, _) = runs[ep][0]
    chex.assert_trees_all_equal((y2, dx2), (y1, dx1))
    for a, b in ((dp2.w_gate_up, dp1.w_gate_up), (dp2.w_down, dp1.w_down),
                 (dp2.router, dp1.router)):
      assert rel_err(a, b) < 1e-5
  out1, (x, p) = runs[1]   # a second run of the same program: the same bits
  chex.assert_trees_all_equal(jax.device_get(_layer_fn(FP8, 1)(x, p)), out1)


def test_layer_fp8_replicas_change_no_bit_of_y_or_dx():
  """Exact-load replicas under FP8 (EP 2, one slot): a replica quantises its expert's
  weights as the owner does and each row on its own, so y and dx are those without
  replicas bit for bit; the weight gradients (replica pieces summed at the owner in a
  fixed order) agree to float32 rounding."""
  rep = UniEPConfig(backend="pallas", kernel=KernelConfig(num_sms=2), precision="fp8",
                    replica_slots=1)
  (dx, dp), (y, aux) = _layer(rep, 2)[0]
  (dx0, dp0), (y0, _) = _layer(FP8, 2)[0]
  assert int(aux["dropped"]) == 0 and float(aux["replica_weight_bytes"]) > 0   # replicated
  chex.assert_trees_all_equal((y, dx), (y0, dx0))
  for a, b in ((dp.w_gate_up, dp0.w_gate_up), (dp.w_down, dp0.w_down)):
    assert rel_err(a, b) < 1e-5


def test_fp8_bad_configuration_names_both():
  with pytest.raises(ValueError, match="precision='fp8'.*xla_dropless"):
    UniEPConfig(backend="xla_dropless", precision="fp8")
  with pytest.raises(ValueError, match="precision='fp9' is unknown"):
    UniEPConfig(backend="pallas", precision="fp9")
  from uniep_jax.config import OverlapConfig
  with pytest.raises(ValueError, match="precision='fp8' with overlap"):
    UniEPConfig(backend="uniep", precision="fp8", overlap=OverlapConfig())
  from uniep_jax.validate import check_fp8_hardware

  class A100:
    device_kind = "NVIDIA A100-SXM4-80GB"
    compute_capability = "8.0"

  with pytest.raises(ValueError, match="precision='fp8' on backend='pallas'.*A100.*8.0"):
    check_fp8_hardware("pallas", A100())
  from train.config import TrainConfig
  with pytest.raises(ValueError, match="--fp8.*--backend xla_capacity"):
    TrainConfig(backend="xla_capacity", fp8=True)


# --- bad input ------------------------------------------------------------------------


def test_bad_input_is_refused_naming_it():
  class A100:
    device_kind = "NVIDIA A100-SXM4-80GB"
    compute_capability = "8.0"

  class H100:
    device_kind = "NVIDIA H100 80GB HBM3"
    compute_capability = "9.0"

  with pytest.raises(ValueError, match="FP8 tensor cores.*A100.*8.0"):
    fg.check_fp8_hardware(A100())
  fg.check_fp8_hardware(H100())
  with pytest.raises(ValueError, match="block_n=256"):
    fg.Fp8Config(block_n=256)
  with pytest.raises(ValueError, match="raster_rows=0"):
    fg.Fp8Config(raster_rows=0)
  with pytest.raises(ValueError, match="block_m \\* block_n"):
    fg.Fp8Config(block_m=128, block_n=128)
  a8 = jnp.zeros((64, 128), fp8.FP8_DTYPE)
  gs = jnp.array([64], jnp.int32)
  with pytest.raises(ValueError, match="b.dtype"):
    fg.fp8_gmm(a8, jnp.ones((64, 1)), jnp.zeros((1, 128, 128), jnp.bfloat16),
               jnp.ones((1, 1, 128)), gs)
  with pytest.raises(ValueError, match="a_scales must be float32 \\(64, 1\\)"):
    fg.fp8_gmm(a8, jnp.ones((64, 2)), jnp.zeros((1, 128, 128), fp8.FP8_DTYPE),
               jnp.ones((1, 1, 128)), gs)
  with pytest.raises(ValueError, match="K must agree"):
    fg.fp8_gmm(a8, jnp.ones((64, 1)), jnp.zeros((1, 128, 256), fp8.FP8_DTYPE),
               jnp.ones((1, 2, 128)), gs)


def test_fp8_ffn_lowers_for_cuda():
  """The FFN's forward and backward (FP8 kernels, quantisation, bf16 wgrads) lower to
  Mosaic GPU custom calls on this CPU machine, in both tilings: what the GPU compiles.
  (Lowering checks layouts and shapes; only a GPU run checks the kernels' timing.)"""
  from pallas_kernels import device as device_lib
  S = jax.ShapeDtypeStruct
  m, h, f, g = 512, 256, 192, 4
  for cfg in (fg.Fp8Config(num_sms=132), fg.Fp8Config(block_m=128, block_n=64, num_sms=132),
              fg.Fp8Config(num_sms=132, raster_rows=1)):
    def train(x, w1, w2, gs, dy, cfg=cfg):
      y, vjp = jax.vjp(lambda *a: fg.fp8_grouped_swiglu_ffn(
          *a, gs, config=cfg, wgrad_config=KernelConfig(num_sms=132)), x, w1, w2)
      return y, vjp(dy)
    with device_lib.lowering_for_gpu():
      text = jax.jit(train).trace(
          S((m, h), jnp.bfloat16), S((g, h, 2 * f), jnp.bfloat16), S((g, f, h), jnp.bfloat16),
          S((g,), jnp.int32), S((m, h), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("fp8_grouped_gemm") >= 4   # gate/up, down, da, dx
    assert text.count("fp8_quantise_rows") >= 4   # x, a, dy, [dh | du]
    assert text.count("fp8_quantise_weight") >= 2


@pytest.mark.parametrize("backend", ["pallas", "uniep"])
def test_fp8_layer_lowers_for_cuda(backend):
  """The FP8 layer's gradient at EP 4 (mesh data=2, expert=4) lowered for CUDA on this
  CPU machine: the tokens' quantisation kernel, the FP8 GEMMs and the weights'
  quantisation kernels are there (e4m3 rows through the XLA transport, "pallas", or
  the NVLink kernels, "uniep")."""
  import re
  from test_moe import lower_uniep_layer_for_cuda
  text = lower_uniep_layer_for_cuda(UniEPConfig(backend=backend, precision="fp8"), 256)
  launches = lambda name: len(set(re.findall(name + r"_(\d+)\\00", text)))   # noqa: E731
  assert launches("fp8_grouped_gemm") == 4       # gate/up, down, da, dx
  assert launches("fp8_quantise_weight") == 2
  assert launches("fp8_quantise_rows") == 4      # the tokens, a, dy, [dh | du]


@pytest.mark.parametrize("slots", [0, 1], ids=["no-replicas", "replicas"])
def test_fp8_uniep_equals_pallas_padded_bitwise(monkeypatch, slots):
  """backend "uniep" with precision="fp8" (each (token, owner) pair's packed e4m3 row
  and scales sent once over NVLink, then the owner's live-rows copy; the transfer and
  the copy replaced by their contracts, tests/simulated.py, the FP8 FFN itself run in
  the interpret mode) equals "pallas" over the padded transport bit for bit: outputs,
  dropped counts and the gradients of x and every parameter, at EP 2; with a replica
  slot too (rank 0's experts in every top-k: the e4m3 rows reach the replica's rank
  as they reach the owner's)."""
  import pallas_kernels.ep_transfer as ep
  import pallas_kernels.row_gather as rg
  import simulated
  monkeypatch.setattr(ep, "transfer_segments", simulated.transfer)
  monkeypatch.setattr(rg, "gather_live_rows", simulated.gather_live_rows)
  bias = jnp.zeros(8).at[jnp.asarray([0, 1])].set(100.0) if slots else None
  run = simulated.layer_runner(29, data=1, ep=2, top_k=2, hidden=128, ffn=128, tokens=32,
                               bias=bias)
  kernel = KernelConfig(num_sms=2)   # the interpret mode runs every CTA in turn
  cfg = dict(kernel=kernel, precision="fp8", replica_slots=slots)
  (y_p, d_p), g_p = run(UniEPConfig(backend="pallas", **cfg), transport="padded")
  (y_u, d_u), g_u = run(UniEPConfig(backend="uniep", **cfg))
  assert float(jnp.max(jnp.abs(y_p.astype(jnp.float32)))) > 0
  chex.assert_trees_all_equal((y_u, d_u, g_u), (y_p, d_p, g_p))
