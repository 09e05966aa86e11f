"""Which shared-memory scalar reads fault on a GPU: the fold kernel's v5 form
(`row_gather.fold_live_rows` with its offsets and weights in SMEM) died with
CUDA_ERROR_ILLEGAL_INSTRUCTION on an H100 while the weighted copy, which reads its
weights at static indices, ran (pallas_kernels/NOTES_row_gather.md v5). Each variant
below is one small Mosaic GPU kernel run in a subprocess of its own (a fault takes the
CUDA context with it) and checked against numpy:

  static_f32     out[r] = rows[r] * w[r], r a Python int (the weighted copy's reads)
  dynamic_f32    the same in a fori_loop (r a device value)
  static_i32     out[r] = rows[r] * f32(meta[r]), meta int32 in SMEM, r a Python int
  dynamic_i32    the same in a fori_loop
  indirect_f32   out[r] = rows[r] * w[meta[r]], r a Python int, the index read from SMEM

Inputs: rows [4, 128] float32, w [32] float32, meta [32] int32 (a permutation of
0..31); each reaches SMEM by one TMA on one barrier (the 32-entry boxes of the v5 form,
128-byte aligned). Run: `python -m bench.smem_scalar_probe [--out DIR] [--variants ...]`
(one GPU; on the CPU the interpret mode runs every variant).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

VARIANTS = ("static_f32", "dynamic_f32", "static_i32", "dynamic_i32", "indirect_f32")
ROWS, COLS, BOX = 4, 128, 32


def inputs():
  rng = np.random.default_rng(0)
  rows = rng.standard_normal((ROWS, COLS)).astype(np.float32)
  w = rng.random(BOX).astype(np.float32) + 0.5
  meta = rng.permutation(BOX).astype(np.int32)
  return rows, w, meta


def expected(variant, rows, w, meta):
  r = np.arange(ROWS)
  scale = {"static_f32": w[r], "dynamic_f32": w[r], "static_i32": meta[r].astype(np.float32),
           "dynamic_i32": meta[r].astype(np.float32), "indirect_f32": w[meta[r]]}[variant]
  return rows * scale[:, None]


def run_variant(variant: str):
  import jax
  import jax.numpy as jnp
  from jax import lax
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from pallas_kernels import device as device_lib

  def body(rows_gmem, w_gmem, meta_gmem, out_gmem, rows_smem, w_smem, meta_smem, barrier):
    plgpu.copy_gmem_to_smem(rows_gmem, rows_smem, barrier)
    plgpu.copy_gmem_to_smem(w_gmem, w_smem, barrier)
    plgpu.copy_gmem_to_smem(meta_gmem, meta_smem, barrier)
    plgpu.barrier_wait(barrier)

    def scale_of(r):
      if variant.endswith("_f32") and not variant.startswith("indirect"):
        return w_smem[r]
      if variant == "indirect_f32":
        return w_smem[meta_smem[r]]
      return meta_smem[r].astype(jnp.float32)

    def one_row(r, carry):
      rows_smem[r] = rows_smem[r] * scale_of(r)
      return carry

    if variant.startswith("dynamic"):
      lax.fori_loop(0, ROWS, one_row, 0)
    else:
      for r in range(ROWS):
        one_row(r, 0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(rows_smem, out_gmem)
    plgpu.wait_smem_to_gmem(0)

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32),
      scratch_types=[plgpu.SMEM((ROWS, COLS), jnp.float32), plgpu.SMEM((BOX,), jnp.float32),
                     plgpu.SMEM((BOX,), jnp.int32), plgpu.Barrier(num_arrivals=3)],
      kernel_name=f"smem_probe_{variant}", interpret=device_lib.default_interpret())
  rows, w, meta = inputs()
  got = np.asarray(jax.jit(kernel)(jnp.asarray(rows), jnp.asarray(w), jnp.asarray(meta)))
  return got, expected(variant, rows, w, meta)


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--variants", default=",".join(VARIANTS))
  ap.add_argument("--out", default=None)
  ap.add_argument("--one", default=None, help=argparse.SUPPRESS)   # child: run one variant
  args = ap.parse_args(argv)
  if args.one:
    got, want = run_variant(args.one)
    print(json.dumps(dict(variant=args.one, equal=bool(np.array_equal(got, want)),
                          max_abs_diff=float(np.max(np.abs(got - want))))), flush=True)
    return 0
  from bench import common
  return common.run_probe("smem_scalar_probe", args.variants.split(","), args.out, 300)


if __name__ == "__main__":
  sys.exit(main())
