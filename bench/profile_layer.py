"""Where does one MoE layer call spend its time on the GPU? A kernel-level profile.

Runs one case of bench/moe_layer.py (same inputs, a configuration name of
bench/common.py's `layer_config`, its balanced, skewed or zipf routing) a few times under
`jax.profiler.trace` and reduces the trace to a table per device: every kernel (Mosaic
GPU kernels, XLA fusions, NCCL, cuBLAS) with its count, total and mean time, its share
of the span of one call, and how much of it ran while another kernel was running on the
same device on another stream (overlap): e.g. whether the NVLink transfers run under
the grouped GEMMs, and what the glue around the kernels costs.

  python -m bench.profile_layer [--shape deepseek-like] [--backend uniep:overlap]
      [--direction fwd] [--routing balanced] [--reps 3] [--top 25] [--out DIR]
  python -m bench.profile_layer --train-model mixtral-like --backend uniep [--mesh data=1,expert=4]
      (the whole training step of bench/train_throughput.py's model instead of one layer;
      --backend is then a training configuration, bench/train_throughput.py's
      `parse_backend`, e.g. uniep:overlap or pallas:stages=4)

Mosaic GPU kernels all carry one name in the trace; the table names them by launch
shape ("mosaic grid 132 block 384 smem 229440"). Each device also gets a timeline:
its kernels of at least --min-us in start order (ms from the first, duration, stream),
to read one call's sequence (e.g. which GEMM follows which transfer).

Writes profile_<configuration>_<shape>_<direction>.json (the table, metadata; the
configuration name with ':' as '_', ',' as '-', '=' dropped) and keeps the trace
(trace.json.gz, viewable in Perfetto) under --out. On the CPU it runs on tiny shapes
(`--shape tiny --backend xla_dropless`, whose transport is "padded" there); the trace
then holds XLA's CPU ops, enough to test the reduction.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys


def _events(trace_path: str) -> tuple[list[dict], dict]:
  """The complete ('X') events of a Chrome/Perfetto trace and {pid: process name}. In
  a GPU process only the CUDA streams' lines are kept (threads named "Stream ...");
  its other lines ("XLA Modules", "XLA Ops", ...) restate the same time."""
  with gzip.open(trace_path) as f:
    t = json.load(f)
  ev = t["traceEvents"] if isinstance(t, dict) else t
  pnames = {e["pid"]: e["args"]["name"] for e in ev
            if e.get("ph") == "M" and e.get("name") == "process_name"}
  tnames = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev
            if e.get("ph") == "M" and e.get("name") == "thread_name"}
  streams = {pid for (pid, _), name in tnames.items() if name.startswith("Stream")}

  def keep(e):
    return e["pid"] not in streams or tnames.get((e["pid"], e["tid"]), "").startswith("Stream")

  return [e for e in ev if e.get("ph") == "X" and "dur" in e and keep(e)], pnames


def _busy_union(intervals: list[tuple[float, float]]) -> float:
  """Length of the union of [start, end) intervals."""
  total, end = 0.0, None
  for a, b in sorted(intervals):
    if end is None or a > end:
      total += b - a
      end = b
    elif b > end:
      total += b - end
      end = b
  return total


def kernel_name(e: dict) -> str:
  """The event's name; Mosaic GPU kernels (all "anonymous_mosaic_gpu_kernel") by
  their launch shape from the trace's kernel_details."""
  name = e["name"]
  if name.startswith("anonymous_mosaic_gpu_kernel"):
    d = dict(kv.split(":", 1) for kv in e.get("args", {}).get("kernel_details", "").split()
             if ":" in kv)
    if d:
      name = (f"mosaic grid {d.get('grid', '?').split(',')[0]} block "
              f"{d.get('block', '?').split(',')[0]} smem {d.get('dynamic_shared', '?')}")
  return name


