"""The owner-side fold kernel (`pallas_kernels/row_gather.fold_live_rows`) on one GPU:
bits against XLA's form of the same arithmetic (`fold_rows_reference`), and time against
its HBM floor, at the owner fold's qwen3-like size (EP 4, balanced).

    python -m bench.fold_check [--out DIR] [--slots 131072] [--fold 8] [--tiles 8,16,32,64]

Inputs (seeded): `slots` slot rows of H (the live receive rows), grouped into unique
rows of 1..fold slots (lengths Binomial(8, 1/4) raised to at least 1, about a token's
slots on one owner at K 8 over 4 ranks: mean ~2.1), each group's slots at random distinct rows; f32 weights. Reports
the kernel's median ms, the floor (slot rows read + unique rows written over the
datasheet HBM rate) and whether the kernel's rows equal XLA's bit for bit (on a GPU the
two compilers may contract multiply-add differently; NOTES_row_gather.md v3), for each
`slots_per_tile` S in --tiles (v4's tiles of S term positions), and whether every S gives
the same bits (it must: S changes which CTA folds a row, not how).
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from pallas_kernels import row_gather as rg

HBM_TBPS = {"NVIDIA H100 80GB HBM3": 3.35, "NVIDIA H200": 4.8}


def make_inputs(slots: int, hidden: int, fold: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  # group sizes: slots of a token on one owner, K=8 experts over 4 ranks, given >= 1
  sizes = []
  while sum(sizes) < slots:
    sizes.append(int(min(fold, max(1, rng.binomial(8, 0.25)))))
  sizes[-1] -= sum(sizes) - slots
  if sizes[-1] == 0:
    sizes.pop()
  perm = rng.permutation(slots).astype(np.int32)
  index = np.zeros((len(sizes), fold), np.int32)
  start = 0
  for n, c in enumerate(sizes):
    index[n, :c] = perm[start:start + c]
    start += c
  count = np.asarray(sizes, np.int32)
  src = jnp.asarray(rng.standard_normal((slots, hidden), np.float32), jnp.bfloat16)
  scale = jnp.asarray(rng.random((len(sizes), fold), np.float32))
  return src, jnp.asarray(index), jnp.asarray(count), scale


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--slots", type=int, default=131072)
  ap.add_argument("--hidden", type=int, default=2048)
  ap.add_argument("--fold", type=int, default=8)
  ap.add_argument("--tiles", default="8,16,32,64",
                  help="slots_per_tile values (comma list), each timed")
  ap.add_argument("--unscaled", action="store_true", help="the fold without weights")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  src, index, count, scale = make_inputs(args.slots, args.hidden, args.fold)
  if args.unscaled:
    scale = None
  n = int(count.shape[0])
  live = jnp.int32(n)
  xla = jax.jit(rg.fold_rows_reference)
  want = xla(src, index, count, scale)
  t_xla = common.time_ms(xla, src, index, count, scale)
  meta = common.run_metadata()
  bytes_moved = (args.slots + n) * args.hidden * 2
  tbps = HBM_TBPS.get(meta.get("device_kind", ""), None)
  floor_ms = None if tbps is None else bytes_moved / (tbps * 1e12) * 1e3
  # the plain gather of as many rows (one load and one store per row): the rate the fold's
  # loads could reach (NOTES_row_gather.md v1)
  perm = jnp.arange(args.slots, dtype=jnp.int32)[::-1]
  gather = jax.jit(lambda s, i: rg.gather_live_rows(s, i, jnp.int32(args.slots),
                                                    out_rows=args.slots))
  gather(src, perm)
  t_gather = common.time_ms(gather, src, perm)
  # the weighted copy (the backward's w * dy rows) of as many rows: its in-place multiply
  # should hide under the next tile's loads (NOTES_row_gather.md v2, v5)
  weights = jnp.linspace(0.5, 1.5, args.slots, dtype=jnp.float32)
  scaled = jax.jit(lambda s, i, w: rg.gather_live_rows(s, i, jnp.int32(args.slots),
                                                       out_rows=args.slots, scale=w))
  t_scaled = common.time_ms(scaled, src, perm, weights)
  scaled_ok = bool(common.same_bits(
      scaled(src, perm, weights),
      jax.jit(lambda s, i, w: (s[i].astype(jnp.float32) * w[:, None]).astype(s.dtype))(
          src, perm, weights)))
  print(dict(gather=t_gather, scaled_gather=t_scaled, scaled_gather_bitwise_equal_xla=scaled_ok),
        flush=True)
  rows, first = [], None
  for tile in (int(t) for t in args.tiles.split(",") if t):
    kernel = jax.jit(lambda s, i, c, w, tile=tile: rg.fold_live_rows(
        s, i, c, live, out_rows=n, scale=w, slots_per_tile=tile))
    got = kernel(src, index, count, scale)
    first = got if first is None else first
    row = dict(slots=args.slots, unique_rows=n, hidden=args.hidden, fold=args.fold,
               slots_per_tile=tile, mean_fold=args.slots / n, scaled=scale is not None,
               bitwise_equal_xla=bool(common.same_bits(got, want)),
               bitwise_equal_first_tiling=bool(common.same_bits(got, first)),
               max_abs_diff=float(jnp.max(jnp.abs(got.astype(jnp.float32)
                                                  - want.astype(jnp.float32)))),
               kernel=common.time_ms(kernel, src, index, count, scale), xla=t_xla,
               bytes=bytes_moved, hbm_floor_ms=floor_ms)
    print(row)
    rows.append(row)
  out = common.out_dir(args.out)
  name = f"fold_check_{common.device_tag(meta)}{'_unscaled' if args.unscaled else ''}.json"
  common.write_json(os.path.join(out, name), dict(
      meta, benchmark="fold_check", rows=rows, slots=args.slots, hidden=args.hidden,
      fold_scaled=not args.unscaled,
      gather=t_gather, scaled_gather=t_scaled, scaled_gather_bitwise_equal_xla=scaled_ok))


if __name__ == "__main__":
  main()
