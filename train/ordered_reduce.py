"""Sums over mesh axes whose order we fix ourselves, inside `shard_map`.

`lax.psum` hands the order of a float sum over devices to the collective library:
on GPUs, NCCL's ring or tree, its chunking and channel count, and XLA's choice of a
synchronous or an asynchronous all-reduce for that op (taken from the schedule of the
whole program). The same gradient can then get different bits in two programs that
compute it identically (4x H200, 2026-11-26, bench/train_step_diff.py: one attention
gradient differed by a bfloat16 ulp between backends "pallas" and "uniep").

`ordered_psum` adds no float in a collective: an all_to_all hands device r the r-th
chunk of every device's value, device r adds those R chunks in rank order 0..R-1 in
float32, and an all_gather puts the summed chunks back together. Same traffic as a
ring all-reduce (each device sends and receives (R-1)/R of the value twice), and every
output element is ((v_0 + v_1) + v_2) + ... in float32, on every device, in every
program. Several axes are summed one after the other in the order given.

`ordered_psum_buckets` splits the values (in the order given, e.g. the order the
backward pass produces them) into buckets of about equal bytes and chains one
`ordered_psum_many` per bucket, so that the first buckets' collectives may run while
later values are still being computed; the bits are those of one call.

`ordered_psum_many` sums many values in as few collectives as it can: values with the
same axes and dtype are concatenated into one buffer (the elementwise sums, hence the
bits, are those of one `ordered_psum` per value), and the buffers go one after the
other: each buffer's collectives wait for the previous buffer's result
(`lax.optimization_barrier`), so that no two of them are ever in flight at once. One
process driving several GPUs could otherwise have XLA run independent collectives
concurrently on different streams, and the training step that summed each gradient
leaf on its own never finished its first step on 4x H200 (2026-11-26, commit 3214321,
bench/train_loop_probe.py; the step holds 13 leaves' all_to_all/all_gather pairs),
with NCCL_LAUNCH_MODE=GROUP too.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from uniep_jax.dispatch import varying_axes


def _ordered_psum_axis(x: jax.Array, axis: str) -> jax.Array:
  r = jax.lax.axis_size(axis)
  if x.size == 0:  # nothing to add (a zero-size all_gather does not compile)
    return x
  if r == 1:  # nothing to add; a value typed varying over the axis is retyped invariant
    if axis not in varying_axes(x):
      return x
    return jax.lax.all_gather(x.reshape(-1), axis, tiled=True, to="invarying").reshape(x.shape)
  shape, dtype = x.shape, x.dtype
  flat = x.reshape(-1)
  n = flat.shape[0]
  m = -(-n // r)  # chunk length; the last chunk is zero-padded
  flat = jnp.pad(flat, (0, m * r - n))
  # row s of `parts` (on device d) is device s's chunk d
  parts = jax.lax.all_to_all(flat.reshape(r, m), axis, split_axis=0, concat_axis=0)
  acc = parts[0].astype(jnp.float32)
  for s in range(1, r):
    acc = acc + parts[s].astype(jnp.float32)
  # with shard_map's type checks on, the result is typed invariant over `axis` (it is)
  to = "invarying" if axis in varying_axes(acc) else "varying"
  full = jax.lax.all_gather(acc.astype(dtype), axis, tiled=True, to=to)  # [r * m]
  return full[:n].reshape(shape)


def ordered_psum(x: jax.Array, axes: Sequence[str]) -> jax.Array:
  """The sum of x over the mesh axes `axes` (inside shard_map), in rank order per axis,
  accumulated in float32 and returned in x's dtype. Same bits on every device."""
  for axis in axes:
    x = _ordered_psum_axis(x, axis)
  return x


def ordered_psum_many(items: Sequence[tuple[jax.Array, Sequence[str]]], *,
                      after=None) -> list[jax.Array]:
  """[(x, axes), ...] -> [ordered_psum(x, axes), ...], bit for bit, in one buffer per
  (axes, dtype, varying mesh axes) (first-appearance order; values typed alike inside
  a type-checked shard_map, so that no value comes back typed more varying than it
  went in), each buffer's collectives after the previous buffer's result exists, the
  first one's after `after` (any pytree of arrays; None: no wait)."""
  groups: dict[tuple, list[int]] = {}
  for i, (x, axes) in enumerate(items):
    key = (tuple(axes), jnp.dtype(x.dtype), frozenset(varying_axes(x)))
    groups.setdefault(key, []).append(i)
  out: list = [None] * len(items)
  previous = after
  for (axes, _, _), idx in groups.items():
    parts = [items[i][0] for i in idx]
    if not axes:  # nothing to sum
      for i, x in zip(idx, parts):
        out[i] = x
      continue
    flat = jnp.concatenate([x.reshape(-1) for x in parts])
    if previous is not None:  # start this buffer's collectives after the last one's
      previous, flat = jax.lax.optimization_barrier((previous, flat))
    total = ordered_psum(flat, axes)
    start = 0
    for i, x in zip(idx, parts):
      out[i] = total[start:start + x.size].reshape(x.shape)
      start += x.size
    previous = total
  return out


def ordered_psum_buckets(items: Sequence[tuple[jax.Array, Sequence[str]]], num_buckets: int, *,
                         after=None) -> list[jax.Array]:
  """`ordered_psum_many(items)`, bit for bit, in `num_buckets` consecutive buckets of
  `items` (in the order given) of about equal bytes (leaf granularity: fewer buckets
  when there are fewer leaves), each bucket's collectives after the previous bucket's
  result (the first after `after`). One bucket: exactly `ordered_psum_many`."""
  if num_buckets < 1:
    raise ValueError(f"num_buckets={num_buckets} must be >= 1")
  sizes = [x.size * jnp.dtype(x.dtype).itemsize for x, _ in items]
  total = max(sum(sizes), 1)
  buckets: list[list[int]] = [[]]
  done = 0
  for i, nbytes in enumerate(sizes):
    # start a new bucket once this one holds its share of the bytes
    if buckets[-1] and len(buckets) < num_buckets and done >= total * len(buckets) / num_buckets:
      buckets.append([])
    buckets[-1].append(i)
    done += nbytes
  out: list = [None] * len(items)
  previous = after
  for idx in buckets:
    summed = ordered_psum_many([items[i] for i in idx], after=previous)
    for i, value in zip(idx, summed):
      out[i] = value
    previous = summed
  return out

