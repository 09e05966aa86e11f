"""Every point of the "uniep" parameter space gives the same bits as backend "pallas".

For one MoE shape over the local GPUs (mesh data=1, expert=R; bfloat16; a skewed
routing where one expert is hot and one is empty) it computes the forward output and
the gradients of x and of every parameter
  * with backend "pallas" (XLA collectives + the grouped GEMM) for each grouped-GEMM
    tiling of `TILINGS`, its tiles walked row-major (`tuning.reference_kernel`): the
    reference of that tiling;
  * with backend "uniep" at every point of TILINGS x TRANSFERS x OVERLAPS: the
    grouped GEMM's tiling, the NVLink transfer's knobs (chunk_rows, num_ctas,
    col_tile) and the transfers inside GEMM launches (`OverlapConfig`, or none);
each "uniep" point three times, and records a bitwise checksum of each
(`uniep_jax.measure.tree_checksum`). A point must be repeatable and equal its tiling's
"pallas" reference: the transfer and overlap knobs only move rows, and the tile order
changes no bit. Across different block_k the accumulation order over K differs, so only
equality within a tiling is required; the JSON also says whether all tilings agree. At
EP 1 "uniep" runs its one-rank form ("pallas", no transfer, no overlap): the sweep then
checks the tilings only.

Points run in priority order, round robin over the tilings (`sweep_order`): the
default transfer without overlap, then the default transfer with each overlap point,
then the other transfers without overlap, then the other transfers with each overlap
point; so a run cut by --budget-s has covered every tiling at the most telling points
first. --start N skips the first N points of that order (covered by an earlier run);
--tilings / --transfers / --overlaps take the first few of each list.

  python -m bench.determinism_sweep [--shape tiny-gpu|qwen3-like|...] [--ep R] [--out DIR]
                                   [--budget-s S] [--start N] [--compile-workers W]

Each point is compiled once (ahead, in --compile-workers threads; run with
XLA_FLAGS=--xla_gpu_deterministic_ops=true so that XLA's GEMM autotuning does not time
kernels while other compiles run) and run three times.
Writes determinism_sweep_<device>_ep<R>[_from<N>].json (and a .partial.json after every
point); exits 1 on any mismatch or error.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import itertools
import os
import sys
import threading
import time
import traceback

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import uniep_jax
from bench import common
from uniep_jax.measure import tree_checksum
from uniep_jax.tuning import Candidate, kernel_label, reference_kernel

# A shape that compiles fast and still has many experts per rank and ragged groups.
SWEEP_SHAPES = {"tiny-gpu": common.MoEShape("tiny-gpu", 2048, 1024, 512, 32, 4)}

TILINGS = [uniep_jax.KernelConfig(),                                  # 128/128/64, 3 stages
           uniep_jax.KernelConfig(max_concurrent_steps=4),
           uniep_jax.KernelConfig(block_k=128, max_concurrent_steps=3),
           uniep_jax.KernelConfig(block_m=64),
           uniep_jax.KernelConfig(raster_rows=4, wgrad_raster=2)]   # tiles walked in bands
# the default transfer first
TRANSFERS = [uniep_jax.TransferConfig()] + [
    t for t in (uniep_jax.TransferConfig(chunk_rows=c, num_ctas=n, col_tile=w)
                for c, n, w in itertools.product((32, 128), (16, 64), (128, 256)))
    if t != uniep_jax.TransferConfig()]
# None: every transfer its own launch; then the down GEMM's return and the wgrad's dX
# return inside the GEMM launches, together (16 CTAs each; 4 each in short chunks, chunk
# rows a multiple of every tiling's block_m) and each alone
OVERLAPS = [None,
            uniep_jax.OverlapConfig(),
            uniep_jax.OverlapConfig(down_return_ctas=4, wgrad_return_ctas=4, chunk_rows=512),
            uniep_jax.OverlapConfig(down_return_ctas=16, wgrad_return_ctas=0),
            uniep_jax.OverlapConfig(down_return_ctas=0, wgrad_return_ctas=16)]


def _inputs(shape, mesh):
  e, h, f = shape.experts, shape.hidden, shape.ffn
  r = mesh.size
  k = jax.random.split(jax.random.key(3), 5)
  bf = jnp.bfloat16
  bias = jnp.zeros((e,), jnp.float32).at[1].set(1e3).at[e - 1].set(-1e3)  # hot and empty experts
  p = uniep_jax.MoEParams(
      router=jax.random.normal(k[0], (h, e), jnp.float32) * h ** -0.5,
      w_gate_up=(jax.random.normal(k[1], (e, h, 2 * f)) * h ** -0.5).astype(bf),
      w_down=(jax.random.normal(k[3], (e, f, h)) * f ** -0.5).astype(bf),
      expert_bias=bias)
  x = jax.random.normal(k[4], (r * shape.tokens, h)).astype(bf)
  specs = uniep_jax.param_specs(p)
  x = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
  p = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), p, specs)
  return x, p


def transfer_points(transfers: list, overlaps: list) -> list:
  """(transfer, overlap) pairs in priority order: the first transfer (the default)
  without overlap, then with each overlap point, then every other transfer without
  overlap, then the other transfers with each overlap point."""
  first, rest = transfers[:1], transfers[1:]
  plain, over = overlaps[:1], overlaps[1:]
  return ([(t, o) for t in first for o in plain] + [(t, o) for t in first for o in over]
          + [(t, o) for t in rest for o in plain] + [(t, o) for o in over for t in rest])


def sweep_order(tilings: list, points: list) -> list:
  """(tiling, point) pairs round-robin over the tilings: every tiling's first point
  before any tiling's second, so that a run cut by its time budget has covered every
  tiling."""
  return [(t, pt) for pt in points for t in tilings]


_LOWER_LOCK = threading.Lock()


def _compile(mesh, shape, cfg, x, p):
  """The forward output and the gradients of x and every parameter, compiled once:
  the three runs of a point are one program run three times (what arrival order
  could change), not three compilations. Lowerings run one at a time (Mosaic GPU's
  Python lowering keeps module-global state), XLA's compiles in parallel."""
  def loss(x, p):
    y, aux = uniep_jax.moe_ffn(x, p, mesh=mesh, top_k=shape.top_k, config=cfg)
    w = jnp.cos(jnp.arange(y.shape[-1], dtype=jnp.float32))
    return jnp.sum(y.astype(jnp.float32) * w) + aux["load_balance_loss"], y

  with _LOWER_LOCK:
    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)).lower(x, p)
  return lowered.compile()


