"""Sums over mesh axes whose order we fix ourselves, inside `shard_map`.

`lax.psum` hands the order of a float sum over devices to the collective library:
on GPUs, NCCL's ring or tree, its chunking and channel count, and XLA's choice of a
synchronous or an asynchronous all-reduce for that op (taken from the schedule of the
whole program). The same gradient can then get different bits in two programs that
compute it identically (on 4x H200, bench/train_step_diff.py found one attention
gradient a bfloat16 ulp apart between backends "pallas" and "uniep").

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
concurrently on different streams: a training step that sums each gradient leaf on
its own (13 leaves' all_to_all/all_gather pairs) never finishes its first step on
4x H200, with NCCL_LAUNCH_MODE=GROUP too.

`ordered_allsum` is the forward-pass form for small values (the MoE layer's router
statistics, [E] floats): one all_gather over all the axes, then float32 adds in a
fixed tree over the rank order on every device; its backward passes the cotangent
through in a type-checked shard_map (the sum is used alike on every device), and in an
unchecked one sums the devices' parts of it the same way: no float sum of NCCL's
either way.

`stack_replicas` gives a `shard_map`ped function's replicated inputs gradients summed
by `ordered_psum_many`: each input goes in as R stacked copies, one per shard
(`stacked_spec`; no implicit psum in shard_map's transpose, which would leave the
order to NCCL), and the copies' cotangents are summed in rank order.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from uniep_jax.rows import varying_axes, widen_varying
from uniep_jax.params import place


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def ordered_allsum(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """The sum of a small x over the mesh axes `axes` (inside shard_map): one all_gather
  of every device's x (rank order over `axes`, in the order given), then float32
  adds in a fixed tree over that order (`pairwise_sum`); same bits on every device and
  in every program. The backward passes the cotangent through: the sum is a value every device holds and uses alike,
  so each device's part of it gets the full cotangent, as with `lax.psum`. In a
  shard_map without type checks (check_vma=False), where JAX hands each device 1/R of
  a replicated output's cotangent and every psum's transpose is a psum, the backward
  sums those R parts in the same fixed order instead (an `ordered_allsum` of the
  cotangent; exact for R a power of two). The mode is read off x's type: x must vary
  over every axis of `axes` in a type-checked shard_map (a per-shard partial sum)."""
  axes = tuple(axes)
  if math.prod(jax.lax.axis_size(a) for a in axes) == 1 and not set(axes) & varying_axes(x):
    return x
  # inside a type-checked shard_map, the gathered copies are typed invariant over `axes`
  to = "invarying" if set(axes) <= varying_axes(x) else "varying"
  parts = jax.lax.all_gather(x, axes, tiled=False, to=to)   # [R, ...], rank order
  return pairwise_sum([parts[s].astype(jnp.float32) for s in range(parts.shape[0])]
                      ).astype(x.dtype)


def pairwise_sum(values: list) -> jax.Array:
  """((a + b) + (c + d)) + ...: a fixed binary tree over the list's order. R equal
  values sum to exactly R times one of them when R is a power of two (a sequential
  sum rounds on the way: 3v may not be representable), which keeps the unchecked
  backward of `ordered_allsum` (R copies of 1/R of the cotangent) exact."""
  while len(values) > 1:
    values = [values[i] + values[i + 1] if i + 1 < len(values) else values[i]
              for i in range(0, len(values), 2)]
  return values[0]


def _ordered_allsum_fwd(x, axes):
  return ordered_allsum(x, axes), x.reshape(-1)[:0]   # no data: x's varying axes (its type)


def _ordered_allsum_bwd(axes, x_type, ct):
  if not set(axes) <= varying_axes(x_type):   # an unchecked shard_map: ct is 1/R of it
    return (ordered_allsum(ct, axes),)
  return (widen_varying(ct, varying_axes(x_type)),)


ordered_allsum.defvjp(_ordered_allsum_fwd, _ordered_allsum_bwd)


def replica_axes(mesh: jax.sharding.Mesh, spec: P) -> tuple[str, ...]:
  """The axes of `mesh` (of size > 1) that `spec` does not shard over: the array is
  replicated over them, and its gradient is a sum over them."""
  named = {a for entry in spec if entry is not None
           for a in (entry if isinstance(entry, tuple) else (entry,))}
  return tuple(a for a in mesh.axis_names if a not in named and mesh.shape[a] > 1)


def stacked_spec(mesh: jax.sharding.Mesh, spec: P) -> P:
  """The spec of `stack_replicas`' copies of an array sharded as `spec`: the copies'
  leading axis over the replica axes, the rest as `spec`."""
  return P(replica_axes(mesh, spec), *spec)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def stack_replicas(arrays: tuple, mesh: jax.sharding.Mesh, specs: tuple) -> tuple:
  """Each [*a.shape] sharded as its spec -> [n, *a.shape] sharded as
  P(replica_axes, *spec): one copy per shard of the replica axes (a broadcast: each
  device keeps the copy it holds). Their gradients are the copies' cotangents summed in
  rank order by one `ordered_psum_many` (one buffer per dtype and axes, the buffers'
  collectives chained: never two in flight at once, see above), so a `shard_map`
  taking the copies (in_specs P(replica_axes, *spec)) has no replicated input whose
  cotangent shard_map would psum itself."""
  out = []
  for a, spec in zip(arrays, specs):
    axes = replica_axes(mesh, spec)
    n = math.prod(mesh.shape[ax] for ax in axes)
    sharding = NamedSharding(mesh, stacked_spec(mesh, spec))
    if isinstance(a, jax.core.Tracer):
      out.append(place(jnp.broadcast_to(a[None], (n,) + a.shape), sharding))
    else:   # called outside jit: each device builds its own copy, not n on one device
      out.append(_broadcaster(n, sharding)(place(a, NamedSharding(mesh, spec))))
  return tuple(out)


@functools.lru_cache(maxsize=64)
def _broadcaster(n: int, sharding: NamedSharding):
  return jax.jit(lambda a: jnp.broadcast_to(a[None], (n,) + a.shape), out_shardings=sharding)


def _stack_replicas_fwd(arrays, mesh, specs):
  return stack_replicas(arrays, mesh, specs), None


def _stack_replicas_bwd(mesh, specs, _, cts):
  stacked_specs = tuple(stacked_spec(mesh, s) for s in specs)

  def sum_copies(*copies):
    # after=copies: the first collective starts once every input's cotangent exists,
    # i.e. after the layer's last backward kernel, never beside one. An NCCL kernel
    # beside a persistent Mosaic GPU kernel (grid = every SM) holds SMs that kernel's
    # CTAs wait for while it waits for its peers, whose SMs their own persistent kernel
    # holds: 4x H200, deepseek-like at EP 4, the router gradient's all_to_all running
    # beside the da GEMM in every second call doubles it (3.2 -> 6.2 ms;
    # docs/performance.md); where the waiting kernel's CTAs signal each other (the
    # overlapped launches, pallas_kernels/SYNC.md) it can hang.
    return tuple(ordered_psum_many([(c[0], replica_axes(mesh, s))
                                    for c, s in zip(copies, specs)], after=copies))

  cts = [place(c, NamedSharding(mesh, sp)) for c, sp in zip(cts, stacked_specs)]
  summed = jax.shard_map(sum_copies, mesh=mesh, in_specs=stacked_specs,
                         out_specs=tuple(specs))(*cts)
  return (tuple(summed),)


stack_replicas.defvjp(_stack_replicas_fwd, _stack_replicas_bwd)
