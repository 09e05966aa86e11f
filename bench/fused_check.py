"""The driver shared by the v1-vs-fused GPU checks (`bench.check_fused_gpu`, Kernel A;
`bench.check_fused_return_gpu`, Kernel B).

Per case, on all local GPUs (mesh data=1, expert=R): run v1 once and the fused
kernel twice (the second launch must find no stale semaphore counts), compare with
the script's own `compare`, time both unless --no-time, and write the JSON after
EVERY case, so a hang (run it under `timeout`) keeps the cases before it. Exits 1
if any check fails.
"""

from __future__ import annotations

import argparse
import os
import traceback
from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

from bench import common
from pallas_kernels import device as device_lib
from uniep_jax import layout
from uniep_jax.config import KernelConfig, TransferConfig


def plan_of(topk, experts: int):
  """Inside the per-rank functions: this rank's routing plan and its rank."""
  counts = jax.lax.all_gather(layout.local_group_sizes(topk, experts), "expert")   # [R, E]
  rank = jax.lax.axis_index("expert")
  return layout.make_plan(topk, counts, rank), rank


def per_rank(fn, mesh, num_args: int):
  """fn over the expert axis, every argument and output split by rank."""
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(P("expert"),) * num_args,
                               out_specs=P("expert"), check_vma=False))


def main(argv, *, name: str, cases: dict, case_fields: Callable, build: Callable,
         compare: Callable) -> int:
  """name: the JSON's prefix; case_fields(case) -> dict for the JSON row;
  build(mesh, r, case, kernel, transfer) -> (v1, fused, inputs);
  compare(v1_out, fused_out, fused_again_out, r) -> dict with "ok"."""
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=os.environ.get("OUT"))
  ap.add_argument("--cases", default=",".join(cases))
  ap.add_argument("--no-time", action="store_true")
  args = ap.parse_args(argv)
  out = common.out_dir(args.out)
  meta = common.run_metadata()
  print(meta, flush=True)
  r = len(jax.devices())
  mesh = jax.make_mesh((1, r), ("data", "expert"))
  kernel, transfer = KernelConfig(), TransferConfig()
  path = os.path.join(out, f"{name}_{device_lib.device_name()}.json")
  results = []
  for case_name in args.cases.split(","):
    case = cases[case_name]
    res = dict(case=case_name, R=r, **case_fields(case), kernel=str(kernel), transfer=str(transfer))
    try:
      v1, fused_fn, xs = build(mesh, r, case, kernel, transfer)
      ya = jax.block_until_ready(v1(*xs))
      print(f"{case_name}: v1 ran", flush=True)
      yb = jax.block_until_ready(fused_fn(*xs))
      print(f"{case_name}: fused ran", flush=True)
      yc = jax.block_until_ready(fused_fn(*xs))                   # second launch: no stale counts
      res.update(compare(ya, yb, yc, r))
      if not args.no_time:
        res["v1_ms"] = common.time_ms(v1, *xs)
        res["fused_ms"] = common.time_ms(fused_fn, *xs)
    except Exception as ex:  # noqa: BLE001
      traceback.print_exc(limit=4)
      res.update(ok=False, error=repr(ex)[:600])
    print(("PASS " if res["ok"] else "FAIL ") + str(res), flush=True)
    results.append(res)
    common.write_json(path, dict(meta=meta, results=results))
  print("wrote", path)
  return 0 if all(x["ok"] for x in results) else 1
