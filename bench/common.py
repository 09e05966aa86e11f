"""Shared by the benchmarks: configuration names, timing, run metadata, plots.

The target shapes, the timing method and the run metadata live in `uniep_jax.measure`
(the autotuner uses them too) and are re-exported here.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import statistics

import jax

from uniep_jax.measure import (SHAPES, SMOKE_SHAPES, MoEShape,  # noqa: F401
                               _batch_ms, block, git_commit, run_metadata, time_ms,
                               zipf_popularity)


def dump_stacks_on_usr1() -> None:
  """SIGUSR1 prints every thread's Python stack to stderr and the run goes on.
  bench/run_gpu.sh stops its phases with `timeout -s USR1 -k ...`, so a
  run cut by its limit says where it was (a hang and a slow compile look alike from
  outside)."""
  faulthandler.register(signal.SIGUSR1, all_threads=True)


def start_training_process(xla_deterministic: bool) -> None:
  """What the training benches do before jax starts its backends, as the training CLI
  (train/cli.py): stacks on SIGUSR1, NCCL group launches, and XLA's deterministic mode
  when asked."""
  from train.mesh import request_nccl_group_launch, request_xla_determinism
  dump_stacks_on_usr1()
  request_nccl_group_launch()
  if xla_deterministic:
    request_xla_determinism()


def same_bits(a, b) -> bool:
  """Bitwise equality of two arrays or pytrees of arrays (dtype, shape and bytes)."""
  import numpy as np
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
      np.asarray(x).dtype == np.asarray(y).dtype and np.asarray(x).shape == np.asarray(y).shape
      and np.array_equal(np.asarray(x).reshape(-1).view(np.uint8),
                         np.asarray(y).reshape(-1).view(np.uint8))
      for x, y in zip(la, lb))


def skewed_topk(rng, experts: int, tokens: int, top_k: int, skew: float):
  """[tokens, top_k] int32 random routing (numpy `rng`), expert 0 (1 + skew) times
  likelier than each other expert; slots draw independently."""
  import numpy as np
  p = np.full(experts, 1.0)
  p[0] += skew
  return rng.choice(experts, size=(tokens, top_k), p=p / p.sum()).astype(np.int32)


def time_interleaved_ms(fns: dict, *args, trials: int = 5) -> dict:
  """Median ms per call of each `fns[name] = (fn, reps)`, its batches of `reps` calls
  interleaved round robin over the names, trial by trial: a drift of the machine
  (clocks, temperature) over the run then reaches every name alike, where timing one
  name's trials after another's gives the later ones the drift. {name: dict(median_ms,
  min_ms, max_ms, reps, trials)}."""
  sync_each = jax.devices()[0].platform == "cpu"
  per_call = {name: [] for name in fns}
  for _ in range(trials):
    for name, (fn, reps) in fns.items():
      per_call[name].append(_batch_ms(fn, args, reps, sync_each))
  return {name: dict(median_ms=statistics.median(v), min_ms=min(v), max_ms=max(v),
                     reps=fns[name][1], trials=trials) for name, v in per_call.items()}


def device_tag(meta: dict) -> str:
  """The device kind of `run_metadata()` as a file-name part ("NVIDIA_H200")."""
  return meta["device_kind"].replace(" ", "_")


def out_dir(arg: str | None) -> str:
  d = arg or os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")
  os.makedirs(d, exist_ok=True)
  return d


def write_json(path: str, payload: dict) -> None:
  with open(path, "w") as f:
    json.dump(payload, f, indent=1, sort_keys=True)
  print(f"wrote {path}")


def dense_matmul_tflops(n: int = 0, dtype="bfloat16") -> float:
  """The dense bf16 matmul rate of device 0 (cuBLAS through XLA), on random data."""
  import jax.numpy as jnp
  n = n or (8192 if jax.devices()[0].platform == "gpu" else 512)
  k1, k2 = jax.random.split(jax.random.key(0))
  a = jax.random.normal(k1, (n, n), jnp.float32).astype(dtype)
  b = jax.random.normal(k2, (n, n), jnp.float32).astype(dtype)
  f = jax.jit(lambda a, b: a @ b)
  t = time_ms(f, a, b, trials=5, min_batch_s=0.2)
  return 2.0 * n ** 3 / (t["median_ms"] * 1e-3) / 1e12


def grouped_bars(path: str, cases: list, series: dict, *, ylabel: str, log: bool = False,
                 labels: list | None = None) -> None:
  """A PNG of grouped bars: one group per case, one bar per series (name -> values)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(cases)), 4.5))
  width = 0.8 / max(1, len(series))
  for i, (name, vals) in enumerate(series.items()):
    kw = dict(color="k") if name == "floor" else {}
    ax.bar([j + i * width for j in range(len(cases))], vals, width, label=name, **kw)
  ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))])
  ax.set_xticklabels(labels or ["\n".join(map(str, c)) for c in cases], fontsize=7)
  ax.set_ylabel(ylabel)
  if log:
    ax.set_yscale("log")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  print(f"wrote {path}")


# ---------------------------------------------------------------------------
# Configuration names, one scheme for every benchmark:
#   <backend>[:<option>]...   backend: a key of uniep_jax.BACKENDS
# options:
#   ragged | padded | local   the transport ("xla_dropless", "pallas")
#   overlap[=D[,W]]           "uniep": OverlapConfig() (16 CTAs each), or D return CTAs
#                             beside the down GEMM and W beside the wgrad (W = D if absent)
#   auto                      kernel=None, transfer=None: the tune cache's point
#   cf=F                      "xla_capacity": capacity_factor F (default 1.25)
# e.g. "xla_capacity", "pallas:padded", "uniep", "uniep:overlap", "uniep:overlap=4"
# ---------------------------------------------------------------------------
def layer_config(name: str):
  """The `UniEPConfig` a benchmark configuration name stands for."""
  import uniep_jax
  backend, *options = name.split(":")
  if backend not in uniep_jax.BACKENDS:
    raise ValueError(f"configuration {name!r}: unknown backend {backend!r}; expected one of "
                     f"{tuple(uniep_jax.BACKENDS)}")
  fields = {}
  for opt in options:
    key, _, value = opt.partition("=")
    if key in ("ragged", "padded", "local") and not value:
      fields["transport"] = key
    elif key == "overlap":
      ctas = [int(v) for v in value.split(",")] if value else []
      if len(ctas) > 2:
        raise ValueError(f"configuration {name!r}: overlap=D[,W] takes at most two counts")
      fields["overlap"] = (uniep_jax.OverlapConfig() if not ctas else
                           uniep_jax.OverlapConfig(ctas[0], ctas[-1]))
    elif key == "auto" and not value:
      fields.update(kernel=None, transfer=None)
    elif key == "cf" and value:
      fields["capacity_factor"] = float(value)
    elif key == "fp8" and not value:
      fields["precision"] = "fp8"
    else:
      raise ValueError(f"configuration {name!r}: unknown option {opt!r} (known: ragged, "
                       f"padded, local, overlap[=D[,W]], auto, cf=F, fp8)")
  return uniep_jax.UniEPConfig(backend=backend, **fields)