def summarize(events: list[dict], pnames: dict, *, calls: int, top: int = 25,
              min_us: float = 20.0) -> dict:
  """Per device (trace process whose name holds 'GPU' or '/device:', else every
  process): kernels by total time. overlap_us of a kernel = the part of its time
  during which some other kernel event of the same device was running too."""
  by_pid = collections.defaultdict(list)
  for e in events:
    by_pid[e["pid"]].append(e)
  devices = [p for p in by_pid if any(k in pnames.get(p, "") for k in ("GPU", "/device:"))]
  out = {}
  for pid in devices or list(by_pid):
    evs = sorted(by_pid[pid], key=lambda e: e["ts"])
    if not evs:
      continue
    span = max(e["ts"] + e["dur"] for e in evs) - evs[0]["ts"]
    names = [kernel_name(e) for e in evs]
    rows = collections.OrderedDict()
    for e, name in zip(evs, names):
      r = rows.setdefault(name, dict(name=name, count=0, total_us=0.0, overlap_us=0.0))
      r["count"] += 1
      r["total_us"] += e["dur"]
    # overlap: for each event, the union of the other events' intersections with it
    starts = [(e["ts"], e["ts"] + e["dur"], i) for i, e in enumerate(evs)]
    for i, e in enumerate(evs):
      a, b = e["ts"], e["ts"] + e["dur"]
      cut = [(max(a, s), min(b, t)) for s, t, j in starts
             if j != i and s < b and t > a and evs[j]["tid"] != e["tid"]]
      rows[names[i]]["overlap_us"] += _busy_union(cut)
    table = sorted(rows.values(), key=lambda r: -r["total_us"])
    busy = _busy_union([(e["ts"], e["ts"] + e["dur"]) for e in evs])
    for r in table:
      r["mean_us"] = r["total_us"] / r["count"]
      r["per_call_us"] = r["total_us"] / calls
    out[pnames.get(pid, str(pid))] = dict(
        span_us=span, busy_us=busy, span_per_call_us=span / calls, busy_per_call_us=busy / calls,
        kernels=table[:top], other_kernels=len(table) - min(top, len(table)),
        timeline=[dict(start_ms=round((e["ts"] - evs[0]["ts"]) / 1e3, 3),
                       ms=round(e["dur"] / 1e3, 3), stream=e["tid"], name=name)
                  for e, name in zip(evs, names) if e["dur"] >= min_us])
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--shape", default="deepseek-like")
  ap.add_argument("--backend", default="uniep",
                  help="a configuration name (bench/common.py, layer_config; with "
                       "--train-model a training configuration, train_throughput.parse_backend)")
  ap.add_argument("--direction", default="fwd", choices=("fwd", "fwdbwd"))
  ap.add_argument("--routing", default="balanced", choices=("balanced", "skewed", "zipf"),
                  help="bench/moe_layer.py's routings (make_inputs)")
  ap.add_argument("--reps", type=int, default=3, help="profiled calls (after a warm-up call)")
  ap.add_argument("--back-to-back", action="store_true",
                  help="layer calls enqueued back to back, one wait at the end (as the layer "
                       "bench times them); default: each call waited for")
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--out", default=None)
  ap.add_argument("--min-us", type=float, default=20.0, help="timeline: shortest kernel kept")
  ap.add_argument("--train-model", default=None,
                  help="profile the training step of this model (bench/train_throughput.py: "
                       "--layers, --max-experts, --batch, --seq, --mesh; --backend is a "
                       "training configuration, e.g. uniep, xla_capacity, uniep:overlap)")
  ap.add_argument("--mesh", default=None, help="--train-model: default data=1,expert=<GPUs>")
  ap.add_argument("--layers", type=int, default=1)
  ap.add_argument("--max-experts", type=int, default=64)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=2048)
  args = ap.parse_args(argv)
  if args.train_model:
    from bench.train_throughput import parse_backend
    parse_backend(args.backend)   # a bad name fails before anything runs
    from bench.common import start_training_process
    start_training_process(True)   # XLA deterministic, as the training CLI and its bench
  import jax

  from bench import common

  common.dump_stacks_on_usr1()
  out = common.out_dir(args.out)
  r = len(jax.devices())
  if args.train_model:
    fn, tag = _train_step_fn(args, r)
  else:
    fn, tag = _layer_fn(args, r)
  fn()  # compile and warm up outside the trace
  trace_dir = os.path.join(out, f"trace_{tag}")
  with jax.profiler.trace(trace_dir):
    if args.back_to_back and not args.train_model:
      common.block([fn(sync=False) for _ in range(args.reps)])
    else:
      for _ in range(args.reps):
        fn()
  # the newest trace (an earlier run into the same --out leaves its own)
  path = max(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True),
             key=os.path.getmtime)
  for raw in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
    os.remove(raw)  # the trace.json.gz holds what we read; keep what comes back small
  events, pnames = _events(path)
  table = summarize(events, pnames, calls=args.reps, top=args.top, min_us=args.min_us)
  payload = dict(common.run_metadata(), benchmark="profile_layer", settings=vars(args),
                 trace=os.path.relpath(path, out), devices=table)
  name = f"profile_{tag}.json"
  common.write_json(os.path.join(out, name), payload)
  for dev, d in list(table.items())[:1] + list(table.items())[1:2]:
    print(f"{dev}: span {d['span_per_call_us'] / 1e3:.2f} ms per call, busy "
          f"{d['busy_per_call_us'] / 1e3:.2f} ms")
    print(f"  {'kernel':60s} {'count':>6s} {'ms/call':>8s} {'mean us':>9s} {'overlap':>8s}")
    for k in d["kernels"]:
      print(f"  {k['name'][:60]:60s} {k['count']:6d} {k['per_call_us'] / 1e3:8.3f} "
            f"{k['mean_us']:9.1f} {k['overlap_us'] / max(k['total_us'], 1e-9):8.0%}")
  return 0


