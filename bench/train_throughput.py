"""End-to-end training throughput and determinism of the reference MoE transformer.

For each model (default: mixtral-like and deepseek-like with `--layers` layers, at most
`--max-experts` experts), each mesh (default data=1,expert=R and data=2,expert=R/2 over
the R local GPUs) and each configuration of `--backends`, it runs the real train step
(train/loop.py: AdamW, aux losses; timed batches of uniform random token ids by
default, `--tokens corpus` for the byte corpus) and reports, per case:
  step_ms       median of timed steps (warm-up steps excluded)
  tokens_per_s  batch * seq / step time (global)
  mfu           model FLOPs per token (models/report.py, x3 for fwd+bwd) times
                tokens/s over (dense bf16 matmul rate measured in this run x GPUs)
  peak_mem_gib  max over devices of peak_bytes_in_use
  dropped       dropped assignments summed over the timed steps (0 = dropless), and
                dropped_fraction of all the timed steps' assignments
  max_load      the most loaded expert's share over the mean (1 = balanced), mean of
                the timed steps; the timed steps run at `--lr` (default TIMING_LR, small:
                the routing stays close to initialisation)
Then the determinism checks, when "pallas" and "uniep" are both among --backends: the
same `--det-steps` training steps with "pallas" and "uniep" give bitwise identical
losses and parameters, two "uniep" runs give identical ones, and, when "uniep:overlap"
is among them too, "uniep:overlap" gives those of "uniep".

Configurations are named as everywhere in bench/ (bench/common.py, `layer_config`), as
far as the training CLI's TrainConfig (train/config.py) can express them
(`parse_backend`): a backend, ":overlap" (TrainConfig.overlap, OverlapConfig()),
":cf=F" (capacity_factor), and two options of the training step: ":stages=N" (the
grouped GEMM's pipeline depth, --kernel-stages) and ":buckets=N" (gradient buckets of
the ordered sums, --grad-buckets); e.g. "uniep:overlap", "pallas:stages=4",
"uniep:buckets=1".

  python -m bench.train_throughput [--models mixtral-like,deepseek-like] [--layers 1]
      [--batch 8] [--seq 2048] [--steps 8] [--backends ...] [--det-steps 50] [--out DIR]

JSON (and a PNG of tokens/s) under --out ($OUT or bench/results). GPU only in
practice; on the CPU it runs the same code on tiny shapes (`--models tiny`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import traceback

import jax
import numpy as np

import uniep_jax
from bench import common
from train.config import GRAD_REDUCTIONS

BACKENDS = ("xla_capacity", "xla_dropless", "pallas", "uniep", "uniep:overlap")
# the options of the training step that are not the layer's (TrainConfig field)
TRAIN_OPTIONS = {"stages": "kernel_stages", "buckets": "grad_buckets"}


def _peak_mem_gib() -> float | None:
  peaks = []
  for d in jax.local_devices():
    stats = d.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
      peaks.append(stats["peak_bytes_in_use"])
  return max(peaks) / 2**30 if peaks else None


def uniform_tokens_for(model: str):
  """The timed batches' default data: uniform ids over `model`'s vocabulary."""
  from models.config import get_config
  return uniform_tokens(vocab=get_config(model).vocab_size, n=4 << 20)


def uniform_tokens(vocab: int, n: int, seed: int = 0):
  """A `train.data.Dataset` of uniform random token ids in [0, vocab) (fixed seed)."""
  from train.data import Dataset
  rng = np.random.default_rng(seed)
  return Dataset(train=rng.integers(0, vocab, n, dtype=np.int32),
                 heldout=rng.integers(0, vocab, n // 20, dtype=np.int32),
                 description=f"uniform random ids over {vocab} (seed {seed})")


# The timed steps run at this learning rate. At the training default (3e-3 with a short
# warm-up) the first updates blow the 4096-wide models up: the router collapses onto a
# few experts and xla_capacity drops most assignments, skipping that work, so the
# backends would not be timed on the same work. At a small rate the timed steps keep
# the routing of initialisation; each row records it (dropped_fraction, max_load,
# loss_first, loss_last).
TIMING_LR = 1e-5


def _register_variant(model: str, layers: int | None, max_experts: int | None = None) -> str:
  """Registers `model` with `layers` layers and at most `max_experts` experts ("sized
  to fit": deepseek-like's 256 experts of 7168 x 2048 need ~45 GB of float32
  parameters and AdamW state per GPU at EP 4 before any activation) and returns its
  name, e.g. "deepseek-like-L1-E64"."""
  from models.config import get_config
  import models.config as model_configs

  base = get_config(model)
  changes, name = {}, model
  if layers is not None:
    name += f"-L{layers}"
    changes.update(n_layers=layers,
                   first_dense=min(getattr(base, "first_dense", 0), max(0, layers - 1)))
  if max_experts is not None and base.n_experts > max_experts:
    name += f"-E{max_experts}"
    changes.update(n_experts=max_experts)
  if changes:
    model_configs.CONFIGS[name] = dataclasses.replace(base, name=name, **changes)
  return name


@dataclasses.dataclass
class TrainCase:
  """One model x mesh x backend, set up for stepping: `state` = (params, rest,
  opt_state); `step_fn(*state, *batches[i])` -> (params, rest, opt_state, metrics)."""
  name: str
  setup: object           # train.loop.Setup
  state: tuple
  step_fn: object
  batches: list


def parse_backend(name: str) -> dict:
  """A configuration name -> the TrainConfig fields it sets: "uniep:overlap:stages=3" ->
  dict(backend="uniep", overlap=True, kernel_stages=3). The layer's part of the name goes
  through `common.layer_config` (the one naming scheme of bench/); of what it can name,
  TrainConfig expresses the backend, overlap at OverlapConfig() (TrainConfig.overlap)
  and the capacity factor (cf=F); anything else raises ValueError. The training step's
  own options: stages=N (kernel_stages) and buckets=N (grad_buckets). Fields not named
  keep TrainConfig's defaults. fp8: TrainConfig.fp8."""
  backend, *options = name.split(":")
  layer_options, fields = [], {}
  for option in options:
    key, _, value = option.partition("=")
    if key in TRAIN_OPTIONS:
      if not value.isdigit():
        raise ValueError(f"configuration {name!r}: {key}=N takes an integer, got {option!r}")
      fields[TRAIN_OPTIONS[key]] = int(value)
    else:
      layer_options.append(option)
  try:
    cfg = common.layer_config(":".join([backend] + layer_options))
  except ValueError as e:
    raise ValueError(f"{e} (a training configuration takes the options overlap, cf=F, fp8, "
                     f"{', '.join(k + '=N' for k in TRAIN_OPTIONS)})") from None
  default = uniep_jax.UniEPConfig(backend=cfg.backend)
  fields = dict(backend=cfg.backend, **fields)
  if cfg.overlap is not None:
    if cfg.overlap != uniep_jax.OverlapConfig():
      raise ValueError(f"configuration {name!r}: the training step runs the overlap at "
                       f"OverlapConfig() only (TrainConfig.overlap is on or off): name it "
                       f"'overlap', without counts")
    fields["overlap"] = True
  if cfg.capacity_factor != default.capacity_factor:
    fields["capacity_factor"] = cfg.capacity_factor
  if cfg.precision == "fp8":
    fields["fp8"] = True
  for field in ("transport", "kernel", "transfer"):
    if getattr(cfg, field) != getattr(default, field):
      raise ValueError(f"configuration {name!r}: TrainConfig has no {field} (the options "
                       f"of a training configuration are overlap, cf=F, fp8, "
                       f"{', '.join(k + '=N' for k in TRAIN_OPTIONS)})")
  return fields


