"""Can a row transfer run beside an expert GEMM on the GPUs? Times, per EP rank, for one
shape's dispatch (the same routing plan for all):

  transfer alone     lax.ragged_all_to_all (NCCL, XLA's async collective stream) and the
                     Pallas NVLink transfer (pallas_kernels/ep_transfer.py) at several CTA
                     counts (the per-CTA rate the fused kernels' SM split depends on)
  GEMM alone         the gate/up grouped GEMM on an independent [T*K, H] buffer, on all
                     SMs and on fewer (KernelConfig.num_sms: SMs left free for NCCL)
  both in one jit    the transfer and the GEMM, independent of each other: if the time is
                     near max(alone) the two overlapped, near the sum they did not

Run once per XLA_FLAGS setting (the latency-hiding scheduler decides where XLA places
the collective's done): `--child-flags` runs itself again with each.

  python -m bench.overlap_probe [--shape qwen3-like] [--out DIR]

Writes overlap_probe_<device>_x<R>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from bench import common

FLAG_SETS = {
    "default": "",
    "lhs": "--xla_gpu_enable_latency_hiding_scheduler=true",
}


def schedule_summary(compiled_text: str) -> dict:
  """Where the scheduled program puts the collective's start and done relative to the
  Pallas custom calls (line numbers of the entry computation's instructions)."""
  lines = compiled_text.splitlines()
  pos = {}
  for i, line in enumerate(lines):
    for key in ("all-to-all-start", "all-to-all-done", "ragged-all-to-all", "custom-call",
                "async-start", "async-done"):
      if re.search(rf"\b{re.escape(key)}\b", line):
        pos.setdefault(key, []).append(i)
  return {k: v[:8] for k, v in pos.items()}


def run(shape_name: str, flags_name: str) -> dict:
  from pallas_kernels.grouped_gemm import gate_up_projection
  from uniep_jax.config import KernelConfig, TransferConfig
  from uniep_jax.dispatch import send_rows, sort_rows
  from uniep_jax.layout import local_group_sizes, make_plan

  shape = {**common.SHAPES, **common.SMOKE_SHAPES}[shape_name]
  devs = jax.devices()
  r = len(devs)
  mesh = jax.sharding.Mesh(devs, ("expert",))
  t, h, f, e, k = shape.tokens, shape.hidden, shape.ffn, shape.experts, shape.top_k
  el = e // r
  spec = P("expert")
  shard = NamedSharding(mesh, spec)

  def init(key):
    k0, k1, k2, k3 = jax.random.split(key, 4)
    x = jax.random.normal(k0, (r * t, h), jnp.bfloat16)
    a = jax.random.normal(k1, (r * t * k, h), jnp.bfloat16)       # the GEMM's own rows
    w = (jax.random.normal(k2, (e, h, 2 * f), jnp.bfloat16) * h ** -0.5).astype(jnp.bfloat16)
    topk = jax.vmap(lambda kk: jax.random.choice(kk, e, (k,), replace=False))(
        jax.random.split(k3, r * t)).astype(jnp.int32)            # balanced, distinct
    return x, a, w, topk

  x, a, w, topk = jax.jit(init, out_shardings=(shard,) * 4)(jax.random.key(0))
  local_groups = jnp.full((el,), t * k // el, jnp.int32)

  def plan_of(topk_l):
    rank = jax.lax.axis_index("expert")
    cm = jax.lax.all_gather(local_group_sizes(topk_l, e), "expert")
    return make_plan(topk_l, cm, rank)

  def transfer(x_l, topk_l, transport, tcfg):
    plan = plan_of(topk_l)
    return send_rows(sort_rows(x_l, plan, k), plan, "expert", el, transport, tcfg)

  def gemm(a_l, w_l, kcfg):
    return gate_up_projection(a_l, w_l, local_groups, config=kcfg, save_hu=False)[0]

  def smap(body, n_in, n_out):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * n_in,
                                 out_specs=(spec,) * n_out if n_out > 1 else spec,
                                 check_vma=False))

  num_sms = devs[0].core_count if hasattr(devs[0], "core_count") else 132
  rows = []

  def timed(name, fn, *args, text=False):
    try:
      entry = dict(name=name, **common.time_ms(fn, *args, trials=9, min_batch_s=0.1))
      if text:
        entry["schedule"] = schedule_summary(fn.lower(*args).compile().as_text())
    except Exception as err:  # noqa: BLE001 - a probe: record and go on
      entry = dict(name=name, error=f"{type(err).__name__}: {str(err)[:400]}")
    print(json.dumps({k: v for k, v in entry.items() if k != "schedule"}), flush=True)
    rows.append(entry)

  base_k = KernelConfig()
  transfers = {"ragged": ("ragged", None)}
  for ctas in (16, 32, 64, 96):
    transfers[f"nvlink_c{ctas}"] = ("nvlink", TransferConfig(num_ctas=ctas))
  for name, (tp, tcfg) in transfers.items():
    timed(f"transfer {name}",
          smap(lambda x_l, tk, tp=tp, tcfg=tcfg: transfer(x_l, tk, tp, tcfg), 2, 1), x, topk)
  sms_list = (None, num_sms - 16, num_sms - 32)
  for sms in sms_list:
    kcfg = KernelConfig(num_sms=sms) if sms else base_k
    timed(f"gemm sms={sms or num_sms}", smap(lambda a_l, w_l, kcfg=kcfg: gemm(a_l, w_l, kcfg), 2, 1),
          a, w)
  for tname in ("ragged", "nvlink_c64"):
    tp, tcfg = transfers[tname]
    for sms in sms_list:
      kcfg = KernelConfig(num_sms=sms) if sms else base_k

      def both(x_l, tk, a_l, w_l, tp=tp, tcfg=tcfg, kcfg=kcfg):
        return transfer(x_l, tk, tp, tcfg), gemm(a_l, w_l, kcfg)

      timed(f"both {tname} + gemm sms={sms or num_sms}", smap(both, 4, 2), x, topk, a, w,
            text=True)
  return dict(flags=flags_name, xla_flags=os.environ.get("XLA_FLAGS", ""), shape=shape_name,
              num_sms=num_sms, rows=rows)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--shape", default="qwen3-like", choices=sorted({**common.SHAPES, **common.SMOKE_SHAPES}))
  ap.add_argument("--flags", default=None, choices=sorted(FLAG_SETS),
                  help="run in this process with these XLA flags already set (child mode)")
  ap.add_argument("--flag-sets", default="default,lhs")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  out = common.out_dir(args.out)
  if args.flags:
    res = run(args.shape, args.flags)
    common.write_json(os.path.join(out, f"_overlap_{args.flags}.json"), res)
    return
  results = []
  for name in args.flag_sets.split(","):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FLAG_SETS[name]).strip()
    proc = subprocess.run([sys.executable, "-m", "bench.overlap_probe", "--shape", args.shape,
                           "--flags", name, "--out", out], env=env)
    part = os.path.join(out, f"_overlap_{name}.json")
    if proc.returncode == 0 and os.path.exists(part):
      results.append(json.load(open(part)))
      os.remove(part)
    else:
      results.append(dict(flags=name, error=f"child exited {proc.returncode}"))
  devs = jax.devices()
  tag = devs[0].device_kind.replace(" ", "_")
  common.write_json(os.path.join(out, f"overlap_probe_{tag}_x{len(devs)}.json"),
                    dict(meta=common.run_metadata(), shape=args.shape, results=results))


if __name__ == "__main__":
  main()
