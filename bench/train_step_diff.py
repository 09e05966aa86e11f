"""Where do two configurations' training steps part bits? One step, every gradient leaf.

The MoE layer alone is bitwise equal between "pallas" and "uniep" (and "uniep:overlap")
(bench/check_moe_gpu.py); whole training runs should be too (bench/train_throughput.py's
determinism runs). When they are not, this takes ONE train step's loss and gradients
(`train.loop.loss_fn`, or the per-shard gradients summed in rank order with
--grad-reduction ordered; same params, same batch) with each configuration, twice each,
and compares every leaf bit for bit:

  * a configuration against itself: run-to-run determinism of one compiled program;
  * configuration A against B: the same maths in two programs. Leaves that differ point
    at the cause: only the parameters whose gradients are summed across the mesh
    (attention, norms, embedding, router) suggests the collectives (XLA combines
    all-reduces differently in the two programs, and NCCL's reduction order follows the
    buffer layout); expert weights too suggests the MoE layer.

--backends takes training configurations (bench/train_throughput.py, `parse_backend`:
the names of bench/common.py's `layer_config` that TrainConfig can express, e.g.
pallas,uniep,uniep:overlap).

  python -m bench.train_step_diff [--model mixtral-like] [--layers 1] [--mesh data=1,expert=4]
      [--backends pallas,uniep] [--batch 8] [--seq 2048] [--xla-deterministic] [--tag T] [--out DIR]

XLA and NCCL flags are process-wide: run the script once per setting (XLA_FLAGS,
NCCL_ALGO, ...); `--tag` names the JSON (train_step_diff_<device>_<tag>.json).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from train.config import GRAD_REDUCTIONS


def _one_backend(model: str, layers, mesh: str, backend: str, batch: int, seq: int, data,
                 grad_reduction: str = "xla"):
  """Two calls of one compiled step of configuration `backend`. Gradients stay on the devices (the comparisons
  run there: a mixtral-like layer's gradients are ~7 GB in float32); the parameters
  are summarised by their bit checksum. grad_reduction "ordered": the training step's
  per-shard gradients summed in rank order (`train.loop.ordered_grads`; clipped, as
  that step applies them)."""
  import jax
  from bench.train_throughput import _register_variant, train_config
  from train import loop
  from uniep_jax.measure import tree_checksum

  name = _register_variant(model, layers)
  cfg = train_config(backend, config=name, mesh=mesh, batch=batch, seq=seq, steps=2,
                     out="/tmp/train_step_diff", progress=False, plot=False,
                     grad_reduction=grad_reduction)
  s = loop.make_setup(cfg)
  params, rest, _ = loop.init_state(s)
  x, y = (jax.device_put(a, s.batch_sh) for a in data.batch(cfg.seed, 0, batch, seq))
  if grad_reduction == "ordered":
    per_shard = jax.jit(loop.ordered_grads(s))

    def fn(p):
      grads, ce, lb, z, aux, _ = per_shard(p, rest, x, y)
      return (loop.total_loss(cfg, ce, lb, z), (ce, lb, z, aux)), grads
  else:
    fn = jax.jit(jax.value_and_grad(lambda p: loop.loss_fn(s, p, rest, x, y), has_aux=True))
  runs = []
  for _ in range(2):
    t0 = time.perf_counter()
    (loss, (ce, lb, z, aux)), grads = fn(params)
    jax.block_until_ready(grads)
    runs.append(dict(seconds=time.perf_counter() - t0, scalars=dict(loss=loss, ce=ce, lb=lb, z=z),
                     counts=np.asarray(jax.device_get(aux["expert_counts"])), grads=grads))
  return tree_checksum(params), runs


def _bits(a):
  """The bits of `a` as unsigned integers of its width (bitwise equality: NaNs and -0 too)."""
  import jax
  import jax.numpy as jnp
  a = jnp.asarray(a)
  return jax.lax.bitcast_convert_type(a, jnp.dtype(f"uint{a.dtype.itemsize * 8}"))


def compare(a: dict, b: dict) -> dict:
  """Per leaf of two flat dicts of arrays (on the devices or not): bitwise?, max |a-b|,
  max |a-b| / max |a|, computed where the arrays are, in float32."""
  import jax.numpy as jnp
  out = {}
  for k in sorted(a):
    x, y = jnp.asarray(a[k]), jnp.asarray(b[k])
    x32, y32 = x.astype(jnp.float32), y.astype(jnp.float32)
    diff = float(jnp.max(jnp.abs(x32 - y32))) if x.size else 0.0
    scale = float(jnp.max(jnp.abs(x32))) if x.size else 0.0
    out[k] = dict(bitwise=bool(jnp.array_equal(_bits(x), _bits(y))), max_abs_diff=diff,
                  max_rel_diff=diff / max(scale, 1e-30))
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default="mixtral-like")
  ap.add_argument("--layers", type=int, default=1, help="0: the config's own")
  ap.add_argument("--mesh", default="")
  ap.add_argument("--backends", default="pallas,uniep",
                  help="comma list of training configurations (train_throughput.parse_backend)")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--xla-deterministic", action="store_true")
  ap.add_argument("--grad-reduction", default="ordered", choices=GRAD_REDUCTIONS,
                  help="as train --grad-reduction (default ordered)")
  ap.add_argument("--tag", default="default")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  from bench import common
  from bench.train_throughput import train_config
  backends = [b for b in args.backends.split(",") if b]
  for backend in backends:   # a bad name fails before any step compiles
    try:
      train_config(backend, grad_reduction=args.grad_reduction)
    except ValueError as e:
      ap.error(f"--backends {backend!r}: {e}")
  common.start_training_process(args.xla_deterministic)
  import jax

  from train.data import make_dataset

  mesh = args.mesh or f"data=1,expert={len(jax.devices())}"
  meta = common.run_metadata()
  data = make_dataset(None, max_bytes=4 << 20, heldout_fraction=0.05, seq=args.seq)
  results, params0 = {}, None
  for backend in backends:
    params_checksum, runs = _one_backend(args.model, args.layers or None, mesh, backend,
                                         args.batch, args.seq, data, args.grad_reduction)
    params0 = params0 or params_checksum
    same_init = params_checksum == params0
    results[backend] = dict(runs=runs, same_init=same_init)
    print(backend, "loss", float(runs[0]["scalars"]["loss"]), "first call",
          round(runs[0]["seconds"], 1), "s; same init:", same_init, flush=True)

  report = dict(meta, benchmark="train_step_diff", settings=dict(
      vars(args), mesh=mesh, xla_flags=os.environ.get("XLA_FLAGS", ""),
      nccl_algo=os.environ.get("NCCL_ALGO", "")), backends={}, pairs={})
  for backend, r in results.items():
    g = compare(r["runs"][0]["grads"], r["runs"][1]["grads"])
    s = compare(r["runs"][0]["scalars"], r["runs"][1]["scalars"])
    report["backends"][backend] = dict(
        same_init=r["same_init"], repeat_scalars=s, repeat_grads=g,
        repeatable=all(v["bitwise"] for v in {**g, **s}.values()),
        loss=float(r["runs"][0]["scalars"]["loss"]))
    print(f"{backend}: run-to-run bitwise: {report['backends'][backend]['repeatable']}", flush=True)
  for i, a in enumerate(backends):
    for b in backends[i + 1:]:
      ra, rb = results[a]["runs"][0], results[b]["runs"][0]
      g, s = compare(ra["grads"], rb["grads"]), compare(ra["scalars"], rb["scalars"])
      counts_equal = bool(np.array_equal(ra["counts"], rb["counts"]))
      differing = sorted(k for k, v in g.items() if not v["bitwise"])
      report["pairs"][f"{a}_vs_{b}"] = dict(scalars=s, grads=g, expert_counts_equal=counts_equal,
                                            differing_grads=differing)
      print(f"{a} vs {b}: scalars bitwise {[k for k, v in s.items() if v['bitwise']]}, "
            f"expert counts equal {counts_equal}; {len(differing)} of {len(g)} gradient "
            f"leaves differ:", flush=True)
      for k in differing:
        print(f"   {k}: max rel diff {g[k]['max_rel_diff']:.2e}", flush=True)
  out = common.out_dir(args.out)
  kind = common.device_tag(meta)
  common.write_json(os.path.join(out, f"train_step_diff_{kind}_{args.tag}.json"), report)
  return 0


if __name__ == "__main__":
  sys.exit(main())
