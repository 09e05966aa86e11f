"""Does quantising q(x) again give the FFN's bits of q(x)? One GPU.

The FP8 layer's replica slots receive each token as q(x) dequantised (bf16) and the
FFN quantises those rows again, where the other paths hand the FFN the dispatched
(q, s) as they are. Quantising q(x)'s values again gives (q, s) back, or (2q, s / 2)
where a block's largest |q| is 224 (its amax then sits on the next scale's limit):
the same values. The FFN's bits are then the same only if the tensor cores'
accumulation is invariant under a power-of-two scaling of one row's products.

This script builds rows where many blocks land on that case (their amax set to
225-239 times the block's scale, which rounds to 224), counts the (2q, s / 2) blocks,
and compares on the GPU, bit for bit:
  the FP8 FFN on (q, s) given as x_quantised   (the FP8 dispatch's path)
  the FP8 FFN on q(x)'s values, quantised here (the replica slots' path)
forward y and the gradients of x, w_gate_up and w_down.

  python -m bench.fp8_requant [--out DIR] [--configs mixtral-like,deepseek-like]

Writes fp8_requant_<device>.json into --out (default $OUT or bench/results).
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench.grouped_gemm import CONFIGS
from pallas_kernels import device as device_lib
from pallas_kernels import fp8
from pallas_kernels.fp8_gemm import fp8_grouped_swiglu_ffn
from uniep_jax.dispatch import _quantise_tokens, quantised_tokens
from uniep_jax.measure import git_commit


def _rows(key, m, h):
  """bf16 rows whose every other 128-column block has its amax at 225..239 times a
  power of two (q's largest element rounds to 224: the (2q, s / 2) case)."""
  kx, ke, kv = jax.random.split(key, 3)
  x = jax.random.normal(kx, (m, h), jnp.float32)
  hb = h // fp8.QUANT_BLOCK
  xb = x.reshape(m, hb, fp8.QUANT_BLOCK)
  xb = xb / jnp.max(jnp.abs(xb), axis=2, keepdims=True)                    # amax 1
  exp = jax.random.randint(ke, (m, hb, 1), -6, 6).astype(jnp.float32)
  peak = jnp.floor(jax.random.uniform(kv, (m, hb, 1), minval=225.0, maxval=240.0))
  on_edge = (jnp.arange(hb) % 2 == 0)[None, :, None]
  # s = 2^exp (amax in (224, 448] * 2^exp): the amax element is peak * 2^exp
  amax = jnp.where(on_edge, peak, 300.0) * jnp.exp2(exp)
  return (xb * amax).reshape(m, h).astype(jnp.bfloat16)


def _grads(ffn, x, w1, w2, gs, dy):
  y, vjp = jax.vjp(lambda x, w1, w2: ffn(x, w1, w2), x, w1, w2)
  return (y,) + vjp(dy)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
  p.add_argument("--configs", default="mixtral-like,deepseek-like")
  p.add_argument("--max-rows", type=int, default=16384, help="rows per case, at most")
  p.add_argument("--max-width", type=int, default=0,
                 help="H and F at most (0: the shape's; a small value for a CPU smoke run)")
  args = p.parse_args(argv)
  dev = jax.devices()[0]
  os.makedirs(args.out, exist_ok=True)
  report = {"device": dev.device_kind, "jax_version": jax.__version__,
            "commit": git_commit(), "command": "python -m bench.fp8_requant", "cases": []}
  ok = True
  for name in args.configs.split(","):
    c = CONFIGS[name]
    cap = args.max_width or max(c.hidden, c.ffn)
    g = c.local_experts
    m, h, f = min(c.rows, args.max_rows), min(c.hidden, cap), min(c.ffn, cap)
    key = jax.random.PRNGKey(0)
    kw1, kw2, kdy = jax.random.split(jax.random.fold_in(key, 1), 3)
    x = _rows(key, m, h)
    w1 = (jax.random.normal(kw1, (g, h, 2 * f), jnp.float32) / np.sqrt(h)).astype(jnp.bfloat16)
    w2 = (jax.random.normal(kw2, (g, f, h), jnp.float32) / np.sqrt(f)).astype(jnp.bfloat16)
    dy = jax.random.normal(kdy, (m, h), jnp.bfloat16)
    gs = jnp.full((g,), m // g, jnp.int32).at[0].add(m - g * (m // g))

    @jax.jit
    def case(x, w1, w2, dy):
      q, s = _quantise_tokens(x)
      xd = quantised_tokens(x)
      q2, s2 = _quantise_tokens(xd)
      halved = jnp.sum(s2 == s / 2)
      same = jnp.sum(s2 == s)
      values = jnp.all(fp8.dequantise_rows(q, s) == fp8.dequantise_rows(q2, s2))
      given = _grads(lambda a, b, c: fp8_grouped_swiglu_ffn(a, b, c, gs, x_quantised=(q, s)),
                     xd, w1, w2, gs, dy)
      again = _grads(lambda a, b, c: fp8_grouped_swiglu_ffn(a, b, c, gs), xd, w1, w2, gs, dy)
      equal = [jnp.array_equal(u, v) for u, v in zip(given, again)]
      return halved, same, values, equal

    halved, same, values, equal = jax.device_get(case(x, w1, w2, dy))
    row = {"config": name, "m": m, "h": h, "f": f, "g": g, "blocks": int(halved + same),
           "blocks_2q_s_half": int(halved), "blocks_same_scale": int(same),
           "values_equal": bool(values),
           "bits_equal": dict(zip(("y", "dx", "dw_gate_up", "dw_down"), map(bool, equal)))}
    ok &= row["values_equal"] and all(row["bits_equal"].values()) and halved > 0
    print(json.dumps(row), flush=True)
    report["cases"].append(row)
  report["all_equal"] = bool(ok)
  path = os.path.join(args.out, f"fp8_requant_{device_lib.device_name(dev)}.json")
  with open(path, "w") as fh:
    json.dump(report, fh, indent=1)
  print("all_equal", ok, "->", path)
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())