def _checksums(compiled, x, p):
  (_, y), g = compiled(x, p)
  return tree_checksum(y), tree_checksum(g)


def _first(ap, flag: str, n: int, items: list) -> list:
  if not 1 <= n <= len(items):
    ap.error(f"{flag}={n} must be in [1, {len(items)}]")
  return items[:n]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--shape", default="tiny-gpu")
  ap.add_argument("--ep", type=int, default=0)
  ap.add_argument("--budget-s", type=float, default=480)
  ap.add_argument("--out", default=None)
  ap.add_argument("--compile-workers", type=int, default=8)
  ap.add_argument("--start", type=int, default=0,
                  help="skip the first START points of the sweep order (an earlier run "
                       "covered them; the pallas references are computed again)")
  ap.add_argument("--tilings", type=int, default=len(TILINGS),
                  help="sweep the first TILINGS tilings only (1: the default tiling)")
  ap.add_argument("--transfers", type=int, default=len(TRANSFERS),
                  help="sweep the first TRANSFERS transfer points only (1: the default)")
  ap.add_argument("--overlaps", type=int, default=len(OVERLAPS),
                  help="sweep the first OVERLAPS overlap points only (1: no overlap)")
  args = ap.parse_args(argv)
  tilings = _first(ap, "--tilings", args.tilings, TILINGS)
  transfers = _first(ap, "--transfers", args.transfers, TRANSFERS)
  overlaps = _first(ap, "--overlaps", args.overlaps, OVERLAPS)
  common.dump_stacks_on_usr1()
  t0 = time.time()
  shape = {**common.SHAPES, **SWEEP_SHAPES}[args.shape]
  ep = args.ep or len(jax.devices())
  mesh = jax.make_mesh((1, ep), ("data", "expert"), devices=jax.devices()[:ep])
  meta = common.run_metadata()
  print(meta, flush=True)
  if ep == 1:
    print("EP 1: backend 'uniep' runs as 'pallas' (its one-rank form): only the tilings "
          "are checked", flush=True)
  x, p = _inputs(shape, mesh)
  points, mismatches, skipped = [], [], []
  reference = {}
  subset = "".join(f"_{flag}{n}" for flag, n, full in (
      ("tilings", args.tilings, TILINGS), ("transfers", args.transfers, TRANSFERS),
      ("overlaps", args.overlaps, OVERLAPS)) if n < len(full))

  def write(partial=False):
    payload = dict(meta, benchmark="determinism_sweep", shape=shape.__dict__, ep=ep,
                   start=args.start, tilings=len(tilings), transfers=len(transfers),
                   overlaps=len(overlaps), pallas_reference=reference, points=points,
                   mismatches=mismatches, skipped=skipped,
                   all_tilings_agree=len(set(reference.values())) == 1,
                   swept=sum("checksums" in r for r in points), partial=partial)
    kind = common.device_tag(meta)
    common.write_json(os.path.join(common.out_dir(args.out),
                                   f"determinism_sweep_{kind}_ep{ep}"
                                   + (f"_from{args.start}" if args.start else "") + subset
                                   + (".partial" if partial else "") + ".json"), payload)
    return payload

  # Compilation dominates: compile ahead in threads, in sweep order, while earlier
  # points run.
  pool = concurrent.futures.ThreadPoolExecutor(args.compile_workers)
  compile_ = lambda cfg: pool.submit(_compile, mesh, shape, cfg, x, p)  # noqa: E731
  # each tiling's reference walks its tiles row-major (`reference_kernel`): the tile
  # order (raster_rows, wgrad_raster) must not change a bit either
  ref_jobs = {kernel_label(kc): compile_(uniep_jax.UniEPConfig(backend="pallas",
                                                               kernel=reference_kernel(kc)))
              for kc in tilings}
  order = sweep_order(tilings, transfer_points(transfers, overlaps))[args.start:]
  # compiles run at most 2 x workers points ahead (a run cut by its budget then
  # waits for few compiles at exit)
  window = 2 * args.compile_workers
  jobs = collections.deque()

  def submit_next():
    i = len(jobs) + done[0]
    if i < len(order):
      kc, (tc, oc) = order[i]
      jobs.append(compile_(uniep_jax.UniEPConfig(backend="uniep", kernel=kc, transfer=tc,
                                                 overlap=oc)))
  done = [0]
  for _ in range(window):
    submit_next()
  for tag, job in ref_jobs.items():
    try:
      reference[tag] = _checksums(job.result(), x, p)
    except Exception as e:  # noqa: BLE001
      traceback.print_exc(limit=2)
      points.append(dict(kernel=tag, backend="pallas", error=repr(e)[:300]))
  for kc, (tc, oc) in order:
    job = jobs.popleft() if jobs else None   # past the budget the queue runs dry
    done[0] += 1
    tag = kernel_label(kc)
    label = Candidate(kc, tc, oc).label()
    if time.time() - t0 > args.budget_s:   # past the budget: nothing more is compiled
      if job is not None:
        job.cancel()
      skipped.append(dict(point=label, why="time budget"))
      continue
    submit_next()
    if tag not in reference:   # its pallas reference failed (recorded above)
      job.cancel()
      continue
    row = dict(point=label, kernel=tag, chunk_rows=tc.chunk_rows, num_ctas=tc.num_ctas,
               col_tile=tc.col_tile, overlap=None if oc is None else dataclasses.asdict(oc))
    try:
      compiled = job.result()
      runs = [_checksums(compiled, x, p) for _ in range(3)]
      row.update(checksums=runs[0], repeatable=all(r == runs[0] for r in runs),
                 equals_pallas=runs[0] == reference[tag])
      if not (row["repeatable"] and row["equals_pallas"]):
        mismatches.append(row)
        print("MISMATCH", row, file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001
      traceback.print_exc(limit=2)
      row["error"] = repr(e)[:300]
    points.append(row)
    write(partial=True)   # a hang in a later point (killed by the phase's limit) keeps these
    print(row, flush=True)
  pool.shutdown(wait=False, cancel_futures=True)
  payload = write()
  errors = sum("error" in r for r in points)
  print(f"{payload['swept']} points swept, {len(mismatches)} mismatches, {errors} errors, "
        f"{len(skipped)} skipped; tilings agree with each other: {payload['all_tilings_agree']}")
  return 1 if mismatches or errors else 0


if __name__ == "__main__":
  code = main()
  sys.stdout.flush()
  sys.stderr.flush()
  # not sys.exit: the interpreter would join the compile threads, and a compile still
  # running for a point past the budget would hold the exit; everything is written by now
  os._exit(code)
