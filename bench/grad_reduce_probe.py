"""How fast the training step's gradient sums go over the mesh, on the GPUs: the
ordered sum of uniep_jax/ordered_reduce.py (all_to_all, float32 adds in rank order,
all_gather) against its two collectives alone, an all_to_all-based gather (the same
bytes through NCCL's send/recv kernel instead of its all-gather kernel), and XLA's
psum (NCCL all-reduce, the order not ours), for a float32 buffer of --elements per
device (default 305M: the replicated gradients of the mixtral-like training model,
embedding + head + one layer's attention). Runs itself again with NCCL_PROTO=Simple
(NCCL picked its low-latency "LL" all-gather for 0.9 GB in the 4x H200 training
profile of 2026-11-26, at ~108 GB/s), unless --no-child.

  python -m bench.grad_reduce_probe [--elements N] [--out DIR]

Writes grad_reduce_probe_<device>_x<R>.json: median ms and GB/s (bytes each device
receives / time) per variant and NCCL setting.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from bench import common
from pallas_kernels import device as device_lib
from uniep_jax.ordered_reduce import ordered_psum


def variants(r: int):
  ax = "x"

  def chunks(flat):
    return flat.reshape(r, -1)

  def all_to_all(flat):
    return jax.lax.all_to_all(chunks(flat), ax, split_axis=0, concat_axis=0).reshape(-1)

  def all_gather(flat):
    return jax.lax.all_gather(chunks(flat)[0], ax, tiled=True)

  def a2a_gather(flat):
    acc = chunks(flat)[0]
    return jax.lax.all_to_all(jnp.broadcast_to(acc[None], (r,) + acc.shape), ax,
                              split_axis=0, concat_axis=0).reshape(-1)

  return dict(ordered_psum=lambda f: ordered_psum(f, (ax,)), all_to_all=all_to_all,
              all_gather=all_gather, a2a_gather=a2a_gather,
              psum=lambda f: jax.lax.psum(f, ax))


def run(elements: int) -> dict:
  devs = jax.devices()
  r = len(devs)
  mesh = jax.make_mesh((r,), ("x",), devices=devs)
  n = elements // r * r
  x = jax.device_put(jnp.ones((r * n,), jnp.float32), NamedSharding(mesh, P("x")))
  # bytes one device receives: (r-1)/r of the buffer per collective, twice for the ordered sum
  one = 4.0 * n * (r - 1) / r
  recv = dict(ordered_psum=2 * one, all_to_all=one, all_gather=one, a2a_gather=one, psum=2 * one)
  rows = {}
  for name, fn in variants(r).items():
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
    try:
      t = common.time_ms(f, x, trials=5)
      rows[name] = dict(t, gb_per_s=recv[name] / (t["median_ms"] * 1e-3) / 1e9)
    except Exception as e:  # noqa: BLE001 - record and go on
      rows[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    print(f"  {name:14s} {rows[name]}", flush=True)
  return dict(elements_per_device=n, ranks=r, variants=rows)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--elements", type=int, default=305_000_000)
  ap.add_argument("--out", default=None)
  ap.add_argument("--no-child", action="store_true")
  ap.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  results = []
  if not args.no_child and not args.child_json:
    # the child first: this process's JAX would hold most of the GPUs' memory
    child = os.path.join(common.out_dir(args.out), "grad_reduce_probe_child.json")
    env = dict(os.environ, NCCL_PROTO="Simple")
    subprocess.run([sys.executable, "-m", "bench.grad_reduce_probe", "--elements",
                    str(args.elements), "--child-json", child], env=env, check=False)
    if os.path.exists(child):
      with open(child) as f:
        results.append(json.load(f))
      os.remove(child)
  common.start_training_process(xla_deterministic=True)
  proto = os.environ.get("NCCL_PROTO", "default")
  print(f"NCCL_PROTO={proto}", flush=True)
  result = dict(nccl_proto=proto, **run(args.elements))
  if args.child_json:
    with open(args.child_json, "w") as f:
      json.dump(result, f)
    return 0
  results.insert(0, result)
  out = common.out_dir(args.out)
  path = os.path.join(out, f"grad_reduce_probe_{device_lib.device_name()}_x{len(jax.devices())}.json")
  common.write_json(path, dict(common.run_metadata(), benchmark="grad_reduce_probe", runs=results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
