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
from moe_testlib import rel_err

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


def _operands(seed, m, k, n, g):
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = (jax.random.normal(k1, (m, k)) * 3.0).astype(jnp.bfloat16)
  w = (jax.random.normal(k2, (g, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
  return x, w


@pytest.mark.parametrize("transpose", [False, True], ids=["fwd", "dgrad"])
def test_fp8_gmm_matches_the_float64_oracle(transpose):
  """K and N not multiples of 128, an empty group, a group ending mid-tile, dead rows."""
  m, k, n = 200, 192, 200
  sizes = jnp.array([70, 0, 37, 61], jnp.int32)   # 168 live rows of 200
  if transpose:   # dy [M, N] against w [G, K, N]
    x, w = _operands(0, m, n, k, 4)
    w = jnp.swapaxes(w, 1, 2)
  else:
    x, w = _operands(0, m, k, n, 4)
  qw = fg.quantise_weight(w)
  out = jax.jit(lambda x, s: fg.gmm_fp8(x, qw, s, transpose=transpose, out_dtype=jnp.float32,
                                        config=CFG))(x, sizes)
  ref = _oracle(x, w, sizes, transpose)
  out = np.asarray(out, np.float64)
  # float32 accumulation of exactly scaled products: error ~ 1e-7 of the row norms
  scale = np.abs(ref).max()
  np.testing.assert_allclose(out, ref, rtol=0, atol=2e-6 * scale)
  assert np.all(out[168:] == 0.0)
  # the same check fails for the bf16 kernel's result: the oracle sees the quantisation
  bf = np.asarray((gg.reference_gmm_dgrad if transpose else gg.reference_gmm)(
      x, w, sizes, out_dtype=jnp.float32), np.float64)
  assert np.abs(bf - ref).max() > 100 * 2e-6 * scale


def test_fp8_gmm_256_groups_and_row_split_invariance():
  """256 groups (most of them 1-3 rows, some empty); a row's bits do not depend on which
  tile or group cut computes it: the rows of a group split in two (same weights) equal
  the rows computed as one group, bit for bit."""
  rng = np.random.default_rng(1)
  sizes = rng.integers(0, 4, size=256).astype(np.int32)
  m = int(sizes.sum()) + 9
  x, w = _operands(2, m, 128, 128, 256)
  qw = fg.quantise_weight(w)
  f = jax.jit(lambda x, q, s: fg.gmm_fp8(x, q, s, out_dtype=jnp.float32, config=CFG))
  out = f(x, qw, jnp.asarray(sizes))
  np.testing.assert_allclose(np.asarray(out, np.float64), _oracle(x, w, sizes, False),
                             rtol=0, atol=2e-6 * float(jnp.max(jnp.abs(out))))
  # one group of 150 rows, then the same rows as 61 + 89 with the weights repeated
  x2, w2 = _operands(3, 160, 256, 256, 1)
  one = f(x2, fg.quantise_weight(w2), jnp.array([150], jnp.int32))
  split = f(x2, fg.quantise_weight(jnp.concatenate([w2, w2])), jnp.array([61, 89], jnp.int32))
  chex.assert_trees_all_equal(one[:150], split[:150])


# --- the FP8 FFN ---------------------------------------------------------------------


def _ffn_inputs():
  ks = jax.random.split(jax.random.key(5), 3)
  g, h, f = 4, 128, 192
  x = jax.random.normal(ks[0], (256, h), jnp.bfloat16)
  w1 = (jax.random.normal(ks[1], (g, h, 2 * f)) / np.sqrt(h)).astype(jnp.bfloat16)
  w2 = (jax.random.normal(ks[2], (g, f, h)) / np.sqrt(f)).astype(jnp.bfloat16)
  return x, w1, w2, jnp.array([50, 0, 120, 60], jnp.int32)


def _loss(ffn):
  def loss(x, w1, w2, gs):
    y = ffn(x, w1, w2, gs).astype(jnp.float32)
    return jnp.sum(y * jnp.cos(jnp.arange(y.shape[1], dtype=jnp.float32)))
  return loss


def test_fp8_ffn_matches_the_quantised_reference_and_is_deterministic():
  """The forward equals the reference of the same quantised math up to float32
  accumulation order and the bf16 roundings it shares; the gradients agree with the
  bf16 FFN to FP8's precision (e4m3 keeps 3 mantissa bits: ~4% per element), and every
  result repeats bit for bit under jit."""
  x, w1, w2, gs = _ffn_inputs()
  ffn = functools.partial(fg.fp8_grouped_swiglu_ffn, config=CFG,
                          wgrad_config=KernelConfig(num_sms=4))
  y = jax.jit(ffn)(x, w1, w2, gs)
  y_ref = fg.reference_fp8_swiglu_ffn(x, w1, w2, gs)
  assert rel_err(y, y_ref) < 1e-2
  y_bf16 = gg.reference_swiglu_ffn(x, w1, w2, gs)
  assert 5e-3 < rel_err(y, y_bf16) < 0.1      # FP8 differs from bf16, within its precision
  assert np.all(np.asarray(y[230:]) == 0)
  grad = jax.jit(jax.grad(_loss(ffn), argnums=(0, 1, 2)))
  g8 = grad(x, w1, w2, gs)
  g_bf16 = jax.grad(_loss(gg.reference_swiglu_ffn), argnums=(0, 1, 2))(x, w1, w2, gs)
  for a, b in zip(g8, g_bf16):
    assert a.dtype == b.dtype and rel_err(a, b) < 0.1
  chex.assert_trees_all_equal(g8, grad(x, w1, w2, gs))
  chex.assert_trees_all_equal(y, jax.jit(ffn)(x, w1, w2, gs))


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
  for cfg in (fg.Fp8Config(num_sms=132), fg.Fp8Config(block_m=128, block_n=64, num_sms=132)):
    def train(x, w1, w2, gs, dy, cfg=cfg):
      y, vjp = jax.vjp(lambda *a: fg.fp8_grouped_swiglu_ffn(
          *a, gs, config=cfg, wgrad_config=KernelConfig(num_sms=132)), x, w1, w2)
      return y, vjp(dy)
    with device_lib.lowering_for_gpu():
      text = jax.jit(train).trace(
          S((m, h), jnp.bfloat16), S((g, h, 2 * f), jnp.bfloat16), S((g, f, h), jnp.bfloat16),
          S((g,), jnp.int32), S((m, h), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("fp8_grouped_gemm") >= 4   # gate/up, down, da, dx
