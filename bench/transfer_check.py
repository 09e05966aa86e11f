"""The de-duplicated dispatch's send side on one GPU: the separate gather into a send
buffer + the plain transfer, against the transfer with gathered loads
(`ep_transfer.transfer_segments(..., src_index=)`, TransferConfig.gather_rows), in the
transfer's local form (every "peer's" segment lands in this GPU's output).

    python -m bench.transfer_check [--out DIR] [--tokens 16384] [--hidden 2048,7168]

On one GPU the stores go to local HBM, not over NVLink, so this measures what the
loads cost (the TMA operations per row, the index reads), not the NVLink-bound layer:
the gathered form should take about the plain transfer's time, and less than gather +
transfer. Inputs (seeded): x [tokens, H] bf16; for each of 4 destinations the sorted
tokens that select it (each with probability 0.68, ~2.72 of 4 at qwen3-like EP 4),
packed destination after destination (the `unique_tokens` layout). Bits: the covered
output rows of both forms, which must be equal (rows are moved, not computed).

The owner side (`expand`, per H): the expansion of the unique rows into a receive
layout of ~K / 2.72 = 2.94 rows per unique row (`row_gather.gather_live_rows`, plain and
weighted) on 132 (all), 64 and 32 CTAs: how fast the copy runs on the 64 copy CTAs of
`transfer_expand` (pallas_kernels/NOTES_transfer_expand.md: its prediction assumes it
keeps up there); and transfer_expand's local form (two launches, the copy role on
copy_ctas=64) against the gathered transfer + gather_live_rows, bit for bit, plain and
weighted (`_weighted`: gather_live_rows reads its weights by a TMA box per tile,
transfer_expand's copy as GMEM scalars).
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from pallas_kernels import ep_transfer, transfer_expand
from pallas_kernels import row_gather as rg
from uniep_jax import TransferConfig

PEERS = 4
LIVE_FRACTION = 0.68


def make_inputs(tokens: int, hidden: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  picks = [np.flatnonzero(rng.random(tokens) < LIVE_FRACTION) for _ in range(PEERS)]
  counts = np.array([len(p) for p in picks], np.int32)
  index = np.zeros(PEERS * tokens, np.int32)          # unique_tokens: T*min(R,K) slots
  index[:counts.sum()] = np.concatenate(picks)
  offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int32)
  column = lambda a: jnp.asarray(a, jnp.int32)[:, None]  # noqa: E731  one segment per peer
  segments = (column(offsets), column(np.arange(PEERS) * tokens), column(counts))
  x = jnp.asarray(rng.standard_normal((tokens, hidden), np.float32), jnp.bfloat16)
  return x, jnp.asarray(index), int(counts.sum()), segments, counts


SLOTS_PER_UNIQUE = 8 / (PEERS * LIVE_FRACTION)   # K over the owners a token reaches


def expand_inputs(counts, tokens: int, seed: int = 1):
  """The owner side: a receive layout of ~2.94 rows per unique row, in (local expert,
  source) blocks ([PEERS, 1] here: one block per source), each receive row reading a
  random unique row of its source's block; weights for the weighted copy."""
  rng = np.random.default_rng(seed)
  per_source = np.round(counts * SLOTS_PER_UNIQUE).astype(np.int32)
  index = np.concatenate([d * tokens + rng.integers(0, c, n)
                          for d, (c, n) in enumerate(zip(counts, per_source))]).astype(np.int32)
  start = np.concatenate([[0], np.cumsum(per_source)[:-1]]).astype(np.int32)
  scale = rng.random(index.shape[0]).astype(np.float32)
  column = lambda a: jnp.asarray(a, jnp.int32)[:, None]  # noqa: E731
  return jnp.asarray(index), jnp.asarray(scale), int(per_source.sum()), (column(start),
                                                                          column(per_source))


def expand_two_launches(x, i, ri, w, *, segments, live: int, out_rows: int):
  """The gathered transfer (local form), then gather_live_rows (weighted with w)."""
  u = ep_transfer.transfer_segments(x, *segments, out_rows=out_rows, config=TransferConfig(),
                                    src_index=i)
  return rg.gather_live_rows(u, ri, jnp.int32(live), out_rows=ri.shape[0], scale=w)


def expand_one_launch(x, i, ri, w, *, segments, copy_blocks, out_rows: int):
  """The same in transfer_expand's local form, the copy role on 64 CTAs."""
  return transfer_expand.transfer_expand(x, *segments, *copy_blocks, ri, src_index=i,
                                         unique_rows=out_rows, out_rows=ri.shape[0],
                                         scale=w, config=TransferConfig(copy_ctas=64))


