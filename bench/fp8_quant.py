"""How fast do the FP8 quantisation passes run, against their HBM floor? One GPU.

For the activation rows x [M, H] and the weight [G, H, F] of each target shape
(bench/grouped_gemm.py's per-rank shapes, EP 4) it times, in one run:

  rows:      fp8.quantise_rows(x)                 (q e4m3 [M, H], s [M, H/128])
  weight:    fp8_gemm.quantise_weight(w)          (both layouts the FP8 GEMM reads)
  weight_q:  fp8.quantise_blocks(w)               (one layout)
  transpose: the K-major copy alone, swapaxes of the e4m3 q
  copy:      x + 1 in bf16 (what XLA's elementwise passes reach on this device)
  rows_mul, weight_mul, weight_direct: formulations compared (below), checked bit for
             bit against fp8.py's; weight_direct is what fp8.quantise_blocks(transposed=True)
             now does, weight_mul the e4m3 transpose it replaced

each with its bytes floor (bytes read + written) and the rate it reaches, and checks
that every variant gives the bits of fp8.py's.

  python -m bench.fp8_quant [--out DIR] [--configs mixtral-like,deepseek-like]

Writes fp8_quant_<device>.json into --out (default $OUT or bench/results). GPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.grouped_gemm import CONFIGS, time_fn
from pallas_kernels import device as device_lib
from pallas_kernels import fp8
from pallas_kernels import fp8_gemm as fg
from uniep_jax.measure import git_commit


def _scales_rows(x):
  m, k = x.shape
  xb = x.reshape(m, k // fp8.QUANT_BLOCK, fp8.QUANT_BLOCK)
  return fp8.pow2_scale(jnp.max(jnp.abs(xb), axis=2))   # abs and max exact in x's dtype


def rows_mul(x):
  """quantise_rows with the amax in x's dtype and a multiply by 1/s (exact: powers of
  two) in place of the division; K a multiple of 128."""
  m, k = x.shape
  s = _scales_rows(x)
  xb = x.reshape(m, k // fp8.QUANT_BLOCK, fp8.QUANT_BLOCK).astype(jnp.float32)
  return (xb * (1.0 / s)[:, :, None]).astype(fp8.FP8_DTYPE).reshape(m, k), s


def _block_scales(w):
  g, k, n = w.shape
  b = fp8.QUANT_BLOCK
  wb = w.reshape(g, k // b, b, n // b, b)
  return fp8.pow2_scale(jnp.max(jnp.abs(wb), axis=(2, 4)))


def _apply(w, inv):
  g, k, n = w.shape
  b = fp8.QUANT_BLOCK
  wb = w.reshape(g, k // b, b, n // b, b).astype(jnp.float32)
  return (wb * inv[:, :, None, :, None]).astype(fp8.FP8_DTYPE).reshape(g, k, n)


def weight_mul(w):
  """Both layouts with the K-major copy as the swapaxes of the e4m3 q (the formulation
  fp8_gemm.quantise_weight used before quantising w^T's blocks directly)."""
  s = _block_scales(w)
  q = _apply(w, 1.0 / s)
  return jnp.swapaxes(q, 1, 2), q, s


def weight_direct(w):
  """The K-major copy quantised from the transposed bf16 weight, not transposed in e4m3."""
  s = _block_scales(w)
  inv = 1.0 / s
  return _apply(jnp.swapaxes(w, 1, 2), jnp.swapaxes(inv, 1, 2)), _apply(w, inv), s


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
  p.add_argument("--configs", default="mixtral-like,deepseek-like")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--trials", type=int, default=3)
  args = p.parse_args(argv)
  dev = jax.devices()[0]
  os.makedirs(args.out, exist_ok=True)
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
    x = jax.random.normal(k1, (m, h), jnp.float32).astype(bf)
    w = (jax.random.normal(k2, (g, h, f), jnp.float32) / np.sqrt(h)).astype(bf)
    q, _ = jax.jit(fp8.quantise_blocks)(w)
    res = {"config": name, "M": m, "H": h, "F": f, "G": g, "ms": {}, "GB": {}, "TB_per_s": {}}
    cases = {
        # bytes: read + written
        "copy": (jax.jit(lambda a: a + 1), (x,), 2 * m * h * 2),
        "rows": (jax.jit(fp8.quantise_rows), (x,), m * h * 2 + m * h + m * h // 32),
        "weight": (jax.jit(fg.quantise_weight), (w,), g * h * f * (2 + 2)),
        "weight_q": (jax.jit(fp8.quantise_blocks), (w,), g * h * f * (2 + 1)),
        "transpose": (jax.jit(lambda a: jnp.swapaxes(a, 1, 2)), (q,), g * h * f * 2),
        "rows_mul": (jax.jit(rows_mul), (x,), m * h * 2 + m * h + m * h // 32),
        "weight_mul": (jax.jit(weight_mul), (w,), g * h * f * (2 + 2)),
        "weight_direct": (jax.jit(weight_direct), (w,), g * h * f * (2 + 2)),
    }
    ref_rows = cases["rows"][0](x)
    ref_w = cases["weight_q"][0](w)
    same = lambda a, b: bool(np.array_equal(np.asarray(a).view(np.uint8),
                                            np.asarray(b).view(np.uint8)))
    res["bits_equal"] = {
        "rows_mul": all(same(a, b) for a, b in zip(cases["rows_mul"][0](x), ref_rows)),
        "weight_mul": all(same(a, b) for a, b in zip(cases["weight_mul"][0](w)[1:], ref_w)),
        "weight_direct": all(same(a, b) for a, b in zip(cases["weight_direct"][0](w)[1:], ref_w))
        and same(cases["weight_direct"][0](w)[0], jnp.swapaxes(ref_w[0], 1, 2)),
    }
    print(f"{name:14s} bits equal to fp8.py's: {res['bits_equal']}", flush=True)
    for case, (fn, fargs, nbytes) in cases.items():
      t = time_fn(fn, *fargs, reps=args.reps, trials=args.trials)
      res["ms"][case] = t * 1e3
      res["GB"][case] = nbytes / 1e9
      res["TB_per_s"][case] = nbytes / t / 1e12
      print(f"{name:14s} {case:10s} {t * 1e3:8.3f} ms  {nbytes / 1e9:6.3f} GB  "
            f"{nbytes / t / 1e12:5.2f} TB/s", flush=True)
    report["results"].append(res)
    with open(path, "w") as fh:
      json.dump(report, fh, indent=1)
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
