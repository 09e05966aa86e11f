"""The router's logits alone, forward and forward+backward, float32 GEMM against bf16
pieces (`RoutingConfig.logits_matmul`), on one GPU at the benchmark shapes' per-rank
sizes (T tokens, H hidden, E experts), with the rest of `route` (softmax, top-k) too.

    python -m bench.router_ab [--shapes qwen3-like,deepseek-like,mixtral-like] [--out DIR]

Each case: median ms of the jitted forward (`route`), of value_and_grad of a loss of the
logits and the top-k weights with respect to x and the router, and the relative error of
the logits against a float64 product on the host (first 256 tokens).
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from uniep_jax import RoutingConfig, route

MODES = ("float32", "bf16x3")


def case(shape: common.MoEShape, mode: str) -> dict:
  kx, kr = jax.random.split(jax.random.key(0))
  x = jax.random.normal(kx, (shape.tokens, shape.hidden), jnp.float32).astype(jnp.bfloat16)
  router = jax.random.normal(kr, (shape.hidden, shape.experts), jnp.float32) * shape.hidden ** -0.5
  cfg = RoutingConfig(logits_matmul=mode)

  def loss(x, router):
    out = route(x, router, shape.top_k, cfg)
    return jnp.sum(out.topk_weights * jnp.arange(shape.top_k, dtype=jnp.float32)) + \
        1e-3 * jnp.sum(jnp.square(out.logits))

  fwd = jax.jit(lambda x, r: route(x, r, shape.top_k, cfg).logits)
  bwd = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  logits = np.asarray(fwd(x, router)[:256], np.float64)
  exact = np.asarray(x[:256].astype(jnp.float32), np.float64) @ np.asarray(router, np.float64)
  return dict(shape=shape.name, mode=mode, tokens=shape.tokens, hidden=shape.hidden,
              experts=shape.experts, fwd=common.time_ms(fwd, x, router),
              fwdbwd=common.time_ms(bwd, x, router),
              logits_rel_err=float(np.max(np.abs(logits - exact)) / np.max(np.abs(exact))))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shapes", default="qwen3-like,deepseek-like,mixtral-like")
  ap.add_argument("--out", default=None)
  args = ap.parse_args()
  rows = []
  for name in args.shapes.split(","):
    shape = common.SHAPES[name]
    for mode in MODES:
      row = case(shape, mode)
      rows.append(row)
      print(f"{name:14s} {mode:8s} fwd {row['fwd']['median_ms']:.3f} ms  fwd+bwd "
            f"{row['fwdbwd']['median_ms']:.3f} ms  logits rel err {row['logits_rel_err']:.2e}",
            flush=True)
  meta = common.run_metadata()
  name = f"router_ab_{common.device_tag(meta)}.json"
  common.write_json(os.path.join(common.out_dir(args.out), name),
                    dict(meta, benchmark="router_ab", rows=rows))


if __name__ == "__main__":
  main()
