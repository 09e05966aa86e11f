"""Is the grouped GEMM's mainloop bound by L2 -> SMEM traffic? A 2-CTA cluster probe (ONE GPU).

Every launch of pallas_kernels/grouped_gemm.py streams, per 64-deep k step of its 128 x 256
CTA tile, a 16 KiB lhs tile and a 32 KiB rhs tile from L2 into SMEM: 48 KiB per 4.2 MFLOP,
~7 TB/s of L2 reads at 600 TFLOP/s on 132 SMs, near what an H100/H200 L2 is reported to
give. A 2-CTA cluster whose CTAs compute two row tiles of one weight tile can load that
weight tile once for both (TMA multicast inside the cluster; SM to SM, not NVLink): 32
KiB per CTA and step, a third less. This probe asks whether that pays before the grouped
GEMM is changed: JAX's own Hopper matmul (`ops.gpu.hopper_matmul_mgpu`, the same CTA
shape as ours: 2 compute warpgroups, 128 x 128 each, side by side) without a cluster and
with one along M (the rhs tile multicast) and along N (the lhs tile multicast), on dense
shapes of the experts' GEMMs, against cuBLAS and against our kernel on one group.

  python -m bench.cluster_probe [--shapes qwen3,deepseek,mixtral] [--out DIR]

Writes cluster_probe_<device>.json: per shape and variant the interleaved median ms,
TFLOP/s, and whether the output matches cuBLAS's within bf16 tolerance.
"""

from __future__ import annotations

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench import common

# (M, K, N) of one expert-shaped GEMM, dense: the layer's per-rank rows of one launch
SHAPES = {
    "qwen3": (131072, 2048, 1536),      # gate/up over all local rows
    "deepseek": (65536, 7168, 4096),    # gate/up
    "deepseek_down": (65536, 2048, 7168),
    "mixtral": (16384, 4096, 28672),    # gate/up
}


def _hopper_variants():
  from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
  M, N = hm.MatmulDimension.M, hm.MatmulDimension.N

  def cfg(cluster, stages=4, width=8):
    return hm.TuningConfig(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=stages,
                           epi_tile_m=64, epi_tile_n=64, grid_minor_dim=N,
                           grid_tile_width=width, wg_dimension=N, cluster_dimension=cluster)

  return {
      "hopper_s4": cfg(None),
      "hopper_s4_clusterM": cfg(M),
      "hopper_s4_clusterN": cfg(N),
      "hopper_s3": cfg(None, 3),
      "hopper_s3_clusterM": cfg(M, 3),
  }, hm


def run(shapes, out):
  from pallas_kernels import grouped_gemm as gg
  from uniep_jax.config import KernelConfig

  meta = common.run_metadata()
  rows = []
  variants, hm = _hopper_variants()
  for name in shapes:
    m, k, n = SHAPES[name]
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (m, k), jnp.float32).astype(jnp.bfloat16)
    b = (jax.random.normal(kb, (k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    gs = jnp.array([m], jnp.int32)
    fns = {
        "cublas": jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32)
                          .astype(jnp.bfloat16)),
        "ours_g1": jax.jit(lambda a, b: gg.gmm(a, b[None], gs, config=KernelConfig())),
    }
    for vname, c in variants.items():
      fns[vname] = jax.jit(functools.partial(hm.matmul, c=None, config=c))
    ref = None
    row = dict(shape=name, m=m, k=k, n=n, close_to_cublas={}, errors={})
    timed = {}
    for vname, f in fns.items():
      try:
        o = common.block(f(a, b))
      except Exception as e:  # noqa: BLE001 - a variant that does not fit is reported
        row["errors"][vname] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"{name} {vname}: {row['errors'][vname]}", flush=True)
        continue
      if ref is None:
        ref = np.asarray(o, np.float32)
      err = float(np.max(np.abs(np.asarray(o, np.float32) - ref)) /
                  (np.max(np.abs(ref)) + 1e-30))
      row["close_to_cublas"][vname] = err < 2e-2
      one = common.time_ms(f, a, b, trials=2)["median_ms"]
      timed[vname] = (f, max(1, int(0.1 / max(one * 1e-3, 1e-6))))
    res = common.time_interleaved_ms(timed, a, b, trials=5)
    flops = 2.0 * m * k * n
    row["median_ms"] = {v: r["median_ms"] for v, r in res.items()}
    row["tflops"] = {v: flops / (r["median_ms"] * 1e-3) / 1e12 for v, r in res.items()}
    print(name, {v: round(t, 1) for v, t in row["tflops"].items()}, flush=True)
    rows.append(row)
  common.write_json(f"{common.out_dir(out)}/cluster_probe_{common.device_tag(meta)}.json",
                    dict(meta, benchmark="cluster_probe", rows=rows))
  return 0


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--shapes", default="qwen3,deepseek,deepseek_down,mixtral")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  return run(args.shapes.split(","), args.out)


if __name__ == "__main__":
  sys.exit(main())