def expand_row(x, index, segments, counts, tokens: int, hidden: int,
               cta_counts=(None, 64, 32)) -> dict:
  """The owner-side timings of the module docstring, for one H (cta_counts: the
  expansion's CTA counts, None: all SMs)."""
  out_rows = PEERS * tokens
  recv_index, scale, recv_live, copy_blocks = expand_inputs(counts, tokens)
  unique = jax.jit(lambda x, i: ep_transfer.transfer_segments(
      x, *segments, out_rows=out_rows, config=TransferConfig(), src_index=i))(x, index)
  row = dict(recv_rows=recv_live)
  for ctas in cta_counts:
    for weighted in (False, True):
      fn = jax.jit(lambda u, i, w, ctas=ctas, weighted=weighted: rg.gather_live_rows(
          u, i, jnp.int32(recv_live), out_rows=i.shape[0], num_ctas=ctas,
          scale=w if weighted else None))
      row[f"expand_{ctas or 'all'}ctas{'_weighted' if weighted else ''}"] = common.time_ms(
          fn, unique, recv_index, scale)

  a = jax.jit(functools.partial(expand_two_launches, segments=segments, live=recv_live,
                                out_rows=out_rows))
  b = jax.jit(functools.partial(expand_one_launch, segments=segments, copy_blocks=copy_blocks,
                                out_rows=out_rows))
  # weighted: gather_live_rows reads its weights by a TMA box per tile, transfer_expand's
  # copy as GMEM scalars (ep_transfer.move_items)
  for suffix, w in (("", None), ("_weighted", scale)):
    row.update({
        f"transfer_then_expand{suffix}": common.time_ms(a, x, index, recv_index, w),
        f"transfer_expand_local{suffix}": common.time_ms(b, x, index, recv_index, w),
        f"expand_bitwise_equal{suffix}": bool(common.same_bits(
            a(x, index, recv_index, w)[:recv_live], b(x, index, recv_index, w)[:recv_live]))})
  return row


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--tokens", type=int, default=16384)
  ap.add_argument("--hidden", default="2048,7168", help="comma list of H, each a case")
  ap.add_argument("--out", default=None)
  ap.add_argument("--no-expand", action="store_true", help="only the send side")
  ap.add_argument("--expand-ctas", default="all,64,32",
                  help="the owner-side expansion's CTA counts, a comma list (all: every SM)")
  args = ap.parse_args(argv)
  meta = common.run_metadata()
  print(meta, flush=True)
  rows = []
  for hidden in (int(h) for h in args.hidden.split(",")):
    x, index, live, segments, counts = make_inputs(args.tokens, hidden)
    out_rows = PEERS * args.tokens
    cfg, gcfg = TransferConfig(), TransferConfig(gather_rows=True)

    def gather(x, index):
      return rg.gather_live_rows(x, index, jnp.int32(live), out_rows=index.shape[0])

    def transfer(rows):
      return ep_transfer.transfer_segments(rows, *segments, out_rows=out_rows, config=cfg)

    plain = jax.jit(lambda x, i: transfer(gather(x, i)))
    gathered = jax.jit(lambda x, i: ep_transfer.transfer_segments(
        x, *segments, out_rows=out_rows, config=gcfg, src_index=i))
    covered = np.concatenate([np.arange(d * args.tokens, d * args.tokens + c)
                              for d, c in enumerate(counts)])
    same = bool(common.same_bits(plain(x, index)[covered], gathered(x, index)[covered]))
    send_rows = jax.jit(gather)(x, index)
    row = dict(tokens=args.tokens, hidden=hidden, live_rows=live, bitwise_equal=same,
               gather_then_transfer=common.time_ms(plain, x, index),
               gathered_transfer=common.time_ms(gathered, x, index),
               gather_alone=common.time_ms(jax.jit(gather), x, index),
               transfer_alone=common.time_ms(jax.jit(transfer), send_rows),
               bytes_moved=live * hidden * 2)
    if not args.no_expand:
      row.update(expand_row(x, index, segments, counts, args.tokens, hidden,
                            [None if c == "all" else int(c) for c in args.expand_ctas.split(",")]))
    print(row, flush=True)
    rows.append(row)
  out = common.out_dir(args.out)
  common.write_json(os.path.join(out, f"transfer_check_{common.device_tag(meta)}.json"),
                    dict(meta, benchmark="transfer_check", rows=rows,
                         command="python -m bench.transfer_check " + " ".join(argv or [])))


if __name__ == "__main__":
  main()