def train_config(name: str, **fields):
  """TrainConfig of configuration `name` (`parse_backend`) and the other `fields`."""
  from train.config import TrainConfig
  return TrainConfig(**fields, **parse_backend(name))


def build_case(model: str, mesh: str, backend: str, *, layers: int | None, batch: int, seq: int,
               num_batches: int, data, max_experts: int | None = None,
               grad_reduction: str = "xla", lr: float = TIMING_LR) -> TrainCase:
  """The real train step (train/loop.py) of `model` (registered with `layers` and
  `max_experts`) on `mesh` with the configuration `backend` (`parse_backend`: e.g.
  "uniep:overlap:stages=4"), and `num_batches` batches of `data` on the devices.
  Shared by this bench and bench/profile_layer.py --train-model."""
  from train import loop

  name = _register_variant(model, layers, max_experts)
  cfg = train_config(backend, config=name, mesh=mesh, batch=batch, seq=seq,
                     steps=max(num_batches, 2), out="/tmp/train_throughput", progress=False,
                     plot=False, grad_reduction=grad_reduction, lr=lr)
  s = loop.make_setup(cfg)
  state = loop.init_state(s)
  step_fn = loop.make_train_step(s, jax.tree.map(lambda x: x.sharding, state[2]))
  put = lambda a: jax.device_put(a, s.batch_sh)  # noqa: E731
  batches = [tuple(map(put, data.batch(cfg.seed, i, batch, seq))) for i in range(num_batches)]
  return TrainCase(name, s, tuple(state), step_fn, batches)


