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
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from pallas_kernels import ep_transfer
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


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--tokens", type=int, default=16384)
  ap.add_argument("--hidden", default="2048,7168", help="comma list of H, each a case")
  ap.add_argument("--out", default=None)
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
    print(row, flush=True)
    rows.append(row)
  out = common.out_dir(args.out)
  common.write_json(os.path.join(out, f"transfer_check_{common.device_tag(meta)}.json"),
                    dict(meta, benchmark="transfer_check", rows=rows,
                         command="python -m bench.transfer_check " + " ".join(argv or [])))


if __name__ == "__main__":
  main()
