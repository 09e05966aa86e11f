"""The expert FFN's grouped-GEMM launches on ONE GPU, at the MoE layer's shapes, with
an optional A/B against another version of pallas_kernels/grouped_gemm.py.

The MoE layer runs the FFN over its receive layout: R*T*K rows sized for the worst
case, of which ~T*K are live (EP = R = 4: three quarters dead). Per shape, with the
live rows balanced over the E/R local experts and M = factor x live rows
(--dead-factors; 4 = the layer at EP 4, 1 = no dead rows), it times:

  plain_fwd        one plain forward x @ w_gate (N = F): the kernel's own rate
  gate_up_fwd      the fused gate/up launch (mode "swiglu" on w_gate_up, saving h and u)
  gate_up_fwd_skip the same with the dead tiles skipped (zero_window = block_k)
  gate_up_fwd_skip_two_arrays  the same launch with w_gate and w_up as two arrays (the
                   layout before w_gate_up): was the 1 ms it lost on deepseek-like
                   (NOTES_grouped_gemm.md) the one array's row pitch?
  ffn_fwdbwd       the whole FFN forward + backward (grouped_swiglu_ffn, VJP)
  ffn_fwdbwd_skip  the same with zero_dead_rows=False (the MoE layer's mode)
  ffn_fwdbwd_skip_fused_da  and with fuse_da_epilogue=True (dh, du in da's epilogue:
                   the MoE layer's default)
  ffn_fwdbwd_skip_fused_da_epi2  and with KernelConfig.epilogue_slots=2 (EXPERIMENTAL;
                   its bits against one slot's: fused_da_check["epilogue_slots_2"])
  gate_up_as_plain  x @ w_gate_up by the "plain" launch (one N=128 accumulator per
                   warpgroup; no SwiGLU): the same FLOPs as gate_up_fwd_skip
  dx               the dx launch alone: [dh | du] @ w_gate_up^T, "plain" over K = 2F
  gate_up_fwd_skip_rR_ga, ffn_fwdbwd_skip_fused_da_rR_ga  and with
                   KernelConfig.group_aligned_tiles (tiles from each expert's first row
                   instead of block-aligned row blocks); its bits against the rR row's:
                   fused_da_check["raster_R_ga"]. Only differs from the rR row where the
                   experts' row counts are not multiples of block_m: --groups routed
  gate_up_fwd_skip_rR, ffn_fwdbwd_skip_fused_da_rR  the same with KernelConfig.raster_rows
                   = R for each R of --raster (default 8; e.g. 8,16 times both in one
                   run: the tiles walked in bands of R row tiles;
                   every other row walks them row-major, raster_rows=1); its bits
                   against row-major's: fused_da_check["raster_R"]
  dense            jnp.dot of one GEMM's FLOPs (cuBLAS), the rate to compare with
  alt_ffn_fwdbwd   with --alt PATH: that module's grouped_swiglu_ffn fwd+bwd
                   (zero_dead_rows=False, fuse_da_epilogue=True; separate w_gate,
                   w_up if its signature takes them), e.g. an earlier version:
                   `git show REV:pallas_kernels/grouped_gemm.py > abtmp/gg_alt.py`
                   (abtmp/ in .git/info/exclude: name it in the device call's carry);
                   fused_da_check["alt_bits"]: ffn_fwdbwd_skip_fused_da's bits against
                   it (same config), for a change that must not change any

  --groups balanced (default: the live rows split equally, every expert a multiple of
  128 rows on the four shapes) | routed (a multinomial draw of the live rows over the
  experts, seed 0: the row counts balanced top-k routing gives, boundaries anywhere)

  python -m bench.ffn_ab [--shapes deepseek-like,mixtral-like] [--alt abtmp/gg_alt.py]
      [--rows NAME,...] (only these rows; e.g. a short A/B)  [--no-checks] (skip the
                     fused_da and epilogue-slot bit checks)
      [--profile]   (also a kernel-level profile of ffn_fwdbwd_skip_fused_da, and of
                     alt_ffn_fwdbwd with --alt: each launch's time, bench/profile_layer.py's
                     reduction; traces under --out/trace_*)

Writes ffn_ab_<device>.json (median ms, TFLOP/s per row) under --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
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


def _load_module(path):
  spec = importlib.util.spec_from_file_location("grouped_gemm_alt", path)
  mod = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = mod   # dataclasses look their module up
  spec.loader.exec_module(mod)
  return mod


def _fwdbwd(ffn):
  """fn(x, *weights, group_sizes, dy) -> (y, grads of x and the weights)."""
  def fn(x, *rest):
    *ws, s, dy = rest
    y, vjp = jax.vjp(lambda *a: ffn(*a, s), x, *ws)
    return y, vjp(dy)
  return fn


def _profile(fn, args, trace_dir: str, calls: int = 2) -> dict:
  """Kernel table and timeline (one device) of `calls` calls of the jitted fn."""
  import glob
  from bench.profile_layer import _events, summarize
  jax.block_until_ready(fn(*args))
  with jax.profiler.trace(trace_dir):
    for _ in range(calls):
      jax.block_until_ready(fn(*args))
  path = max(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True),
             key=os.path.getmtime)
  for raw in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
    os.remove(raw)
  table = summarize(*_events(path), calls=calls, min_us=50.0)
  dev = next(iter(table.values()))
  n = len(dev["timeline"]) // calls
  return dict(span_per_call_ms=dev["span_per_call_us"] / 1e3,
              busy_per_call_ms=dev["busy_per_call_us"] / 1e3,
              kernels=dev["kernels"], timeline_one_call=dev["timeline"][-n:] if n else [])


def _tile_variants(cfg, raster: int) -> list:
  """(tag, KernelConfig) of the _rR rows: tiles in bands of `raster` row tiles,
  block-aligned (tag "") and group-aligned ("_ga", KernelConfig.group_aligned_tiles)."""
  cfg_r = dataclasses.replace(cfg, raster_rows=raster)
  return [("", cfg_r), ("_ga", dataclasses.replace(cfg_r, group_aligned_tiles=True))]


def run_shape(shape, dead_factor: int, alt, reps: int, trials: int,
              profile_dir: str | None = None, skip_timing: bool = False,
              rows: set | None = None, checks_on: bool = True,
              rasters: tuple = (8,), groups: str = "balanced") -> dict:
  # the baseline rows walk the tiles row-major, in block-aligned row tiles (the _ga rows:
  # group-aligned, KernelConfig's default since 2026-11-28)
  cfg = KernelConfig(raster_rows=1, group_aligned_tiles=False)
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
  wgu = jnp.concatenate([wg, wu], axis=2)                          # [G, H, 2F]
  dy = jax.random.normal(ks[4], (m, h), bf).at[live:].set(0)
  if groups == "routed":   # what balanced top-k routing gives: boundaries anywhere
    gs = jnp.asarray(np.random.default_rng(0).multinomial(live, np.full(g, 1.0 / g)),
                     jnp.int32)
  else:
    gs = jnp.asarray(group_sizes_for(live, g, "balanced"))
  f_p = gg._swiglu_padded_f(f, cfg)
  wgu_p = gg._pad_gate_up(wgu, f_p)                                # F padded as the FFN does
  ms = {}

  def t(name, fn, *args):
    if skip_timing or (rows is not None and name not in rows):
      return
    try:
      jf = fn if hasattr(fn, "lower") else jax.jit(fn)   # a jitted fn keeps its compile
      ms[name] = 1e3 * time_fn(jf, *args, reps=reps, trials=trials)
    except Exception as e:  # noqa: BLE001 - record and go on
      ms[name] = None
      print(f"  {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    print(f"  {name:18s} {ms[name] if ms[name] is None else round(ms[name], 3)}", flush=True)

  def gate_up(zero_window, config=cfg):
    return lambda a, b, s: gg._row_tiled_call(
        [a], [b, b], s, mode="swiglu", transpose_b=False, out_dtype=bf, save_hu=True,
        config=config, interpret=False, zero_window=zero_window, b_col_offsets=(0, f_p))

  def ffn(config=cfg, **kw):
    return _fwdbwd(lambda *a: gg.grouped_swiglu_ffn(*a, config=config, interpret=False, **kw))

  t("plain_fwd", lambda a, b, s: gg.gmm(a, b, s, config=cfg, interpret=False), x, wg, gs)
  t("gate_up_fwd", gate_up(None), x, wgu_p, gs)
  t("gate_up_fwd_skip", gate_up(cfg.block_k), x, wgu_p, gs)
  t("gate_up_fwd_skip_two_arrays", lambda a, b, c, s: gg._row_tiled_call(
      [a], [b, c], s, mode="swiglu", transpose_b=False, out_dtype=bf, save_hu=True, config=cfg,
      interpret=False, zero_window=cfg.block_k), x, wgu_p[:, :, :f_p], wgu_p[:, :, f_p:], gs)
  t("ffn_fwdbwd", ffn(), x, wgu, wd, gs, dy)
  t("ffn_fwdbwd_skip", ffn(zero_dead_rows=False), x, wgu, wd, gs, dy)
  # jitted once: timed here and the reference of the bit checks below (one compile each)
  ffn_row_major = jax.jit(ffn(zero_dead_rows=False, fuse_da_epilogue=True))
  t("ffn_fwdbwd_skip_fused_da", ffn_row_major, x, wgu, wd, gs, dy)
  cfg_epi2 = dataclasses.replace(cfg, epilogue_slots=2)
  ffn_epi2 = jax.jit(ffn(cfg_epi2, zero_dead_rows=False, fuse_da_epilogue=True))
  t("ffn_fwdbwd_skip_fused_da_epi2", ffn_epi2, x, wgu, wd, gs, dy)
  # The dual-accumulator gate/up launch against a "plain" launch of the same FLOPs
  # (per-warpgroup N 64 with two accumulators, against N 128 with one)
  kw = dict(config=cfg, interpret=False, zero_window=cfg.block_k)
  t("gate_up_as_plain", lambda a, b, s: gg._row_tiled_call(
      [a], [b], s, mode="plain", transpose_b=False, out_dtype=bf, save_hu=False, **kw),
    x, wgu_p, gs)
  dhu = jax.random.normal(ks[1], (m, 2 * f_p), bf)
  h_out = gg._round_up(h, 2 * cfg.block_n)
  t("dx", lambda a, b, s: gg._row_tiled_call(
      [a], [b], s, mode="plain", transpose_b=True, out_dtype=bf, save_hu=False, **kw),
    dhu, gg._pad_axis(wgu_p, 1, h_out), gs)
  # the tile order: bands of R row tiles (KernelConfig.raster_rows), each R of `rasters`
  checks = {}
  for raster in rasters:
    # block-aligned tiles in bands (bits against row-major's), then group-aligned ones
    # (bits against the banded block-aligned's)
    reference = ffn_row_major
    for tag, c in _tile_variants(cfg, raster):
      t(f"gate_up_fwd_skip_r{raster}{tag}", gate_up(cfg.block_k, c), x, wgu_p, gs)
      variant = jax.jit(ffn(c, zero_dead_rows=False, fuse_da_epilogue=True))
      t(f"ffn_fwdbwd_skip_fused_da_r{raster}{tag}", variant, x, wgu, wd, gs, dy)
      if rows is None or f"ffn_fwdbwd_skip_fused_da_r{raster}{tag}" in rows:
        checks[f"raster_{raster}{tag}"] = _compare_bits(reference, variant,
                                                        (x, wgu, wd, gs, dy), live)
      reference = variant
  if checks_on:
    checks.update(_compare_fused_da(x, wgu, wd, gs, dy, cfg, live))
    checks["epilogue_slots_2"] = _compare_bits(ffn_row_major, ffn_epi2,
                                               (x, wgu, wd, gs, dy), live)
  if alt is not None:
    alt_kw = dict(config=cfg, interpret=False, zero_dead_rows=False, fuse_da_epilogue=True)
    if "w_gate" in inspect.signature(alt.grouped_swiglu_ffn).parameters:
      t("alt_ffn_fwdbwd", _fwdbwd(lambda *a: alt.grouped_swiglu_ffn(*a, **alt_kw)),
        x, wg, wu, wd, gs, dy)
    else:
      alt_fn = jax.jit(_fwdbwd(lambda *a: alt.grouped_swiglu_ffn(*a, **alt_kw)))
      t("alt_ffn_fwdbwd", alt_fn, x, wgu, wd, gs, dy)
      if rows is None or "alt_ffn_fwdbwd" in rows:   # same config: the same bits expected
        checks["alt_bits"] = _compare_bits(alt_fn, ffn_row_major, (x, wgu, wd, gs, dy), live)
  profiles = {}
  if profile_dir is not None:
    cases = [("ffn_fwdbwd_skip_fused_da", ffn(zero_dead_rows=False, fuse_da_epilogue=True),
              (x, wgu, wd, gs, dy))]
    for raster in rasters:   # the layer's tile order, block-aligned and group-aligned tiles
      for tag, c in _tile_variants(cfg, raster):
        cases.append((f"ffn_fwdbwd_skip_fused_da_r{raster}{tag}",
                      ffn(c, zero_dead_rows=False, fuse_da_epilogue=True), (x, wgu, wd, gs, dy)))
    if alt is not None:
      alt_w = (wg, wu, wd) if "w_gate" in inspect.signature(alt.grouped_swiglu_ffn).parameters \
          else (wgu, wd)
      cases.append(("alt_ffn_fwdbwd", _fwdbwd(lambda *a: alt.grouped_swiglu_ffn(*a, **alt_kw)),
                    (x, *alt_w, gs, dy)))
    for name, fn, args in cases:
      try:
        profiles[name] = _profile(jax.jit(fn), args,
                                  os.path.join(profile_dir, f"trace_{shape.name}_{name}"))
        print(f"  profile {name}: " + ", ".join(
            f"{e['name'][:40]} {e['ms']}" for e in profiles[name]["timeline_one_call"]),
              flush=True)
      except Exception as e:  # noqa: BLE001 - record and go on
        profiles[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        print(f"  profile {name}: {profiles[name]['error']}", flush=True)
  xd = jax.random.normal(ks[0], (live, h), bf)
  wdense = (jax.random.normal(ks[1], (h, f)) * h ** -0.5).astype(bf)
  t("dense", lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(bf),
    xd, wdense)
  gemm = 2.0 * live * h * f   # FLOPs of one of the FFN's GEMMs over the live rows
  flops = dict(plain_fwd=gemm, gate_up_fwd=2 * gemm, gate_up_fwd_skip=2 * gemm,
               gate_up_fwd_skip_two_arrays=2 * gemm, ffn_fwdbwd_skip_fused_da_epi2=9 * gemm,
               gate_up_as_plain=2 * gemm, dx=2 * gemm,
               ffn_fwdbwd=9 * gemm, ffn_fwdbwd_skip=9 * gemm, ffn_fwdbwd_skip_fused_da=9 * gemm,
               alt_ffn_fwdbwd=9 * gemm, dense=gemm)
  for raster in rasters:
    for tag, _ in _tile_variants(cfg, raster):
      flops[f"gate_up_fwd_skip_r{raster}{tag}"] = 2 * gemm
      flops[f"ffn_fwdbwd_skip_fused_da_r{raster}{tag}"] = 9 * gemm
  tflops = {k: (flops[k] / (v * 1e-3) / 1e12 if v else None) for k, v in ms.items()}
  return dict(shape=shape.name, rows_live=live, rows_total=m, local_experts=g, hidden=h, ffn=f,
              groups=groups, group_sizes=[int(v) for v in jax.device_get(gs)],
              median_ms=ms, tflops=tflops, fused_da_check=checks,
              **({"profile": profiles} if profiles else {}))


def _compare_bits(ref_fn, fn, args, live):
  """On the GPU: does fn give ref_fn's bits (y and dx over the live rows, the weight
  gradients), and its own twice? (e.g. KernelConfig.epilogue_slots=2, whose stores
  overlap the next chunk: a race would show here, not in the CPU interpret mode.)"""
  def run(f):
    y, g = (f if hasattr(f, "lower") else jax.jit(f))(*args)
    return jax.device_get((y[:live], g[0][:live]) + tuple(g[1:]))
  try:
    ref, got, again = run(ref_fn), run(fn), run(fn)
  except Exception as e:  # noqa: BLE001 - record and go on
    print(f"  bits check: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return dict(error=f"{type(e).__name__}: {str(e)[:300]}")
  out = dict(bitwise_equal=all(bool((r == g).all()) for r, g in zip(ref, got)),
             repeatable=all(bool((g == a).all()) for g, a in zip(got, again)))
  print(f"  bits check: {out}", flush=True)
  return out


def _compare_fused_da(x, wgu, wd, gs, dy, cfg, live):
  """On the GPU: the gradients with dh, du in da's epilogue against the XLA pass
  (same formula, f32, then bf16; XLA may fuse it differently, so bitwise equality is
  reported, not required), max abs difference per gradient over the live rows, and
  whether two runs of the fused version give the same bits."""
  def grads(fuse):
    f = jax.jit(_fwdbwd(lambda *a: gg.grouped_swiglu_ffn(
        *a, config=cfg, interpret=False, zero_dead_rows=False, fuse_da_epilogue=fuse)))
    y, g = f(x, wgu, wd, gs, dy)
    return jax.device_get((y[:live], g[0][:live]) + tuple(g[1:3]))
  try:
    ref, fused, again = grads(False), grads(True), grads(True)
  except Exception as e:  # noqa: BLE001 - record and go on
    print(f"  fused_da check: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return dict(error=f"{type(e).__name__}: {str(e)[:300]}")
  names = ("y", "dx", "dw_gate_up", "dw_down")
  out = {}
  for n, r, f, a in zip(names, ref, fused, again):
    r32, f32 = jnp.asarray(r, jnp.float32), jnp.asarray(f, jnp.float32)
    out[n] = dict(bitwise_equal_to_xla_pass=bool((r == f).all()),
                  repeatable=bool((f == a).all()),
                  max_abs_diff=float(jnp.max(jnp.abs(r32 - f32))),
                  max_abs_ref=float(jnp.max(jnp.abs(r32))))
  print(f"  fused_da check: {out}", flush=True)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--shapes", default="deepseek-like,mixtral-like")
  ap.add_argument("--dead-factors", default="4", help="M = factor x live rows")
  ap.add_argument("--alt", default=None)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--trials", type=int, default=3)
  ap.add_argument("--out", default=None)
  ap.add_argument("--profile", action="store_true",
                  help="kernel-level profile of the FFN fwd+bwd (and of --alt's)")
  ap.add_argument("--skip-timing", action="store_true",
                  help="with --profile: only the profiles and the fused_da check")
  ap.add_argument("--rows", default=None, help="comma list: time only these rows")
  ap.add_argument("--no-checks", action="store_true",
                  help="skip the fused_da and epilogue-slot bit checks")
  ap.add_argument("--raster", default="8",
                  help="comma list: raster_rows of the _rR rows (one pair of rows each)")
  ap.add_argument("--groups", default="balanced", choices=("balanced", "routed"),
                  help="the experts' row counts: equal, or a multinomial draw (routing)")
  args = ap.parse_args(argv)
  common.dump_stacks_on_usr1()
  out = common.out_dir(args.out)
  alt = _load_module(args.alt) if args.alt and os.path.exists(args.alt) else None
  meta = dict(common.run_metadata(), alt=args.alt if alt is not None else None)
  print(meta, flush=True)
  rows = []
  path = os.path.join(out, f"ffn_ab_{device_lib.device_name()}.json")
  for name in args.shapes.split(","):
    for factor in (int(v) for v in args.dead_factors.split(",")):
      print(f"[{name}] rows x{factor}", flush=True)
      rows.append(run_shape(CONFIGS[name], factor, alt, args.reps, args.trials,
                            profile_dir=out if args.profile else None,
                            skip_timing=args.skip_timing,
                            rows=set(args.rows.split(",")) if args.rows else None,
                            checks_on=not args.no_checks,
                            rasters=tuple(int(v) for v in args.raster.split(",")),
                            groups=args.groups))
      common.write_json(path, dict(meta, benchmark="ffn_ab", rows=rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