def run_case(model: str, mesh: str, backend: str, *, layers: int | None, batch: int, seq: int,
             steps: int, warmup: int, data, dense_tflops: float,
             max_experts: int | None = None, grad_reduction: str = "xla",
             lr: float = TIMING_LR) -> dict:
  """Times `steps` train steps after `warmup` at the learning rate `lr`; returns the row
  for the JSON, with the routing state of the timed steps (dropped fraction, max load)."""
  from models.report import model_report

  case = build_case(model, mesh, backend, layers=layers, batch=batch, seq=seq,
                    num_batches=steps + warmup, data=data, max_experts=max_experts,
                    grad_reduction=grad_reduction, lr=lr)
  name, s, step_fn, batches = case.name, case.setup, case.step_fn, case.batches
  params, rest, opt_state = case.state
  t0 = time.perf_counter()
  params, rest, opt_state, m = step_fn(params, rest, opt_state, *batches[0])
  jax.block_until_ready(m)
  compile_s = time.perf_counter() - t0
  for i in range(1, warmup):
    params, rest, opt_state, m = step_fn(params, rest, opt_state, *batches[i])
  jax.block_until_ready(m)
  times, dropped, max_load, losses = [], 0, [], []
  for i in range(warmup, warmup + steps):
    t0 = time.perf_counter()
    params, rest, opt_state, m = step_fn(params, rest, opt_state, *batches[i])
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
    dropped += int(m["dropped"])
    max_load.append(float(m["max_load"]))
    losses.append(float(m["loss"]))
  step_s = statistics.median(times)
  rep = model_report(s.model_cfg, seq)
  flops_per_token = rep["train_flops_per_token"]             # fwd + bwd
  tokens_per_s = batch * seq / step_s
  n_gpu = len(s.mesh.devices.flat)
  assignments = batch * seq * s.model_cfg.top_k * steps * len(s.model_cfg.moe_layers)
  row = dict(model=name, mesh=mesh, backend=backend, grad_reduction=grad_reduction, lr=lr,
             dropped_fraction=dropped / assignments, max_load=statistics.mean(max_load),
             loss_first=losses[0], loss_last=losses[-1],
             batch=batch, seq=seq, steps=steps,
             compile_s=compile_s, step_ms=step_s * 1e3, step_ms_min=min(times) * 1e3,
             tokens_per_s=tokens_per_s, dropped=dropped, peak_mem_gib=_peak_mem_gib(),
             total_params=rep.get("total_params"), active_params=rep.get("active_params"))
  row["mfu"] = flops_per_token * tokens_per_s / (dense_tflops * 1e12 * n_gpu)
  return row


