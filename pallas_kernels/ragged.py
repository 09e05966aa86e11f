"""Index arithmetic on ragged runs, shared by the plan and every kernel work list.

Runs of `counts[r]` elements laid end to end in the order of r are enumerated by a
flat index i; ranges of rows are cut into pieces at multiples of a block. Both
are sorts-free, atomic-free int32 arithmetic (cumsum + searchsorted), so every
work list built on them is a pure function of its inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# jnp.searchsorted's default method ("scan") is a loop over the log2(n) bisection
# steps, which XLA:GPU runs as a while loop driven from the host: each step costs a
# device-to-host round trip (profile of the uniep forward at qwen3-like on 4x H200:
# ~40 us per step, ~20 steps per search, ~1 ms of idle GPU per search in the
# de-duplication plan). Unrolled, the same steps are straight-line gathers; the result
# is the same integer either way.
SEARCH_METHOD = "scan_unrolled"


def enumerate_runs(counts: jax.Array, size: int):
  """For i in [0, size): (run, index_in_run, valid), each int32/bool [size].

  valid = i < sum(counts); for invalid i, run is clamped to the last run and
  index_in_run is meaningless (callers mask with `valid`).
  """
  counts = counts.astype(jnp.int32)
  ends = jnp.cumsum(counts)
  i = jnp.arange(size, dtype=jnp.int32)
  run = jnp.searchsorted(ends, i, side="right", method=SEARCH_METHOD).astype(jnp.int32)
  valid = run < counts.shape[0]
  run = jnp.minimum(run, counts.shape[0] - 1)
  return run, i - (ends - counts)[run], valid


def block_pieces(start: jax.Array, length: jax.Array, block: int):
  """Cutting each row range [start, start + length) at multiples of `block`:
  (first block index, number of pieces), each int32 like `start`; empty
  ranges have 0 pieces. Piece j of a range covers block first + j, clipped
  to the range."""
  first = start // block
  last = (start + length - 1) // block
  return first, jnp.where(length > 0, last - first + 1, 0).astype(jnp.int32)
