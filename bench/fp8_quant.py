"""How fast do the FP8 quantisation passes run, against their HBM floor? One GPU.

For the activation rows x [M, H] and the weight [G, H, F] of each target shape
(bench/grouped_gemm.py's per-rank shapes, EP 4) it times, in one run, the
quantisation kernels (pallas_kernels/fp8_quantise.py) against the same quantisation
in XLA (pallas_kernels/fp8.py), in the layouts the FP8 GEMM reads:

  rows_kernel / rows_xla:      q e4m3 [M, H] and the row scales transposed [H/128, M]
  weight_kernel / weight_xla:  q [G, H, F], the K-major copy q^T [G, F, H] and both
                               per-column scale layouts
  copy:                        x + 1 in bf16 (what an elementwise pass reaches here)

each with its bytes floor (bytes read + written) and the rate it reaches, and checks
that the kernels give the bits of the XLA formulation.

  python -m bench.fp8_quant [--out DIR] [--configs mixtral-like,deepseek-like,qwen3-like]

Writes fp8_quant_<device>.json into --out (default $OUT or bench/results). GPU only.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from bench.grouped_gemm import CONFIGS, time_fn
from pallas_kernels import device as device_lib
from pallas_kernels import fp8
from pallas_kernels import fp8_quantise
from uniep_jax.measure import git_commit


def _rows_xla(x):
  q, s = fp8.quantise_rows(x)
  return q, s.T


def _weight_xla(w):
  q, s, q_t = fp8.quantise_blocks(w, transposed=True)
  return q, q_t, fp8.column_scales(s, 2), fp8.column_scales(s, 1)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", default=None, help="default: $OUT, else bench/results")
  p.add_argument("--configs", default="mixtral-like,deepseek-like,qwen3-like")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--trials", type=int, default=3)
  args = p.parse_args(argv)
  dev = jax.devices()[0]
  args.out = common.out_dir(args.out)
  path = os.path.join(args.out, f"fp8_quant_{device_lib.device_name(dev)}.json")
  report = {"device": dev.device_kind, "jax_version": jax.__version__,
            "git_commit": git_commit(), "reps": args.reps, "trials": args.trials,
            "timing": "median over trials of (reps back-to-back jitted calls) / reps",
            "results": []}
  bf = jnp.bfloat16
  for name in args.configs.split(","):
    s = CONFIGS[name]
    m, h, f, g = s.rows, s.hidden, s.ffn, s.local_experts
    k1, k2 = jax.random.split(jax.random.key(0))
    # rows of different magnitudes, so the row scales differ
    x = (jax.random.normal(k1, (m, h), jnp.float32)
         * 2.0 ** jax.random.randint(k1, (m, 1), -8, 8)).astype(bf)
    w = (jax.random.normal(k2, (g, h, f), jnp.float32) / np.sqrt(h)).astype(bf)
    res = {"config": name, "M": m, "H": h, "F": f, "G": g, "ms": {}, "GB": {}, "TB_per_s": {}}
    rows_bytes = m * h * 2 + m * h + m * h // 32
    weight_bytes = g * h * f * (2 + 2) + 2 * g * h * f // 32
    cases = {
        # bytes: read + written
        "copy": (jax.jit(lambda a: a + 1), (x,), 2 * m * h * 2),
        "rows_kernel": (jax.jit(fp8_quantise.quantise_rows_t), (x,), rows_bytes),
        "rows_xla": (jax.jit(_rows_xla), (x,), rows_bytes),
        "weight_kernel": (jax.jit(fp8_quantise.quantise_weight_t), (w,), weight_bytes),
        "weight_xla": (jax.jit(_weight_xla), (w,), weight_bytes),
    }
    same = lambda a, b: bool(np.array_equal(np.asarray(a).view(np.uint8),
                                            np.asarray(b).view(np.uint8)))
    # bit for bit, except the documented one: the kernel's K-major copy holds +0 where
    # q holds -0 (fp8_quantise.py), so XLA's -0 (byte 0x80) counts as +0 there
    def canon(a):
      b = np.asarray(a).view(np.uint8)
      return np.where(b == 0x80, 0, b)

    wk, wx = cases["weight_kernel"][0](w), cases["weight_xla"][0](w)
    res["bits_equal"] = {
        "rows": all(same(a, b) for a, b in zip(cases["rows_kernel"][0](x),
                                                cases["rows_xla"][0](x))),
        "weight_q_and_scales": same(wk[0], wx[0]) and same(wk[2], wx[2]) and same(wk[3], wx[3]),
        "weight_q_t_but_negative_zeros": bool(np.array_equal(
            np.asarray(wk[1]).view(np.uint8), canon(wx[1]))),
        "weight_q_t_negative_zeros_in_xla": int((np.asarray(wx[1]).view(np.uint8) == 0x80).sum())}
    # the other inputs the kernels take: 64-row tiles (M not a multiple of 128), float16
    # and float32 rows, float16 weights
    rows_k, rows_x = cases["rows_kernel"][0], cases["rows_xla"][0]
    for label, xi in (("rows_64_row_tiles", x[:m - 64]), ("rows_f16", x.astype(jnp.float16)),
                      ("rows_f32", x.astype(jnp.float32) * 1.0001)):
      res["bits_equal"][label] = all(same(a, b) for a, b in zip(rows_k(xi), rows_x(xi)))
    wk16, wx16 = cases["weight_kernel"][0](w.astype(jnp.float16)), _weight_xla(
        w.astype(jnp.float16))
    res["bits_equal"]["weight_f16_q_and_scales"] = all(
        same(wk16[i], wx16[i]) for i in (0, 2, 3))
    res["bits_equal"]["weight_f16_q_t_but_negative_zeros"] = bool(np.array_equal(
        np.asarray(wk16[1]).view(np.uint8), canon(wx16[1])))
    # a NaN makes its block's scale NaN, and only its block's (the CPU interpreter's max
    # drops NaNs: this is the kernels' only check); NaNs in several rows and warps
    nan_rows, nan_cols = np.array([3, 64, 127]), np.array([5, 200, 127])
    xn = x.at[nan_rows, nan_cols].set(jnp.nan)
    wn = w.at[0, nan_rows, nan_cols].set(jnp.nan)
    s_rows = np.asarray(cases["rows_kernel"][0](xn)[1])       # [H/128, M]
    s_w = np.asarray(cases["weight_kernel"][0](wn)[2])[0]     # [H/128, F]
    want_rows = np.zeros_like(s_rows, bool)
    want_rows[nan_cols // 128, nan_rows] = True
    want_w = np.zeros_like(s_w, bool)
    want_w[(nan_rows // 128)[:, None], (nan_cols // 128)[:, None] * 128 + np.arange(128)] = True
    res["nan_scale"] = {"rows": bool(np.array_equal(np.isnan(s_rows), want_rows)),
                        "weight": bool(np.array_equal(np.isnan(s_w), want_w)),
                        "rows_xla": bool(np.array_equal(
                            np.isnan(np.asarray(cases["rows_xla"][0](xn)[1])), want_rows))}
    print(f"{name:14s} kernels' bits equal to XLA's: {res['bits_equal']}; "
          f"NaN scales: {res['nan_scale']}", flush=True)
    for case, (fn, fargs, nbytes) in cases.items():
      t = time_fn(fn, *fargs, reps=args.reps, trials=args.trials)
      res["ms"][case] = t * 1e3
      res["GB"][case] = nbytes / 1e9
      res["TB_per_s"][case] = nbytes / t / 1e12
      print(f"{name:14s} {case:14s} {t * 1e3:8.3f} ms  {nbytes / 1e9:6.3f} GB  "
            f"{nbytes / t / 1e12:5.2f} TB/s", flush=True)
    report["results"].append(res)
    common.write_json(path, report)   # after every shape
  return 0


if __name__ == "__main__":
  sys.exit(main())
