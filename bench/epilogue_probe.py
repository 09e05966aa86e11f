"""Where the short-K grouped-GEMM launches lose their time: the epilogue or the tile restart?
(ONE GPU. The epilogue variants are timing only: they compute wrong outputs on purpose;
the KernelConfig variants that keep the bits are checked against as_is.)

The wgrads (dw_gate_up, dw_down) too: their tiles' K is an expert's rows (~1024 on
deepseek-like at EP 4), so their epilogue may matter as well.
At EP 4 the launches whose contraction is H (gate/up "swiglu", da "dswiglu") and the short
down launch run 10-45% under the rate of the long-K ones (NOTES_grouped_gemm.md, "The short-K
launches' excess"). Each launch is timed as built and with parts of its epilogue removed AT
TRACE TIME, by swapping names the kernel body looks up in pallas_kernels.grouped_gemm while
it is lowered (restored right after):

  as_is        the kernel as built
  slots2       KernelConfig.epilogue_slots=2 (not "dswiglu"): a chunk is staged while
               the previous chunk's store still reads the other slot (are the waits
               between a tile's chunks part of the cost?)
  full_tile_tma  a candidate fix (bits unchanged): a full tile's chunk stored by one TMA
               behind one branch, the ladder (8 branches per chunk) only for partial tiles
  no_tma_store gg.ladder_store (and the wgrad's plgpu.copy_smem_to_gmem) no-ops: values
               still staged in SMEM, never stored
  no_hu_loads  ("dswiglu" only) the epilogue's h, u TMA loads and their barrier wait gone:
               it computes from whatever the buffers hold
  wgrad_r1 / wgrad_r4 / wgrad_r16  (wgrads only) KernelConfig.wgrad_raster 1 (row-major,
               the order before 2026-11-28's 26th session), 4, 16; as_is is the auto (4).
               Same bits, so not timing-only: how much the tile order saves
  stages2 / stages4 / rows1 / rows4 / rows16  (only when named in --variants) KernelConfig
               max_concurrent_steps 2 or 4 (a launch takes what fits in SMEM), raster_rows
               1, 4 or 16 (the row-tiled launches' bands; auto: 4, 8 or 1); inflight0 /
               inflight1 KernelConfig.mma_in_flight 0 or 1 (one wgmma group kept in
               flight, on one stage more where it fits; run 9's `inflight1_s4` was
               today's inflight1 on 3 -> 4 stages); same bits, checked
  no_epilogue  gg._store_epilogue / gg._dswiglu_epilogue behind a run-time condition that
               never holds: the mainloop (MMAs) and the per-tile pipeline restart only

as_is - no_epilogue is what the epilogue costs; no_epilogue against the FLOPs at the
long-K rate is the restart's share. (Runs 3 and 4 also timed an
experimental ping-pong kernel, removed since: NOTES_grouped_gemm.md.)

  python -m bench.epilogue_probe [--shapes qwen3-like,mixtral-like] [--out DIR]

Writes epilogue_probe_<device>.json (median ms per launch and variant) under --out.
Each launch's variants are timed one after another (median_ms, as in runs 1-8), then
in interleaved rounds, one batch of each in turn (interleaved_median_ms, since run 9):
a drift of the GPU reaches the later variants of the first, not of the second.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import types

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
import jax.numpy as jnp
import numpy as np

from bench import common
from bench.grouped_gemm import CONFIGS, time_fn
from pallas_kernels import device as device_lib
from pallas_kernels import grouped_gemm as gg
from uniep_jax.config import KernelConfig


def _noop(*_, **__):
  return None


class _PlgpuWithout(types.SimpleNamespace):
  """plgpu as gg sees it, minus the named functions (no-ops)."""

  def __init__(self, real, names):
    super().__init__(_real=real, _names=frozenset(names))

  def __getattr__(self, name):
    if name in self._names:
      return _noop
    return getattr(self._real, name)


# KernelConfig changes that keep the bits (timed only when named in --variants)
_SAME_BITS_CONFIGS = {
    "wgrad_r1": dict(wgrad_raster=1), "wgrad_r4": dict(wgrad_raster=4),
    "wgrad_r16": dict(wgrad_raster=16),
    "stages2": dict(max_concurrent_steps=2), "stages4": dict(max_concurrent_steps=4),
    "rows1": dict(raster_rows=1), "rows4": dict(raster_rows=4), "rows16": dict(raster_rows=16),
    "inflight0": dict(mma_in_flight=0), "inflight1": dict(mma_in_flight=1),
}
_OPT_IN = ("stages2", "stages4", "rows1", "rows4", "rows16", "inflight0", "inflight1")


@contextlib.contextmanager
def _variant(name: str):
  saved = dict(ladder_store=gg.ladder_store, _store_epilogue=gg._store_epilogue,
               _dswiglu_epilogue=gg._dswiglu_epilogue, plgpu=gg.plgpu)
  if name == "no_tma_store":
    gg.ladder_store = _noop                                  # the row-tiled launches
    gg.plgpu = _PlgpuWithout(saved["plgpu"], ("copy_smem_to_gmem",))   # the wgrad's
  elif name == "full_tile_tma":
    # a candidate fix, bits unchanged: a full tile (count == max_rows, from SMEM row 0) is
    # stored by ONE TMA behind one branch instead of walking the ladder's 8 branches
    ladder = saved["ladder_store"]

    def full_or_ladder(src, dst, smem_start, gmem_start, count, max_rows, **kw):
      full = (count == max_rows) & (smem_start == 0)

      @pl.when(full)
      def _full():
        plgpu.copy_smem_to_gmem(src, dst.at[pl.ds(gmem_start, max_rows)],
                                commit_group=kw.get("commit_group", True))

      @pl.when(~full)
      def _partial():
        ladder(src, dst, smem_start, gmem_start, count, max_rows, **kw)
    gg.ladder_store = full_or_ladder
  elif name == "no_hu_loads":
    gg.plgpu = _PlgpuWithout(saved["plgpu"], ("copy_gmem_to_smem", "barrier_wait"))
  elif name == "no_epilogue":
    # the epilogue behind a run-time condition that never holds (a tile's first output
    # row is never negative): the accumulator stays live, so the MMAs are kept (a plain
    # no-op let MLIR drop them: 1150-1180 "TFLOP/s" on H200, over the 989 peak, run 1)
    def never(fn):
      def wrapped(*args, gmem_row, **kw):
        pl.when(gmem_row < 0)(lambda: fn(*args, gmem_row=gmem_row, **kw))
      return wrapped
    gg._store_epilogue = never(saved["_store_epilogue"])
    gg._dswiglu_epilogue = never(saved["_dswiglu_epilogue"])
  elif name not in ("as_is", "slots2") and name not in _SAME_BITS_CONFIGS:
    # the others are KernelConfig changes, no patch
    raise ValueError(name)
  try:
    yield
  finally:
    for k, v in saved.items():
      setattr(gg, k, v)


def run_shape(shape, reps: int, trials: int, only=None, only_launches=None) -> dict:
  cfg = KernelConfig()   # the layer's defaults (raster auto, group-aligned tiles)
  g, live, h, f = shape.local_experts, shape.rows, shape.hidden, shape.ffn
  m = 4 * live           # the receive layout at EP 4: three quarters dead, skipped
  bf = jnp.bfloat16
  ks = jax.random.split(jax.random.key(0), 6)
  gs = jnp.asarray(np.random.default_rng(0).multinomial(live, np.full(g, 1.0 / g)), jnp.int32)
  f_p = gg._swiglu_padded_f(f, cfg)
  x = jax.random.normal(ks[0], (m, h), bf)
  wgu = (jax.random.normal(ks[1], (g, h, 2 * f_p)) * h ** -0.5).astype(bf)
  wd = (jax.random.normal(ks[2], (g, f_p, h)) * f_p ** -0.5).astype(bf)
  a = jax.random.normal(ks[3], (m, f_p), bf)
  hh = jax.random.normal(ks[4], (m, f_p), bf)
  uu = jax.random.normal(ks[5], (m, f_p), bf)
  dhu = jax.random.normal(ks[5], (m, 2 * f_p), bf)
  def launches(c):
    kw = dict(config=c, interpret=False, zero_window=c.block_k)
    return {
        "gate_up_swiglu": (lambda x, w, s: gg._row_tiled_call(
            [x], [w, w], s, mode="swiglu", transpose_b=False, out_dtype=bf, save_hu=True,
            b_col_offsets=(0, f_p), **kw), (x, wgu, gs), 2 * live * h * 2 * f),
        "down_plain": (lambda a, w, s: gg._row_tiled_call(
            [a], [w], s, mode="plain", transpose_b=False, out_dtype=bf, save_hu=False, **kw),
            (a, wd, gs), 2 * live * f * h),
        "da_dswiglu": (lambda dy, w, s, hh, uu: gg._row_tiled_call(
            [dy], [w], s, mode="dswiglu", transpose_b=True, out_dtype=bf, save_hu=False,
            epi_inputs=(hh, uu), **kw), (x, wd, gs, hh, uu), 2 * live * h * f),
        "dx_plain_t": (lambda d, w, s: gg._row_tiled_call(
            [d], [w], s, mode="plain", transpose_b=True, out_dtype=bf, save_hu=False, **kw),
            (dhu, wgu, gs), 2 * live * 2 * f * h),
        "dw_gate_up_wgrad": (lambda x, d, s: gg._wgrad_call(
            x, d, s, out_dtype=bf, config=c, interpret=False), (x, dhu, gs), 2 * live * h * 2 * f),
        "dw_down_wgrad": (lambda a, dy, s: gg._wgrad_call(
            a, dy, s, out_dtype=bf, config=c, interpret=False), (a, x, gs), 2 * live * f * h),
    }

  ms, tflops, bits_equal, inter_ms = {}, {}, {}, {}
  # the variants that are KernelConfig changes (the others patch the kernel: cfg)
  config_of = {"slots2": dataclasses.replace(cfg, epilogue_slots=2),
               **{n: dataclasses.replace(cfg, **kw) for n, kw in _SAME_BITS_CONFIGS.items()}}
  for lname in launches(cfg):
    if only_launches is not None and lname not in only_launches:
      continue
    as_is_out = None
    compiled_of = {}   # key -> executable, for the interleaved rounds after the loop
    variants = ["as_is", "slots2", "full_tile_tma", "no_tma_store", "no_epilogue"]
    if lname == "da_dswiglu":
      variants.insert(4, "no_hu_loads")
      variants.remove("slots2")   # its h, u buffers are its only staging
    if lname.endswith("_wgrad"):
      variants.remove("full_tile_tma")   # its tiles are always full: one TMA already
      variants[1:1] = ["wgrad_r1", "wgrad_r4", "wgrad_r16"]
    variants += [v for v in _OPT_IN if only is not None and v in only
                 and not (v.startswith("rows") and lname.endswith("_wgrad"))]   # no row tiles
    variants = [v for v in variants if only is None or v in only]
    for v in variants:
      key = f"{lname}/{v}"
      fn, args, flops = launches(config_of.get(v, cfg))[lname]
      try:
        with _variant(v):   # a new function object: jit's trace cache is keyed on it
          compiled = jax.jit(lambda *xs, fn=fn: fn(*xs)).lower(*args).compile()
        ms[key] = 1e3 * time_fn(compiled, *args, reps=reps, trials=trials)
        tflops[key] = flops / (ms[key] * 1e-3) / 1e12
        compiled_of[key] = compiled
        if v == "as_is" or v in _SAME_BITS_CONFIGS:   # same bits by contract: check them
          out_v = compiled(*args)
          if not lname.endswith("_wgrad"):   # only live rows are defined (dead ones are skipped)
            out_v = jax.tree.map(lambda o: o[:live], out_v)
          if v == "as_is":
            as_is_out = out_v
          elif as_is_out is not None:
            bits_equal[key] = all(bool(jnp.array_equal(a, b)) for a, b in zip(
                jax.tree.leaves(out_v), jax.tree.leaves(as_is_out)))
            print(f"  {key}: bits equal to as_is: {bits_equal[key]}", flush=True)
          else:   # as_is not timed (--variants) or failed: say so, not a silent pass
            bits_equal[key] = None
            print(f"  {key}: bits NOT checked (no as_is output)", flush=True)
      except Exception as e:  # noqa: BLE001 - record and go on
        ms[key] = None
        print(f"  {key}: {type(e).__name__}: {str(e)[:300]}", flush=True)
      print(f"  {key:32s} {ms[key] and round(ms[key], 3)} ms "
            f"{tflops.get(key) and round(tflops[key])} TFLOP/s", flush=True)
    if len(compiled_of) > 1:
      # the variants above ran one after another, so a drift of the GPU (clocks,
      # temperature) reached the later ones (run 8: one program 5.27 then 5.71 ms);
      # these rounds give every variant one batch in turn: compare THESE medians (args:
      # the launch's operands, the same arrays for every variant)
      rounds = common.time_interleaved_ms(
          {k: (c, reps) for k, c in compiled_of.items()}, *args, trials=max(trials, 5))
      for k, r in rounds.items():
        inter_ms[k] = r["median_ms"]
        print(f"  {k:32s} interleaved {round(r['median_ms'], 3)} ms "
              f"(min {round(r['min_ms'], 3)}, max {round(r['max_ms'], 3)})", flush=True)
  return dict(shape=shape.name, rows_live=live, rows_total=m, local_experts=g, hidden=h, ffn=f,
              group_sizes=[int(v) for v in jax.device_get(gs)], median_ms=ms, tflops=tflops,
              bits_equal_to_as_is=bits_equal, interleaved_median_ms=inter_ms)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--shapes", default="qwen3-like,mixtral-like")
  ap.add_argument("--reps", type=int, default=10)
  ap.add_argument("--trials", type=int, default=3)
  ap.add_argument("--out", default=None)
  ap.add_argument("--variants", default=None,
                  help="comma list: time only these variants")
  ap.add_argument("--launches", default=None,
                  help="comma list: time only these launches (e.g. dw_gate_up_wgrad)")
  args = ap.parse_args(argv)
  common.dump_stacks_on_usr1()
  out = common.out_dir(args.out)
  meta = common.run_metadata()
  print(meta, flush=True)
  rows = []
  path = os.path.join(out, f"epilogue_probe_{device_lib.device_name()}.json")
  for name in args.shapes.split(","):
    print(f"[{name}]", flush=True)
    rows.append(run_shape(CONFIGS[name], args.reps, args.trials,
                          only=set(args.variants.split(",")) if args.variants else None,
                          only_launches=(set(args.launches.split(",")) if args.launches
                                         else None)))
    common.write_json(path, dict(meta, benchmark="epilogue_probe", rows=rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
