"""MoE layer benchmark: every backend on the target shapes over all local GPUs.

For each shape of targets.md (per-rank sizes) on a mesh data=1, expert=R (R = the
GPUs of this host, or --ep), forward and forward+backward, and each routing of
--routings (`make_inputs`):
  balanced  a random router on random tokens;
  skewed    an expert-selection bias puts expert 0 in every token's top-k (all to one);
  zipf      each token's K experts drawn without replacement with probabilities
            proportional to a Zipf law of exponent 1.2 over the experts, their
            popularity order a fixed random permutation (`zipf_popularity`, shared with
            bench/replication.py and the autotuner's --routing zipf) so that the hot
            experts fall on several ranks instead of all on rank 0 by index (a
            heavy-tailed load between the other two);
it times each backend and, in the same run:
  * the compute floor: forward FLOPs per rank (x3 for fwd+bwd) over the dense
    bf16 matmul rate measured here (cuBLAS, 8192^3);
  * the communication floor: dispatch + combine bytes per rank (x2 for fwd+bwd)
    over the all_to_all bandwidth measured here (NCCL, dispatch-sized buffer);
  * both floors again for the hottest rank of the case's routing (its expert rows, its
    off-rank rows sent or received; rank_rows has the whole [src][dst] matrix): a
    dropless layer waits for that rank, so under the skewed routing these are its
    bound (x_over_hot_rank_floor), while x_over_floor keeps the balanced work split.
Configurations by name (bench/common.py, `layer_config`), e.g. "xla_capacity" (cf 1.25;
dropped assignments reported), "xla_dropless" (ragged_all_to_all), "xla_dropless:padded"
(all_to_all of worst-case buffers), "pallas" (XLA collectives + our grouped GEMM),
"uniep", "uniep:overlap", "pallas:fp8" (precision="fp8").

  python -m bench.moe_layer [--shapes a,b] [--backends ...] [--budget-s 480] [--out DIR]

Cases run in priority order and stop when the time budget is spent; skipped
cases are listed in the JSON. Median ms per call; ratios are same-run ratios.
After a case's backends are timed one after another, --interleaved-trials (default 5)
rounds time one batch of each in turn (interleaved_median_ms, and its ratio to
xla_capacity): a drift of the machine over the run (the backend timed last reading
slower) then reaches every backend alike.
--compile-workers N > 1: each shape's programs are compiled ahead (`compile_ahead`: the
xla_* baselines first and alone, then the rest in N threads), then timed one at a time
(compile_s: a program's own lower + compile).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import threading
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import uniep_jax
from bench import common
from uniep_jax.measure import tree_checksum

def backend_config(name: str) -> uniep_jax.UniEPConfig:
  """The configuration a name stands for (`bench.common.layer_config`)."""
  return common.layer_config(name)


ROUTINGS = ("balanced", "skewed", "zipf")
zipf_popularity = common.zipf_popularity   # uniep_jax.measure: one skew for every benchmark


def make_inputs(shape: common.MoEShape, mesh, *, routing: str = "balanced", seed: int = 0):
  """Sharded bf16 x [R*T, H] and params, created on the devices, routing as `routing`
  (one of ROUTINGS; the module docstring). Every routing has the same shapes and
  dtypes, so one compiled program runs them all.

  zipf: the router is [I_E; 0] (the first E features of x are the logits) and those
  features hold log p + Gumbel noise per token (p = `zipf_popularity`): the top-k of
  log p + Gumbel noise is K draws without replacement with probabilities p (the
  Gumbel-top-k trick); the other H - E features stay random. x is bfloat16: the logits
  are rounded to it, and near-ties fall to the routing's tie-break.
  """
  if routing not in ROUTINGS:
    raise ValueError(f"routing={routing!r} is unknown; expected one of {ROUTINGS}")
  r = mesh.shape["expert"] * mesh.shape["data"]
  e, h, f = shape.experts, shape.hidden, shape.ffn
  if routing == "zipf" and h < e:
    raise ValueError(f"routing 'zipf' writes the logits into x's first E features: "
                     f"hidden={h} must be >= experts={e}")
  log_p = np.log(zipf_popularity(e)).astype(np.float32)
  specs = uniep_jax.MoEParams(router=P(), w_gate_up=P("expert"), w_down=P("expert"),
                              expert_bias=P())
  shard = lambda s: NamedSharding(mesh, s)  # noqa: E731

  def init(key):
    k = jax.random.split(key, 5)
    bf = jnp.bfloat16
    bias = jnp.zeros((e,), jnp.float32)
    if routing == "skewed":
      bias = bias.at[0].set(1e3)
    router = jax.random.normal(k[0], (h, e), jnp.float32) * h ** -0.5
    x = jax.random.normal(k[4], (r * shape.tokens, h), bf)
    if routing == "zipf":
      router = jnp.eye(h, e, dtype=jnp.float32)                               # [I_E; 0]
      logits = jnp.asarray(log_p) + jax.random.gumbel(k[2], (r * shape.tokens, e))
      x = x.at[:, :e].set(logits.astype(bf))                                 # [R*T, H]
    p = uniep_jax.MoEParams(
        router=router,
        w_gate_up=(jax.random.normal(k[1], (e, h, 2 * f), bf) * h ** -0.5).astype(bf),
        w_down=(jax.random.normal(k[3], (e, f, h), bf) * f ** -0.5).astype(bf),
        expert_bias=bias)
    return x, p

  out_sh = (shard(P(("data", "expert"))), jax.tree.map(shard, specs))
  return jax.jit(init, out_shardings=out_sh)(jax.random.key(seed))


def rank_loads(mesh, x, p, shape: common.MoEShape, ranks: int) -> dict:
  """Rows each rank sends to each rank under this routing (no de-duplication).

  A dropless layer is as slow as its hottest rank: under the skewed routing, the rank
  owning expert 0 receives every token once more, so the floors of the balanced
  routing (every rank doing 1/R of the work) do not bound it. Returns the [R, R] matrix
  rows[src][dst], the hottest rank's expert rows (GEMM work), its largest send or
  receive volume off the rank (NVLink traffic) and the most loaded expert's count over
  the mean count (max_expert_load: 1 balanced, E/K all to one).
  """
  cfg = uniep_jax.UniEPConfig()

  def count(x, router, bias):
    out = uniep_jax.route(x, router, shape.top_k, cfg.routing, bias)
    # replicated, so that the reshape by source rank is a plain one
    topk = jax.sharding.reshard(out.topk_experts, NamedSharding(mesh, P()))
    dst = topk.reshape(ranks, -1) // (shape.experts // ranks)                   # [R, T*K]
    per_expert = jnp.sum(topk.reshape(-1, 1) == jnp.arange(shape.experts)[None, :], axis=0)
    return jnp.sum(dst[:, :, None] == jnp.arange(ranks)[None, None, :], axis=1), per_expert

  m, per_expert = jax.device_get(jax.jit(count)(x, p.router, p.expert_bias))
  m, per_expert = m.tolist(), per_expert.tolist()
  off = [[m[s][d] if s != d else 0 for d in range(ranks)] for s in range(ranks)]
  send = [sum(row) for row in off]
  recv = [sum(off[s][d] for s in range(ranks)) for d in range(ranks)]
  return dict(rows=m, hot_rank_expert_rows=max(sum(m[s][d] for s in range(ranks))
                                               for d in range(ranks)),
              hot_rank_offrank_rows=max(send + recv),
              max_expert_load=max(per_expert) * shape.experts / sum(per_expert))


def layer_fns(mesh, shape, cfg):
  def fwd(x, p):
    y, aux = uniep_jax.moe_ffn(x, p, mesh=mesh, top_k=shape.top_k, config=cfg)
    return y, aux["dropped"]

  def loss(x, p):
    y, aux = uniep_jax.moe_ffn(x, p, mesh=mesh, top_k=shape.top_k, config=cfg)
    return jnp.sum(y.astype(jnp.float32)) + 1e-2 * aux["load_balance_loss"]

  fwdbwd = jax.grad(loss, argnums=(0, 1))
  return jax.jit(fwd), jax.jit(fwdbwd)


# Mosaic GPU's Python lowering keeps module-global state: lowerings one at a time, XLA's
# compiles in parallel (as uniep_jax.autotune's and bench/determinism_sweep.py's workers)
_LOWER_LOCK = threading.Lock()


def _compile(fn, x, p):
  """(the compiled executable, seconds to lower and compile it)."""
  t0 = time.time()
  with _LOWER_LOCK:
    lowered = fn.lower(x, p)
  return lowered.compile(), time.time() - t0


def compile_ahead(fns: dict, pairs, x, p, workers: int) -> dict:
  """{(backend, direction): Future of _compile's pair} for every pair, all done on
  return: the "xla_*" backends first, one at a time (XLA:GPU autotunes their GEMMs by
  timing them on the GPU: on an otherwise idle device, as when compiled alone, so the
  baselines get the kernels they would get), then the others in `workers` threads.
  Nothing is timed while they compile."""
  def submit_now(pair):
    done = concurrent.futures.Future()
    try:
      done.set_result(_compile(fns[pair[0]][pair[1] != "fwd"], x, p))
    except Exception as e:  # noqa: BLE001
      done.set_exception(e)
    return done

  out = {pair: submit_now(pair) for pair in pairs if pair[0].startswith("xla_")}
  with concurrent.futures.ThreadPoolExecutor(workers, "moe-layer-compile") as pool:
    for pair in pairs:
      if pair not in out:
        out[pair] = pool.submit(_compile, fns[pair[0]][pair[1] != "fwd"], x, p)
  return out


def all_to_all_gbps(mesh, shape: common.MoEShape) -> dict:
  """Per-rank send bandwidth of lax.all_to_all moving one dispatch's rows; on GPUs also
  that of lax.ragged_all_to_all moving the same rows into a worst-case receive buffer
  (R x the rows, source-major), the collective of the "ragged" transport (`ragged_ms`,
  `ragged_gbps`), so that a slow ragged collective shows apart from the layer."""
  r = mesh.size
  if r == 1:   # one GPU: nothing to send, no communication floor
    return {}
  axes = ("data", "expert")
  rows = shape.tokens * shape.top_k
  rows -= rows % r
  spec = P(axes)

  def body(buf):
    return jax.lax.all_to_all(buf, axes, 0, 0, tiled=True)

  def ragged_body(buf):
    chunk = buf.shape[0] // r
    sizes = jnp.full((r,), chunk, jnp.int32)
    me = jax.lax.axis_index(axes).astype(jnp.int32)
    out = jnp.zeros((r * buf.shape[0], buf.shape[1]), buf.dtype)
    return jax.lax.ragged_all_to_all(buf, out, jnp.arange(r, dtype=jnp.int32) * chunk, sizes,
                                     jnp.full((r,), me * chunk, jnp.int32), sizes,
                                     axis_name=axes)

  buf = jax.jit(lambda k: jax.random.normal(k, (r * rows, shape.hidden), jnp.bfloat16),
                out_shardings=NamedSharding(mesh, spec))(jax.random.key(1))
  sent = rows * shape.hidden * 2 * (r - 1) / r
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))
  t = common.time_ms(f, buf, trials=9, min_batch_s=0.05)
  res = dict(ms=t["median_ms"], bytes_per_rank=sent, gbps=sent / (t["median_ms"] * 1e-3) / 1e9)
  if mesh.devices.flat[0].platform == "gpu":   # ragged_all_to_all compiles on GPUs only
    g = jax.jit(jax.shard_map(ragged_body, mesh=mesh, in_specs=spec, out_specs=spec,
                              check_vma=False))
    t = common.time_ms(g, buf, trials=9, min_batch_s=0.05)
    res.update(ragged_ms=t["median_ms"], ragged_gbps=sent / (t["median_ms"] * 1e-3) / 1e9)
  return res


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--shapes", default=",".join(common.SHAPES))
  ap.add_argument("--backends", default="xla_capacity,xla_dropless,pallas,uniep,uniep:overlap",
                  help="comma list of configuration names (bench/common.py, layer_config)")
  ap.add_argument("--directions", default="fwd,fwdbwd")
  ap.add_argument("--routings", default=",".join(ROUTINGS),
                  help=f"comma list of {', '.join(ROUTINGS)} (the module docstring)")
  ap.add_argument("--ep", type=int, default=0, help="GPUs to use (default: all)")
  ap.add_argument("--budget-s", type=float, default=480.0)
  ap.add_argument("--out", default=None)
  ap.add_argument("--min-batch-s", type=float, default=0.5,
                  help="each timed batch of back-to-back calls lasts at least this long")
  ap.add_argument("--max-reps", type=int, default=20, help="calls per timed batch, at most")
  ap.add_argument("--interleaved-trials", type=int, default=5,
                  help="after a case's backends: this many rounds of one batch per backend, "
                       "round robin (interleaved_median_ms); 0: none")
  ap.add_argument("--compile-workers", type=int, default=1,
                  help="> 1: every program of a shape compiled ahead, in that many threads "
                       "(`compile_ahead`), before any is timed; 1: each at its first call")
  args = ap.parse_args(argv)
  if args.compile_workers < 1:
    raise ValueError(f"--compile-workers={args.compile_workers} must be >= 1")
  bad = sorted(set(r for r in args.routings.split(",") if r) - set(ROUTINGS))
  if bad:
    raise ValueError(f"--routings: unknown {bad}; expected some of {ROUTINGS}")
  t_start = time.time()
  for backend in (b for b in args.backends.split(",") if b):
    backend_config(backend)   # a bad name or combination fails now, not after others ran
  devs = jax.devices()
  ep = args.ep or len(devs)
  mesh = jax.make_mesh((1, ep), ("data", "expert"), devices=devs[:ep])
  meta = common.run_metadata()
  print(meta, flush=True)
  dense = common.dense_matmul_tflops()
  print(f"dense bf16 matmul: {dense:.0f} TFLOP/s", flush=True)
  results, skipped = [], []
  backends = [b for b in args.backends.split(",") if b]
  for name in args.shapes.split(","):
    shape = {**common.SHAPES, **common.SMOKE_SHAPES}[name]
    try:
      a2a = all_to_all_gbps(mesh, shape)
    except Exception as e:  # noqa: BLE001
      a2a = dict(error=repr(e)[:300])
    print(f"[{name}] all_to_all {a2a}", flush=True)
    # one pair of jitted functions per backend for all routings of this shape: the
    # routings differ only in the data (the expert bias), so the second one runs the
    # executable the first compiled
    fns, ran = {}, set()   # ran: (backend, direction) compiled and run
    ahead = {}             # compile_ahead's futures, when --compile-workers > 1
    for routing in args.routings.split(","):
      try:
        x, p = make_inputs(shape, mesh, routing=routing)
        loads = rank_loads(mesh, x, p, shape, ep)
      except Exception as e:  # noqa: BLE001
        skipped.append(dict(shape=name, routing=routing, why=repr(e)[:300]))
        continue
      if args.compile_workers > 1 and not ahead:
        for backend in backends:
          fns[backend] = layer_fns(mesh, shape, backend_config(backend))
        t0 = time.time()
        ahead = compile_ahead(fns, [(b, d) for b in backends
                                    for d in args.directions.split(",")],
                              x, p, args.compile_workers)
        print(f"[{name}] compiled {len(ahead)} programs ahead in {time.time() - t0:.0f} s "
              f"({args.compile_workers} workers)", flush=True)
      for direction in args.directions.split(","):
        mult = 1 if direction == "fwd" else 3
        compute_floor = shape.fwd_flops_per_rank() * mult / (dense * 1e12) * 1e3
        comm_floor = (2 * shape.dispatch_bytes_per_rank(ep) * (1 if direction == "fwd" else 2)
                      / (a2a["gbps"] * 1e9) * 1e3) if "gbps" in a2a else None
        # the same floors for the hottest rank of this routing (rows per rank: T*K when
        # balanced): what a dropless backend can reach without moving experts
        balanced_rows = shape.tokens * shape.top_k
        hot_compute = compute_floor * loads["hot_rank_expert_rows"] / balanced_rows
        hot_comm = (comm_floor if comm_floor is None or ep == 1 else
                    comm_floor * loads["hot_rank_offrank_rows"] / (balanced_rows * (ep - 1) / ep))
        row_base = dict(shape=name, routing=routing, direction=direction, ep=ep,
                        compute_floor_ms=compute_floor, comm_floor_ms=comm_floor,
                        hot_rank_compute_floor_ms=hot_compute, hot_rank_comm_floor_ms=hot_comm,
                        rank_rows=loads["rows"], max_expert_load=loads["max_expert_load"],
                        receive_buffer_bytes=uniep_jax.receive_buffer_bytes(
                            shape.tokens, shape.top_k, shape.hidden, ep),
                        collectives=a2a)   # all_to_all_gbps: the transports' collectives alone
        timed = {}   # backend -> (fn, row): the interleaved pass below
        for backend in backends:
          if time.time() - t_start > args.budget_s:
            skipped.append(dict(shape=name, routing=routing, direction=direction,
                                backend=backend, why="time budget"))
            continue
          cfg = backend_config(backend)
          row = dict(row_base, backend=backend)
          if cfg.backend == "uniep" and ep > 1:   # de-duplication's unique receive buffer
            row["unique_receive_bytes"] = uniep_jax.unique_receive_bytes(shape.tokens,
                                                                         shape.hidden, ep)
          try:
            # compile_s is a plain call when an earlier routing ran this executable
            row["executable_reused"] = (backend, direction) in ran
            if backend not in fns:
              fns[backend] = layer_fns(mesh, shape, cfg)
            fn = fns[backend][0 if direction == "fwd" else 1]
            t0 = time.time()
            if (backend, direction) in ahead:   # compiled ahead: its own lower + compile
              fn, seconds = ahead[(backend, direction)].result()
              if not row["executable_reused"]:
                row["compile_s"], row["compiled_ahead"] = seconds, True
            common.block(fn(x, p))
            row.setdefault("compile_s", time.time() - t0)
            ran.add((backend, direction))
            row.update(common.time_ms(fn, x, p, trials=5, min_batch_s=args.min_batch_s,
                                      max_reps=args.max_reps))
            # the short batches of runs <= 18 (2-3 calls of the big shapes per batch), kept
            # next to it: the first call of a batch starts on an idle device, so its host
            # dispatch is exposed and divided by the few calls of the batch
            short = common.time_ms(fn, x, p, trials=5, min_batch_s=0.1, max_reps=10)
            row["short_batch_median_ms"], row["short_batch_reps"] = short["median_ms"], short["reps"]
            timed[backend] = (fn, row)
            out = fn(x, p)
            if direction == "fwd":
              row["dropped"] = int(out[1])
            elif cfg.backend == "xla_capacity":   # what it skips: one forward call
              row["dropped"] = int(fns[backend][0](x, p)[1])
            row["checksum"] = tree_checksum(out)   # bits of the output (and gradients)
            del out
          except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:500]
            traceback.print_exc(limit=2)
          results.append(row)
          _checkpoint(args, meta, dense, results, skipped, ep)
          print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        # every backend of this case again, their batches round robin, trial by trial:
        # the A/B the medians above cannot give when the machine drifts over the run
        if args.interleaved_trials and len(timed) > 1 and time.time() - t_start <= args.budget_s:
          try:
            inter = common.time_interleaved_ms({b: (f, r["reps"]) for b, (f, r) in timed.items()},
                                               x, p, trials=args.interleaved_trials)
            for b, (_, row) in timed.items():
              row["interleaved_median_ms"] = inter[b]["median_ms"]
              row["interleaved_min_ms"] = inter[b]["min_ms"]
            _checkpoint(args, meta, dense, results, skipped, ep)
            print({b: round(v["median_ms"], 3) for b, v in inter.items()}, "(interleaved)",
                  flush=True)
          except Exception as e:  # noqa: BLE001
            traceback.print_exc(limit=2)
            for _, row in timed.values():
              row["interleaved_error"] = repr(e)[:300]
        del timed
      del x, p
    del fns, ran
  # same-run ratios
  for row in results:
    if "median_ms" not in row:
      continue
    row["x_over_floor"] = row["median_ms"] / floor_ms(row)
    row["x_over_hot_rank_floor"] = row["median_ms"] / floor_ms(row, "hot_rank_")
    cap = [r for r in results if r.get("backend") == "xla_capacity" and "median_ms" in r
           and (r["shape"], r["routing"], r["direction"]) == (row["shape"], row["routing"], row["direction"])]
    if cap:
      row["speedup_vs_xla_capacity"] = cap[0]["median_ms"] / row["median_ms"]
      if "interleaved_median_ms" in row and "interleaved_median_ms" in cap[0]:
        row["interleaved_speedup_vs_xla_capacity"] = (cap[0]["interleaved_median_ms"]
                                                      / row["interleaved_median_ms"])
      if "short_batch_median_ms" in row and "short_batch_median_ms" in cap[0]:
        row["short_batch_speedup_vs_xla_capacity"] = (cap[0]["short_batch_median_ms"]
                                                      / row["short_batch_median_ms"])
    # which other configurations gave the same bits on this case (uniep, uniep:overlap and
    # pallas must: same receive layout, same GEMM tiles)
    row["bitwise_equal_to"] = sorted(
        r["backend"] for r in results if r is not row and r.get("checksum") == row.get("checksum")
        and "checksum" in r
        and (r["shape"], r["routing"], r["direction"]) == (row["shape"], row["routing"], row["direction"]))
  payload = dict(meta, benchmark="moe_layer", dense_tflops=dense, results=results, skipped=skipped)
  out = common.out_dir(args.out)
  kind = common.device_tag(meta)
  common.write_json(os.path.join(out, f"moe_layer_{kind}_ep{ep}.json"), payload)
  print_table(results)
  try:
    plot(results, os.path.join(out, f"moe_layer_{kind}_ep{ep}.png"))
  except Exception as e:  # noqa: BLE001
    print("plot failed:", e)
  return 0


def _checkpoint(args, meta, dense, results, skipped, ep):
  """Rewrites the partial JSON after every case, so a hang or a kill loses little."""
  kind = common.device_tag(meta)
  path = os.path.join(common.out_dir(args.out), f"moe_layer_{kind}_ep{ep}.partial.json")
  with open(path, "w") as f:
    import json
    json.dump(dict(meta, benchmark="moe_layer", dense_tflops=dense, results=results,
                   skipped=skipped, partial=True), f)


def floor_ms(row: dict, which: str = "") -> float:
  """max(compute floor, communication floor) of a row; which="hot_rank_": its hottest
  rank's."""
  return max(row[f"{which}compute_floor_ms"], row[f"{which}comm_floor_ms"] or 0.0)


def print_table(results):
  print(f"{'shape':14s} {'routing':9s} {'dir':7s} {'backend':20s} {'ms':>9s} {'floor':>8s} "
        f"{'xfloor':>7s} {'hot':>8s} {'xhot':>6s} {'vs_cap':>7s} {'dropped':>8s} "
        f"{'inter_ms':>9s} {'i_vs_cap':>8s}")
  for r in results:
    ms = r.get("median_ms")
    floor, hot = floor_ms(r), floor_ms(r, "hot_rank_")
    print(f"{r['shape']:14s} {r['routing']:9s} {r['direction']:7s} {r['backend']:20s} "
          f"{(f'{ms:9.2f}' if ms else '    ERROR'):>9s} {floor:8.2f} "
          f"{r.get('x_over_floor', float('nan')):7.2f} {hot:8.2f} "
          f"{r.get('x_over_hot_rank_floor', float('nan')):6.2f} "
          f"{r.get('speedup_vs_xla_capacity', float('nan')):7.2f} "
          f"{str(r.get('dropped', '')):>8s} "
          f"{r.get('interleaved_median_ms', float('nan')):9.2f} "
          f"{r.get('interleaved_speedup_vs_xla_capacity', float('nan')):8.2f}")


def plot(results, path):
  rows = [r for r in results if "median_ms" in r]
  cases = sorted({(r["shape"], r["routing"], r["direction"]) for r in rows})
  key = lambda r: (r["shape"], r["routing"], r["direction"])  # noqa: E731
  series = {b: [next((r["median_ms"] for r in rows if r["backend"] == b and key(r) == c), 0)
                for c in cases]
            for b in sorted({r["backend"] for r in rows})}
  series["floor"] = [max(next(r for r in rows if key(r) == c)[k] or 0
                         for k in ("compute_floor_ms", "comm_floor_ms")) for c in cases]
  common.grouped_bars(path, cases, series, ylabel="ms per call (median)", log=True)

if __name__ == "__main__":
  sys.exit(main())
