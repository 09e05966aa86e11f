"""How early a chunk of the receive layout could be complete in a de-duplicated dispatch
that overlaps its GEMM (a sizing for NOTES_fused.md, "What is left for qwen3-like's 2x";
CPU only, no kernel).

The de-duplicated dispatch sends one row per (token, owner). If every source sends its
rows for an owner sorted by the token's smallest local expert there, the owner's chunk c
of the receive layout (expert-major, `recv_chunk_rows` rows) is complete once every
source has sent its rows whose smallest expert is <= the chunk's last expert. This
prints, per chunk, the share of the GEMM's rows before it and the share of the unique
rows that must have arrived, for balanced routing (each token's top-k drawn uniformly).

  python -m bench.chunk_readiness [--shape qwen3-like] [--ep 4] [--chunk-rows 2048]
"""

from __future__ import annotations

import argparse

import numpy as np

from bench.common import SHAPES


def readiness(tokens: int, experts: int, top_k: int, ep: int, chunk_rows: int, seed: int = 0):
  """[(chunk, gemm_share_before, last_local_expert, unique_share_needed)] for owner 0."""
  rng = np.random.default_rng(seed)
  local = experts // ep
  # each source's tokens pick top_k distinct experts uniformly (balanced routing)
  chosen = np.argsort(rng.random((ep, tokens, experts)), axis=2)[:, :, :top_k]
  on_owner = chosen < local                                    # owner 0: experts [0, local)
  sends = on_owner.any(axis=2)                                 # (source, token) unique rows
  smallest = np.where(on_owner, chosen, local).min(axis=2)
  starts = np.concatenate([[0], np.cumsum([(chosen == e).sum() for e in range(local)])])
  num_chunks = -(-int(starts[-1]) // chunk_rows)
  out = []
  for c in range(num_chunks):
    last_row = min((c + 1) * chunk_rows, int(starts[-1])) - 1
    last_expert = int(np.searchsorted(starts, last_row, side="right")) - 1
    needed = (sends & (smallest <= last_expert)).sum() / sends.sum()
    out.append((c, c / num_chunks, last_expert, float(needed)))
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--shape", default="qwen3-like", choices=sorted(SHAPES))
  ap.add_argument("--ep", type=int, default=4)
  ap.add_argument("--chunk-rows", type=int, default=2048)
  args = ap.parse_args(argv)
  s = SHAPES[args.shape]
  rows = readiness(s.tokens, s.experts, s.top_k, args.ep, args.chunk_rows)
  print(f"{args.shape}, EP {args.ep}, chunks of {args.chunk_rows} rows: {len(rows)} chunks")
  print("chunk  GEMM rows before  last local expert  unique rows needed")
  for c, before, expert, needed in rows:
    if c in (0, 1, 2, 4, 8, 16) or c == len(rows) // 2 or c == 3 * len(rows) // 4 or c == len(rows) - 1:
      print(f"{c:5d}  {before:16.1%}  {expert:17d}  {needed:18.1%}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
