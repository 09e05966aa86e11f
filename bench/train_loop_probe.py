"""Where does a training run spend its first minutes? Each stage of `train.loop.train`
timed and printed as it ends, for each backend.

`bench/device_session.sh train_det` with `--grad-reduction ordered` (4x H200,
2026-11-26, commit fa5c9a2) printed nothing after loading the data for 410 s, while
one ordered step of the same model (bench/train_step_diff.py) took 13 s. This runs the
loop's stages one at a time, each printed (flushed) when done: set-up, parameter
init, the held-out eval step (compile + run), then train steps one by one. SIGUSR1
prints every thread's stack (bench/common.dump_stacks_on_usr1): a stage that never
ends is then named by the last line and the stack.

  python -m bench.train_loop_probe [--model mixtral-like] [--layers 1] [--mesh data=1,expert=4]
      [--backends pallas,uniep] [--grad-reduction ordered] [--steps 3] [--xla-deterministic]
"""

from __future__ import annotations

import argparse
import sys
import time

from train.config import GRAD_REDUCTIONS


def _stage(name: str, t0: float) -> float:
  t = time.perf_counter()
  print(f"  {name}: {t - t0:.1f} s", flush=True)
  return t


def probe(model: str, layers, mesh: str, backend: str, grad_reduction: str, *, batch: int,
          seq: int, steps: int, data) -> None:
  import jax
  import numpy as np

  from bench.train_throughput import _register_variant
  from train import loop
  from train.config import TrainConfig

  name = _register_variant(model, layers)
  cfg = TrainConfig(config=name, mesh=mesh, backend=backend, batch=batch, seq=seq, steps=steps,
                    out="/tmp/train_loop_probe", progress=False, plot=False,
                    grad_reduction=grad_reduction)
  print(f"{backend} / grad_reduction {grad_reduction}:", flush=True)
  t = time.perf_counter()
  s = loop.make_setup(cfg)
  t = _stage("setup", t)
  params, rest, opt_state = loop.init_state(s)
  jax.block_until_ready(params)
  t = _stage("init", t)
  opt_sh = jax.tree.map(lambda a: a.sharding, opt_state)
  train_step, eval_step = loop.make_train_step(s, opt_sh), loop.make_eval_step(s)
  x, y = (jax.device_put(a, s.batch_sh) for a in data.batch(cfg.seed, 0, batch, seq))
  ev = eval_step.lower(params, rest, x, y).compile()
  t = _stage("eval step compile", t)
  loss = float(np.float32(ev(params, rest, x, y)))
  t = _stage(f"eval step run (held-out loss {loss:.4f})", t)
  step = train_step.lower(params, rest, opt_state, x, y).compile()
  t = _stage("train step compile", t)
  for i in range(steps):
    x, y = (jax.device_put(a, s.batch_sh) for a in data.batch(cfg.seed, i, batch, seq))
    params, rest, opt_state, m = step(params, rest, opt_state, x, y)
    t = _stage(f"train step {i + 1} (loss {float(m['loss']):.4f})", t)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--model", default="mixtral-like")
  ap.add_argument("--layers", type=int, default=1, help="0: the config's own")
  ap.add_argument("--mesh", default="")
  ap.add_argument("--backends", default="pallas,uniep")
  ap.add_argument("--grad-reduction", default="ordered", choices=GRAD_REDUCTIONS)
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=2048)
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--xla-deterministic", action="store_true")
  args = ap.parse_args(argv)
  from bench import common
  common.start_training_process(args.xla_deterministic)
  import jax

  from train.data import make_dataset

  mesh = args.mesh or f"data=1,expert={len(jax.devices())}"
  print(common.run_metadata(), flush=True)
  data = make_dataset(None, max_bytes=4 << 20, heldout_fraction=0.05, seq=args.seq)
  for backend in args.backends.split(","):
    probe(args.model, args.layers or None, mesh, backend, args.grad_reduction, batch=args.batch,
          seq=args.seq, steps=args.steps, data=data)
  return 0


if __name__ == "__main__":
  sys.exit(main())
