"""The UniEP guarantee on the GPU: every point of the parameter space gives the same bits.

For one MoE shape over all local GPUs (mesh data=1, expert=R; bf16; skewed
routing so that some experts are empty and one is hot), it computes the
forward output and the gradients of x and every parameter with:
  * the sequential reference: backend "pallas" (XLA collectives + our grouped GEMM),
  * backend "uniep" at every point of a sweep over the transfer knobs
    (chunk_rows, num_ctas, col_tile) for each grouped-GEMM tiling swept, and
    with the v2 fused kernels (`FUSED`: n_comm, recv_chunk_rows; swept right after
    the default transfer), and with the v1 dispatch (dedup_tokens=False; every other
    point runs uniep's default, the de-duplicated dispatch, or the v1 one where a
    fused backward moves dy itself), then the send-buffer dispatch (`SEND_BUFFER`:
    TransferConfig.gather_rows=False, the send rows gathered into a buffer before the
    transfer, the default until 2026-11-28; every other point reads them by index in the
    transfer's loads; per tiling the point after the fused ones: at one tiling,
    --start 8 begins with it), then the expansion inside the transfer's launch
    (`EXPANDED`: TransferConfig.expand_in_transfer; --start 9 at one tiling; then
    `EXPANDED_LAST_ON_ALL`, its last source's copies on the transfer CTAs too),
  * each "uniep" point three times,
and records a bitwise checksum of each (`uniep_jax.tune.tree_checksum`). The
points go round-robin over the tilings (`sweep_order`), so that a run cut by
--budget-s has covered every tiling with its default transfer first.
Points with the same KernelConfig must all agree with "pallas" of that
KernelConfig (the transfer only moves rows). Across different block_k the
accumulation order over K differs, so only equality within a tiling is required;
the sweep also reports which tilings agree with each other.

  python -m bench.determinism_sweep [--shape tiny-gpu|qwen3-like|...] [--ep R] [--out DIR]
                                   [--start N]

Each point is compiled once (ahead, in --compile-workers threads) and run three times.
Writes determinism_sweep_<device>_ep<R>[_from<N>].json; exits 1 on any mismatch.
Results: bench/results/determinism_sweep_*.json (2x H100: 38 of the 50 points, the v2
fused ones not yet reached).
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
from uniep_jax.tune import reference_kernel, tree_checksum

# A shape that compiles fast and still has many experts per rank and ragged groups.
SWEEP_SHAPES = {"tiny-gpu": common.MoEShape("tiny-gpu", 2048, 1024, 512, 32, 4)}

TILINGS = [uniep_jax.KernelConfig(),                                  # 128/128/64, 3 stages
           uniep_jax.KernelConfig(max_concurrent_steps=4),
           uniep_jax.KernelConfig(block_k=128, max_concurrent_steps=3),
           uniep_jax.KernelConfig(block_m=64),
           uniep_jax.KernelConfig(epilogue_slots=2),
           uniep_jax.KernelConfig(raster_rows=4),   # tiles in bands (auto is row-major here)
           # block-aligned row tiles (the default cuts them from each expert's first row)
           uniep_jax.KernelConfig(group_aligned_tiles=False)]
TRANSFERS = [uniep_jax.TransferConfig(chunk_rows=c, num_ctas=n, col_tile=t)
             for c, n, t in itertools.product((32, 128), (16, 64), (128, 256))]
# the de-duplicated dispatches' send rows gathered into a send buffer first (the other
# points read them by index in the transfer's loads, TransferConfig's default)
SEND_BUFFER = uniep_jax.TransferConfig(gather_rows=False)
# the owner's expansion of the unique rows inside the transfer's launch (EXPERIMENTAL)
EXPANDED = uniep_jax.TransferConfig(expand_in_transfer=True)
EXPANDED_LAST_ON_ALL = uniep_jax.TransferConfig(expand_in_transfer=True, expand_last_on_all=True)
# the v2 fused kernels (EXPERIMENTAL), with the default transfer: B a multiple of every
# tiling's block_m
FUSED = [uniep_jax.FusedConfig(n_comm=16, recv_chunk_rows=512),
         uniep_jax.FusedConfig(n_comm=48, recv_chunk_rows=2048),
         # Kernel A with v1's down GEMM and return, and the fused backward (EXPERIMENTAL)
         uniep_jax.FusedConfig(n_comm=16, recv_chunk_rows=512, return_in_kernel=False,
                               backward=True),
         # v2.2: the dX return beside the dw_gate_up wgrad; Kernel C (the down GEMM with
         # its finished chunks sent back beside it)
         uniep_jax.FusedConfig(n_comm=16, recv_chunk_rows=512, return_in_kernel=False,
                               wgrad_return_ctas=16),
         uniep_jax.FusedConfig(n_comm=16, recv_chunk_rows=512, return_in_kernel=False,
                               down_return_ctas=8, wgrad_return_ctas=8),
         # no Kernel A: the forward's dispatch de-duplicated (the point needs dedup_tokens)
         uniep_jax.FusedConfig(n_comm=16, recv_chunk_rows=512, return_in_kernel=False,
                               down_return_ctas=8, wgrad_return_ctas=8,
                               dispatch_in_kernel=False)]


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


def sweep_order(tilings: list, points: list) -> list:
  """(tiling, point) pairs round-robin over the tilings: every tiling's first point
  (the default transfer) before any tiling's second, so that a run cut by its time
  budget has covered every tiling."""
  return [(t, pt) for pt in points for t in tilings]


_LOWER_LOCK = threading.Lock()


def _compile(mesh, shape, cfg, x, p):
  """The forward output and the gradients of x and every parameter, compiled once:
  the three runs of a point are one program run three times (what arrival order
  could change), not three compilations. Lowerings run one at a time (Mosaic GPU's
  Python lowering keeps module-global state, as in uniep_jax.tune), XLA's compiles
  in parallel."""
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


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--shape", default="tiny-gpu")
  ap.add_argument("--ep", type=int, default=0)
  ap.add_argument("--budget-s", type=float, default=480)
  ap.add_argument("--out", default=None)
  ap.add_argument("--compile-workers", type=int, default=8)
  ap.add_argument("--start", type=int, default=0,
                  help="skip the first START points of the sweep order (a run cut by its "
                       "budget covered them; the pallas references are computed again)")
  ap.add_argument("--tilings", type=int, default=len(TILINGS),
                  help="sweep the first TILINGS tilings only (1: every transfer and fused "
                       "point at the default tiling, the other tilings left to another run)")
  args = ap.parse_args(argv)
  if not 1 <= args.tilings <= len(TILINGS):
    raise ValueError(f"--tilings={args.tilings} must be in [1, {len(TILINGS)}]")
  tilings = TILINGS[:args.tilings]
  t0 = time.time()
  shape = {**common.SHAPES, **SWEEP_SHAPES}[args.shape]
  ep = args.ep or len(jax.devices())
  mesh = jax.make_mesh((1, ep), ("data", "expert"), devices=jax.devices()[:ep])
  meta = common.run_metadata()
  print(meta, flush=True)
  x, p = _inputs(shape, mesh)
  points, mismatches, skipped = [], [], []
  reference = {}
  tag_of = lambda kc: (f"{kc.block_m}/{kc.block_n}/{kc.block_k}/s{kc.max_concurrent_steps}"  # noqa: E731
                       + ("/e2" if kc.epilogue_slots == 2 else "")
                       + (f"/r{kc.raster_rows}" if kc.raster_rows is not None else "")
                       + (f"/w{kc.wgrad_raster}" if kc.wgrad_raster is not None else "")
                       + ("/f1" if kc.mma_in_flight else "")
                       + ("" if kc.group_aligned_tiles else "/bt"))

  def write(partial=False):
    payload = dict(meta, benchmark="determinism_sweep", shape=shape.__dict__, ep=ep,
                   start=args.start, tilings=len(tilings), pallas_reference=reference, points=points,
                   mismatches=mismatches, skipped=skipped,
                   all_tilings_agree=len(set(reference.values())) == 1,
                   swept=sum("checksums" in r for r in points), partial=partial)
    kind = common.device_tag(meta)
    common.write_json(os.path.join(common.out_dir(args.out),
                                   f"determinism_sweep_{kind}_ep{ep}"
                                   + (f"_from{args.start}" if args.start else "")
                                   + (f"_tilings{args.tilings}" if args.tilings < len(TILINGS) else "")
                                   + (".partial" if partial else "") + ".json"), payload)
    return payload

  # Compilation dominates (~20 s a point on 2x H100): compile ahead in threads, in
  # sweep order, while earlier points run. Run it with XLA's deterministic ops (as
  # device_session's sweep phase does): XLA's GEMM autotuning would otherwise time
  # kernels while other compiles run, and could pick differently per program.
  pool = concurrent.futures.ThreadPoolExecutor(args.compile_workers)
  compile_ = lambda cfg: pool.submit(_compile, mesh, shape, cfg, x, p)  # noqa: E731
  # each tiling's reference walks its tiles row-major (`reference_kernel`): the tile
  # order (raster_rows, wgrad_raster) and the MMA waits (mma_in_flight) must not change a
  # bit either
  ref_jobs = {tag_of(kc): compile_(uniep_jax.UniEPConfig(backend="pallas",
                                                         kernel=reference_kernel(kc)))
              for kc in tilings}
  default_t = uniep_jax.TransferConfig()
  # the default transfer, then the v2 fused kernels (a different program, not only other
  # knobs of the same one), then the other transfers
  # (transfer, fused, dedup_tokens): None is uniep's default (auto: de-duplicated unless
  # a fused backward moves dy), False the v1 dispatch
  transfer_points = ([(default_t, None, None), (default_t, None, False)]
                     + [(default_t, fc, None) for fc in FUSED] + [(SEND_BUFFER, None, None), (EXPANDED, None, None),
                        (EXPANDED_LAST_ON_ALL, None, None)]
                     + [(tc, None, None) for tc in TRANSFERS if tc != default_t])
  order = sweep_order(tilings, transfer_points)[args.start:]
  # compiles run at most 2 x workers points ahead (a run cut by its budget then
  # waits for few compiles at exit)
  window = 2 * args.compile_workers
  jobs = collections.deque()

  def submit_next():
    i = len(jobs) + done[0]
    if i < len(order):
      kc, (tc, fc, dd) = order[i]
      jobs.append(compile_(uniep_jax.UniEPConfig(backend="uniep", kernel=kc, transfer=tc,
                                                 fused=fc, dedup_tokens=dd)))
  done = [0]
  for _ in range(window):
    submit_next()
  for tag, job in ref_jobs.items():
    try:
      reference[tag] = _checksums(job.result(), x, p)
    except Exception as e:  # noqa: BLE001
      traceback.print_exc(limit=2)
      points.append(dict(kernel=tag, backend="pallas", error=repr(e)[:300]))
  for kc, (tc, fc, dd) in order:
    job = jobs.popleft() if jobs else None   # past the budget the queue runs dry
    done[0] += 1
    tag = tag_of(kc)
    if time.time() - t0 > args.budget_s:   # past the budget: nothing more is compiled
      if job is not None:
        job.cancel()
      skipped.append(dict(kernel=tag, transfer=str(tc), fused=str(fc), dedup_tokens=dd,
                          why="time budget"))
      continue
    submit_next()
    if tag not in reference:   # its pallas reference failed (recorded above)
      job.cancel()
      continue
    row = dict(kernel=tag, chunk_rows=tc.chunk_rows, num_ctas=tc.num_ctas, col_tile=tc.col_tile,
               gather_rows=tc.gather_rows, expand_in_transfer=tc.expand_in_transfer,
               expand_last_on_all=tc.expand_last_on_all,
               fused=None if fc is None else dataclasses.asdict(fc),   # every field
               dedup_tokens=uniep_jax.UniEPConfig(backend="uniep", fused=fc,
                                                  dedup_tokens=dd).use_dedup_tokens)
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
  # running for a point past the budget would hold the exit (2x H100: 40 s past the
  # phase's limit); everything is written by now
  os._exit(code)