def determinism(model: str, mesh: str, *, layers, batch: int, seq: int, steps: int,
                max_experts: int | None = None, grad_reduction: str = "xla",
                overlap: bool = False) -> dict:
  """pallas vs uniep (bitwise losses and params), uniep twice, and with `overlap`
  uniep:overlap vs uniep."""
  from train import loop

  name = _register_variant(model, layers, max_experts)
  runs = [("pallas", "pallas"), ("uniep", "uniep"), ("uniep_again", "uniep")]
  if overlap:
    runs.append(("uniep_overlap", "uniep:overlap"))
  out = {}
  for tag, backend in runs:
    cfg = train_config(backend, config=name, mesh=mesh, batch=batch, seq=seq,
                       steps=steps, eval_every=steps, eval_batches=1,
                       out=f"/tmp/train_det_{tag}", progress=False, plot=False,
                       grad_reduction=grad_reduction)
    r = loop.train(cfg)
    out[tag] = dict(configuration=backend, losses=[float(r["losses"][k]) for k in sorted(r["losses"])],
                    checksum=r["summary"]["sha256"], param_sum=r["summary"]["param_sum"])
  same = lambda a, b: (out[a]["losses"] == out[b]["losses"]  # noqa: E731
                       and out[a]["checksum"] == out[b]["checksum"])
  result = dict(model=name, mesh=mesh, steps=steps, grad_reduction=grad_reduction,
                pallas_equals_uniep=same("pallas", "uniep"),
                uniep_repeatable=same("uniep", "uniep_again"), runs=out)
  if overlap:
    result["uniep_overlap_equals_uniep"] = same("uniep_overlap", "uniep")
  return result


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--models", default="mixtral-like,deepseek-like")
  ap.add_argument("--layers", type=int, default=1, help="layers per model (0: the config's)")
  ap.add_argument("--meshes", default="", help="default: data=1,expert=R;data=2,expert=R/2")
  ap.add_argument("--backends", default=",".join(BACKENDS),
                  help="comma list of configuration names (parse_backend): a backend, "
                       "':overlap' the transfers inside GEMM launches (uniep), ':cf=F' the "
                       "capacity factor (xla_capacity), ':stages=N' N pipeline stages, "
                       "':buckets=N' N gradient buckets (default: TrainConfig's; 1: one sum "
                       "after the backward pass), e.g. uniep,uniep:overlap,uniep:stages=4")
  ap.add_argument("--max-experts", type=int, default=64,
                  help="cap on each model's expert count, to fit (0: the config's)")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--steps", type=int, default=8)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--det-steps", type=int, default=50, help="0 skips the determinism runs")
  ap.add_argument("--tokens", default="uniform", choices=("uniform", "corpus"),
                  help="timed batches: uniform random ids over the vocabulary (default, "
                       "as subword text spreads over its vocabulary) or the byte corpus (a "
                       "few hundred distinct ids)")
  ap.add_argument("--lr", type=float, default=TIMING_LR,
                  help="learning rate of the timed steps (small: the routing should stay "
                       "close to initialisation; the determinism runs keep the training default)")
  ap.add_argument("--budget-s", type=float, default=500.0)
  ap.add_argument("--det-only", action="store_true", help="only the determinism runs")
  ap.add_argument("--xla-deterministic", action="store_true",
                  help="XLA:GPU deterministic mode, no GEMM autotuning "
                       "(train.mesh.request_xla_determinism; the training CLI's default)")
  ap.add_argument("--grad-reduction", default="ordered",
                  help="TrainConfig.grad_reduction (train --grad-reduction): ordered (the "
                       "CLI's default), xla, or "
                       "both as 'xla,ordered' (each backend timed in each mode; the "
                       "determinism runs take the last)")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  reductions = args.grad_reduction.split(",")
  if set(reductions) - set(GRAD_REDUCTIONS):
    ap.error(f"--grad-reduction {args.grad_reduction!r}: a comma list of {', '.join(GRAD_REDUCTIONS)}")
  backends = [b for b in args.backends.split(",") if b]
  for backend in backends:   # a bad name fails now, not after other cases ran
    for reduction in reductions:
      try:
        train_config(backend, grad_reduction=reduction)
      except ValueError as e:
        ap.error(f"--backends {backend!r} with --grad-reduction {reduction}: {e}")
  common.start_training_process(args.xla_deterministic)  # before jax starts its backends
  from train.data import make_dataset

  t_start = time.time()
  r = len(jax.devices())
  meshes = [m for m in args.meshes.split(";") if m] or (
      [f"data=1,expert={r}"] + ([f"data=2,expert={r // 2}"] if r >= 2 and r % 2 == 0 else []))
  layers = args.layers or None
  meta = common.run_metadata()
  print(meta, flush=True)
  dense = common.dense_matmul_tflops()
  print(f"dense bf16 matmul: {dense:.0f} TFLOP/s per device", flush=True)
  corpus = make_dataset(None, max_bytes=4 << 20, heldout_fraction=0.05, seq=args.seq)

  def data_for(model):
    if args.tokens == "corpus":
      return corpus
    return uniform_tokens_for(model)
  rows, skipped = [], []
  for model in (args.models.split(",") if not args.det_only else []):
    data = data_for(model)
    for mesh in meshes:
      for backend in backends:
        for reduction in reductions:
          if time.time() - t_start > args.budget_s:
            skipped.append(dict(model=model, mesh=mesh, backend=backend, grad_reduction=reduction,
                                why="time budget"))
            continue
          try:
            row = run_case(model, mesh, backend, layers=layers, batch=args.batch, seq=args.seq,
                           steps=args.steps, warmup=args.warmup, data=data, dense_tflops=dense,
                           max_experts=args.max_experts or None, grad_reduction=reduction,
                           lr=args.lr)
          except Exception as e:  # noqa: BLE001
            traceback.print_exc(limit=3)
            try:  # the registered variant's name, if the model itself is known
              name = _register_variant(model, layers, args.max_experts or None)
            except Exception:  # noqa: BLE001
              name = model
            row = dict(model=name, mesh=mesh, backend=backend, grad_reduction=reduction,
                       error=repr(e)[:500])
          rows.append(row)
          print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
  det = []
  if args.det_steps and {"pallas", "uniep"} <= set(backends):
    for model in args.models.split(","):
      if time.time() - t_start > args.budget_s:
        skipped.append(dict(model=model, what="determinism", why="time budget"))
        continue
      try:
        det.append(determinism(model, meshes[0], layers=layers, batch=args.batch, seq=args.seq,
                               steps=args.det_steps, max_experts=args.max_experts or None,
                               grad_reduction=reductions[-1],
                               overlap="uniep:overlap" in backends))
      except Exception as e:  # noqa: BLE001
        traceback.print_exc(limit=3)
        det.append(dict(model=model, mesh=meshes[0], error=repr(e)[:500]))
      print({k: v for k, v in det[-1].items() if k != "runs"}, flush=True)
  payload = dict(meta, benchmark="train_throughput", dense_tflops=dense, results=rows,
                 determinism=det, skipped=skipped,
                 settings=dict(batch=args.batch, seq=args.seq, steps=args.steps, layers=layers,
                               max_experts=args.max_experts or None,
                               det_steps=args.det_steps, tokens=args.tokens, lr=args.lr,
                               xla_flags=os.environ.get("XLA_FLAGS", ""),
                               xla_deterministic=args.xla_deterministic))
  out = common.out_dir(args.out)
  kind = common.device_tag(meta)
  tag = "_det" if args.det_only else ""
  common.write_json(os.path.join(out, f"train_throughput_{kind}_x{r}{tag}.json"), payload)
  print(f"{'model':22s} {'mesh':18s} {'configuration':28s} {'step_ms':>9s} {'tok/s':>10s} "
        f"{'MFU':>6s} {'GiB':>6s} {'dropped':>8s}")
  for row in rows:
    if "error" in row:
      print(f"{row['model']:22s} {row['mesh']:18s} {_label(row):28s} ERROR {row['error'][:60]}")
      continue
    print(f"{row['model']:22s} {row['mesh']:18s} {_label(row):28s} {row['step_ms']:9.1f} "
          f"{row['tokens_per_s']:10.0f} {row.get('mfu', float('nan')):6.3f} "
          f"{(row['peak_mem_gib'] or float('nan')):6.1f} {row['dropped']:8d}")
  if any("tokens_per_s" in row for row in rows):
    try:
      _plot(rows, os.path.join(out, f"train_throughput_{kind}_x{r}.png"))
    except Exception as e:  # noqa: BLE001
      print("plot failed:", e)
  return 0


def _label(row) -> str:
  """The configuration and the gradient reduction, e.g. "uniep:overlap/ordered"."""
  return f"{row['backend']}/{row.get('grad_reduction', 'xla')}"


def _plot(rows, path):
  rows = [r for r in rows if "tokens_per_s" in r]
  cases = sorted({(r["model"], r["mesh"]) for r in rows})
  series = {b: [next((r["tokens_per_s"] for r in rows if _label(r) == b
                      and (r["model"], r["mesh"]) == c), 0) for c in cases]
            for b in sorted({_label(r) for r in rows})}
  common.grouped_bars(path, cases, series, ylabel="tokens / s")


if __name__ == "__main__":
  sys.exit(main())
