"""A/B of the expert FFN's grouped-GEMM launches on ONE GPU, at the MoE layer's shapes.

The MoE layer runs the FFN over its receive layout: R*T*K rows sized for the worst
case, of which ~T*K are live (EP = R = 4: three quarters dead). This bench times,
per shape, with the live rows balanced over the E/R local experts and M = live
rows ("no dead rows") or M = R * live ("layer"):

  plain_fwd       one plain forward x @ w_gate (N = F): the kernel's own rate
  gu_fwd          the gate/up launch ("gu" mode, N = 2F) incl. saving hu
  gu_fwd_skip     the same with dead tiles skipped (zero_window = block_k)
  interleave      gate_up_weights: the per-call copy of the gate/up weights
  ffn_fwdbwd      the whole FFN forward + backward (grouped_swiglu_ffn, VJP)
  ffn_fwdbwd_skip the same with zero_dead_rows=False (the layer's mode)
  dense           jnp.dot of one GEMM's FLOPs (cuBLAS), the rate to compare with
and, if a v1 copy of pallas_kernels/grouped_gemm.py is given (--v1 PATH, e.g.
`git show 7907917:pallas_kernels/grouped_gemm.py > abtmp/grouped_gemm_v1.py`), the
v1 launches in the same run: v1_swiglu_fwd (two 128x64 accumulators) and
v1_ffn_fwdbwd.

  python -m bench.ffn_ab [--shapes deepseek-like,mixtral-like] [--v1 abtmp/grouped_gemm_v1.py]

Writes ffn_ab_<device>.json (median ms, TFLOP/s) under --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench import common
from bench.grouped_gemm import CONFIGS, group_sizes_for, time_fn
from pallas_kernels import device as device_lib
from pallas_kernels import grouped_gemm as gg
from uniep_jax.config import KernelConfig


def _load_v1(path):
  spec = importlib.util.spec_from_file_location("grouped_gemm_v1", path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod   # dataclasses look their module up
  spec.loader.exec_module(mod)
  return mod


def run_shape(shape, dead_factor: int, v1, reps: int, trials: int) -> dict:
  cfg = KernelConfig()
  g = shape.local_experts
  live = shape.rows
  m = live * dead_factor
  h, f = shape.hidden, shape.ffn
  ks = jax.random.split(jax.random.key(0), 5)
  bf = jnp.bfloat16
  x = jax.random.normal(ks[0], (m, h), bf)
  wg = (jax.random.normal(ks[1], (g, h, f)) * h ** -0.5).astype(bf)
  wu = (jax.random.normal(ks[2], (g, h, f)) * h ** -0.5).astype(bf)
  wd = (jax.random.normal(ks[3], (g, f, h)) * f ** -0.5).astype(bf)
  dy = jax.random.normal(ks[4], (m, h), bf).at[live:].set(0)
  gs = jnp.asarray(group_sizes_for(live, g, "balanced"))
  w_gu = gg.gate_up_weights(wg, wu, cfg)
  flop_gemm = 2.0 * live * h * f
  ms = {}

  def t(name, fn, *args):
    try:
      ms[name] = 1e3 * time_fn(jax.jit(fn), *args, reps=reps, trials=trials)
    except Exception as e:  # noqa: BLE001 - record and go on
      ms[name] = None
      print(f"  {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    print(f"  {name:18s} {ms[name] if ms[name] is None else round(ms[name], 3)}", flush=True)

  t("plain_fwd", lambda a, b, s: gg.gmm(a, b, s, config=cfg, interpret=False), x, wg, gs)
  t("gu_fwd", lambda a, b, s: gg.gate_up_forward(a, b, s, config=cfg, save=True,
                                                  interpret=False), x, w_gu, gs)
  t("gu_fwd_skip", lambda a, b, s: gg.gate_up_forward(a, b, s, config=cfg, save=True,
                                                       interpret=False,
                                                       zero_window=cfg.block_k), x, w_gu, gs)
  t("interleave", lambda a, b: gg.gate_up_weights(a, b, cfg), wg, wu)

  def fwdbwd(ffn):
    def fn(x, wg, wu, wd, s, dy):
      y, vjp = jax.vjp(lambda *a: ffn(*a, s), x, wg, wu, wd)
      return y, vjp(dy)
    return fn

  t("ffn_fwdbwd", fwdbwd(lambda *a: gg.grouped_swiglu_ffn(*a, config=cfg, interpret=False)),
    x, wg, wu, wd, gs, dy)
  t("ffn_fwdbwd_skip", fwdbwd(lambda *a: gg.grouped_swiglu_ffn(
      *a, config=cfg, interpret=False, zero_dead_rows=False)), x, wg, wu, wd, gs, dy)
  if v1 is not None:
    f_p = gg.ffn_padded_ffn(f, cfg)
    wg_p, wu_p = gg._pad_axis(wg, 2, f_p), gg._pad_axis(wu, 2, f_p)
    t("v1_swiglu_fwd", lambda a, b, c, s: v1._row_tiled_call(
        [a], [b, c], s, mode="swiglu", transpose_b=False, out_dtype=bf, save_hu=True,
        config=cfg, interpret=False), x, wg_p, wu_p, gs)
    t("v1_ffn_fwdbwd", fwdbwd(lambda *a: v1.grouped_swiglu_ffn(*a, config=cfg,
                                                                  interpret=False)),
      x, wg, wu, wd, gs, dy)
  xd = jax.random.normal(ks[0], (live, h), bf)
  wdense = (jax.random.normal(ks[1], (h, f)) * h ** -0.5).astype(bf)
  t("dense", lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(bf),
    xd, wdense)
  flops = dict(plain_fwd=flop_gemm, gu_fwd=2 * flop_gemm, gu_fwd_skip=2 * flop_gemm,
               v1_swiglu_fwd=2 * flop_gemm, ffn_fwdbwd=9 * flop_gemm,
               ffn_fwdbwd_skip=9 * flop_gemm, v1_ffn_fwdbwd=9 * flop_gemm, dense=flop_gemm)
  tflops = {k: (flops[k] / (v * 1e-3) / 1e12 if v and k in flops else None)
            for k, v in ms.items()}
  return dict(shape=shape.name, rows_live=live, rows_total=m, local_experts=g, hidden=h, ffn=f,
              median_ms=ms, tflops=tflops)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--shapes", default="deepseek-like,mixtral-like")
  ap.add_argument("--dead-factors", default="4,1", help="M = factor x live rows")
  ap.add_argument("--v1", default=None)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--trials", type=int, default=3)
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  common.dump_stacks_on_usr1()
  out = common.out_dir(args.out)
  v1 = _load_v1(args.v1) if args.v1 and os.path.exists(args.v1) else None
  meta = common.run_metadata()
  print(meta, "v1:", v1 is not None, flush=True)
  rows = []
  path = os.path.join(out, f"ffn_ab_{device_lib.device_name()}.json")
  for name in args.shapes.split(","):
    for factor in (int(v) for v in args.dead_factors.split(",")):
      print(f"[{name}] rows x{factor}", flush=True)
      rows.append(run_shape(CONFIGS[name], factor, v1, args.reps, args.trials))
      common.write_json(path, dict(meta, benchmark="ffn_ab", rows=rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