def _layer_fn(args, r):
  """One MoE layer call of bench/moe_layer.py (a callable that blocks) and its tag."""
  import jax

  from bench import common, moe_layer
  shape = {**common.SHAPES, **common.SMOKE_SHAPES}[args.shape]
  mesh = jax.make_mesh((1, r), ("data", "expert"))
  x, p = moe_layer.make_inputs(shape, mesh, routing=args.routing)
  f_fwd, f_bwd = moe_layer.layer_fns(mesh, shape, moe_layer.backend_config(args.backend))
  fn = f_fwd if args.direction == "fwd" else f_bwd
  def call(sync=True):
    out = fn(x, p)
    return common.block(out) if sync else out
  b2b = "_b2b" if args.back_to_back else ""
  return call, f"{file_part(args.backend)}_{args.shape}_{args.direction}{b2b}"


def _train_step_fn(args, r):
  """Successive training steps of bench/train_throughput.py's case (a callable that
  runs one and blocks) and its tag."""
  import jax

  from bench import train_throughput as tt
  mesh = args.mesh or f"data=1,expert={r}"
  data = tt.uniform_tokens_for(args.train_model)
  case = tt.build_case(args.train_model, mesh, args.backend, layers=args.layers or None,
                       batch=args.batch, seq=args.seq, num_batches=1, data=data,
                       max_experts=args.max_experts or None, grad_reduction="ordered")
  state = [case.state]

  def step():
    params, rest, opt_state, m = case.step_fn(*state[0], *case.batches[0])
    jax.block_until_ready(m)
    state[0] = (params, rest, opt_state)

  return step, (f"train_{case.name}_{mesh.replace('=', '').replace(',', '_')}_"
                f"{file_part(args.backend)}")


def file_part(name: str) -> str:
  """A configuration name as a file-name part: "uniep:overlap=4,2" -> "uniep_overlap4-2"."""
  return name.replace(":", "_").replace("=", "").replace(",", "-")


if __name__ == "__main__":
  sys.exit(main())
