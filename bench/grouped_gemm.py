"""Benchmark and full-size check of the Pallas grouped GEMM (pallas_kernels.grouped_gemm).

For the expert shapes of the target configurations (`uniep_jax.measure.SHAPES`: M =
T * top_k rows over E / 4 local experts, EP = 4; balanced and skewed loads) it times,
in one run on one device: our forward, dgrad and wgrad; a dense jnp.dot of the same
FLOPs (cuBLAS); lax.ragged_dot; jax's ops.gpu.ragged_dot_mgpu (forward, where it runs);
and the SwiGLU FFN forward and forward+backward. It checks every kernel against dense
per-group products at full size (bf16 inputs, relative Frobenius error).

Timing: each op is jitted and warmed up; then `reps` back-to-back calls are
timed with block_until_ready around the batch, `trials` times; the median of
the per-call times is reported.

  python -m bench.grouped_gemm [--out DIR] [--configs a,b] [--loads balanced,skewed]
      [--reps N] [--trials N] [--no-check] [--block-m M --block-n N --block-k K --stages S]
      [--precision bf16|fp8]

Writes grouped_gemm_<device>.json into --out (default $OUT or bench/results), rewritten
after every shape. --precision fp8 (grouped_gemm_fp8_<device>.json) times, in one run:
the FP8 kernel (pallas_kernels.fp8_gemm) fwd and dgrad on operands quantised
beforehand in each --fp8-tiles tiling, the same with the quantisation and copies
they need, our bf16 kernel (fwd, dgrad, wgrad) on the same shapes, and XLA's dense
bf16 and e4m3 dots of the same FLOPs; the FP8 FFN forward and forward+backward
against the bf16 one; and checks both FP8 directions against the float32 product of
the dequantised operands.

GPU only (the kernels are compiled for Mosaic GPU); importable on the
CPU (nothing runs at import).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import device as device_lib
from pallas_kernels import grouped_gemm as gg
from pallas_kernels.grouped_gemm import KernelConfig
from uniep_jax.measure import SHAPES, git_commit


@dataclasses.dataclass(frozen=True)
class MoeShape:
  name: str
  tokens: int  # T, tokens per rank
  hidden: int  # H
  ffn: int  # F
  experts: int  # E
  top_k: int
  ep: int = 4

  @property
  def rows(self) -> int:
    return self.tokens * self.top_k

  @property
  def local_experts(self) -> int:
    return self.experts // self.ep


CONFIGS = {name: MoeShape(s.name, s.tokens, s.hidden, s.ffn, s.experts, s.top_k)
           for name, s in SHAPES.items()}


def group_sizes_for(rows: int, groups: int, load: str) -> np.ndarray:
  """Balanced: equal split. Skewed: p_g ~ (g + 1)^-1.2 (first expert hottest), last group empty."""
  if load == "balanced":
    sizes = np.full(groups, rows // groups, np.int64)
    sizes[: rows - sizes.sum()] += 1
  else:
    p = (np.arange(groups) + 1.0) ** -1.2
    if groups > 1:
      p[-1] = 0.0
    sizes = np.floor(p / p.sum() * rows).astype(np.int64)
    sizes[0] += rows - sizes.sum()
  assert sizes.sum() == rows
  return sizes.astype(np.int32)


def time_fn(fn, *args, reps: int, trials: int) -> float:
  """Median seconds per call of a jitted fn (warm-up, then `trials` batches of `reps`)."""
  jax.block_until_ready(fn(*args))
  per_call = []
  for _ in range(trials):
    t0 = time.perf_counter()
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    per_call.append((time.perf_counter() - t0) / reps)
  return statistics.median(per_call)


def rel_err(x, ref) -> float:
  x = jnp.asarray(x, jnp.float32)
  ref = jnp.asarray(ref, jnp.float32)
  return float(jnp.linalg.norm(x - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))


def _mgpu_ragged_dot():
  try:
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    return ragged_dot_mgpu.ragged_dot
  except Exception:
    return None


def _shape_inputs(shape: MoeShape, load: str):
  """The operands of one (shape, load) point, the same in every mode: (m, h, f, g,
  group sizes (numpy, jax), spare keys, x [M, H], w [G, H, F], dout [M, F], FLOPs of one
  GEMM, the result record)."""
  m, h, f, g = shape.rows, shape.hidden, shape.ffn, shape.local_experts
  gs_np = group_sizes_for(m, g, load)
  ks = jax.random.split(jax.random.key(hash((shape.name, load)) % (2**31)), 6)
  bf = jnp.bfloat16
  x = jax.random.normal(ks[0], (m, h), jnp.float32).astype(bf)
  w = (jax.random.normal(ks[1], (g, h, f), jnp.float32) / np.sqrt(h)).astype(bf)
  dout = jax.random.normal(ks[2], (m, f), jnp.float32).astype(bf)
  flops = 2.0 * m * h * f
  res = {"config": shape.name, "load": load, "M": m, "K": h, "N": f, "G": g,
         "group_sizes_min": int(gs_np.min()), "group_sizes_max": int(gs_np.max()),
         "flops_per_gemm": flops, "ms": {}, "tflops": {}, "rel_err": {}, "errors": {}}
  return m, h, f, g, gs_np, jnp.asarray(gs_np), ks, x, w, dout, flops, res


def _recorder(res: dict, shape: MoeShape, load: str, reps: int, trials: int, log):
  """record(name, fn, *args, flop=...): times fn into res (ms, TFLOP/s) and logs it; a
  failure is recorded in res["errors"] and the run goes on."""
  def record(name, fn, *args, flop=res["flops_per_gemm"]):
    try:
      t = time_fn(fn, *args, reps=reps, trials=trials)
      res["ms"][name] = t * 1e3
      res["tflops"][name] = flop / t / 1e12
      log(f"  {shape.name:14s} {load:8s} {name:30s} {t * 1e3:9.3f} ms {flop / t / 1e12:7.1f} TFLOP/s")
    except Exception as e:  # keep going: one failing baseline must not lose the run
      res["errors"][name] = f"{type(e).__name__}: {str(e)[:600]}"
      log(f"  {shape.name:14s} {load:8s} {name:30s} FAILED {type(e).__name__}: {str(e)[:300]}")
  return record


@functools.lru_cache(maxsize=None)
def _jitted(config: KernelConfig):
  """Jitted ops, one set per config, so both loads of a shape share compilations."""
  bf = jnp.bfloat16
  fwd = jax.jit(lambda a, b, s: gg.gmm(a, b, s, config=config, interpret=False))
  dgrad = jax.jit(lambda d, b, s: gg.gmm_dgrad(d, b, s, config=config, interpret=False))
  wgrad = jax.jit(lambda a, d, s: gg.gmm_wgrad(a, d, s, config=config, interpret=False))
  ffn = jax.jit(lambda *a: gg.grouped_swiglu_ffn(*a, config=config, interpret=False))

  def ffn_train(x, wgu, wd, s, dy):
    y, vjp = jax.vjp(lambda *a: gg.grouped_swiglu_ffn(*a, s, config=config, interpret=False),
                     x, wgu, wd)
    return y, vjp(dy)

  ragged = jax.jit(lambda a, b, s: jax.lax.ragged_dot(
      a, b, s, preferred_element_type=jnp.float32).astype(bf))
  dense = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(bf))
  return fwd, dgrad, wgrad, ffn, jax.jit(ffn_train), ragged, dense


def bench_shape(shape: MoeShape, load: str, config: KernelConfig, reps: int, trials: int,
                check_on: bool, log, lax_ragged_max_groups: int = 16) -> dict:
  m, h, f, g, gs_np, gs, ks, x, w, dout, flops, res = _shape_inputs(shape, load)
  record = _recorder(res, shape, load, reps, trials, log)
  bf = jnp.bfloat16

  fwd, dgrad, wgrad, ffn, ffn_train, ragged, dense = _jitted(config)
  w_dense = w[0]  # [H, F]: a dense [M, H] @ [H, F] has the same FLOPs

  # lax.ragged_dot(_general) materialises [G, M, K] (56 GiB on deepseek-like), so the
  # full-size check compares whole groups against dense per-group products instead:
  # the first two, the largest and the last two groups (static host-side slices).
  check_groups = np.unique(np.array([0, 1, int(np.argmax(gs_np)), g - 2, g - 1]) % g)
  ends = np.cumsum(gs_np)
  spans = [(int(ends[i] - gs_np[i]), int(ends[i])) for i in check_groups]
  rows_idx = np.concatenate([np.arange(a, b) for a, b in spans] + [np.zeros(0, np.int64)])

  def rows_ref(a, b):  # a [M, K], b [G, K, N] -> checked rows of a @ b[g], f32
    return jnp.concatenate([jnp.dot(a[s0:e0], b[i], preferred_element_type=jnp.float32)
                            for i, (s0, e0) in zip(check_groups, spans)], axis=0)

  def wgrad_ref(a, d):
    return jnp.stack([jnp.dot(a[s0:e0].T, d[s0:e0], preferred_element_type=jnp.float32)
                      for s0, e0 in spans])

  def ffn_ref(x, wgu, wd):
    outs = []
    f_half = wgu.shape[2] // 2
    for i, (s0, e0) in zip(check_groups, spans):
      hh = jnp.dot(x[s0:e0], wgu[i, :, :f_half], preferred_element_type=jnp.float32)
      uu = jnp.dot(x[s0:e0], wgu[i, :, f_half:], preferred_element_type=jnp.float32)
      aa = (jax.nn.silu(hh) * uu).astype(x.dtype)
      outs.append(jnp.dot(aa, wd[i], preferred_element_type=jnp.float32))
    return jnp.concatenate(outs, axis=0)

  def check(name, got_fn, ref_fn, *args, sel=lambda o: o[rows_idx]):
    try:
      got = sel(got_fn(*args))
      ref = jax.jit(ref_fn)(*args)
      res["rel_err"][name] = rel_err(got, ref)
      log(f"  {shape.name:14s} {load:8s} check {name:8s} rel_err {res['rel_err'][name]:.2e}")
    except Exception as e:
      res["errors"]["check_" + name] = f"{type(e).__name__}: {str(e)[:400]}"
      log(f"  check {name} FAILED {type(e).__name__}: {str(e)[:300]}")

  if check_on:
    check("fwd", fwd, lambda a, b, s_: rows_ref(a, b), x, w, gs)
    check("dgrad", dgrad, lambda d, b, s_: rows_ref(d, jnp.swapaxes(b, 1, 2)), dout, w, gs)
    check("wgrad", wgrad, lambda a, d, s_: wgrad_ref(a, d), x, dout, gs,
          sel=lambda o: o[check_groups])

  record("dense_jnp_dot", dense, x, w_dense)
  record("ours_fwd", fwd, x, w, gs)
  record("ours_dgrad", dgrad, dout, w, gs)
  record("ours_wgrad", wgrad, x, dout, gs)
  if g <= lax_ragged_max_groups:
    record("lax_ragged_dot_fwd", ragged, x, w, gs)
  else:  # XLA's ragged_dot materialises [G, M, K]: out of memory at these sizes
    res["errors"]["lax_ragged_dot_fwd"] = (
        f"skipped: G={g} > {lax_ragged_max_groups} (XLA's ragged_dot materialises "
        "[G, M, K]: 56 GiB for deepseek-like)")
  mgpu = _mgpu_ragged_dot()
  if mgpu is not None:
    mg = jax.jit(lambda a, b, s: mgpu(a, b, group_sizes=s, block_m=128, block_n=128, block_k=64,
                                       max_concurrent_steps=4, grid_block_n=1))
    record("ragged_dot_mgpu_fwd", mg, x, w, gs)

  # The SwiGLU FFN, grouped_swiglu_ffn (the FLOPs of 3 GEMMs forward, 6 backward), on
  # w_gate_up = [w | wu]: one gate/up launch and the down GEMM forward; da, dx (K = 2F)
  # and 2 wgrads backward.
  wu = (jax.random.normal(ks[3], (g, h, f), jnp.float32) / np.sqrt(h)).astype(bf)
  wgu = jnp.concatenate([w, wu], axis=2)
  wd = (jax.random.normal(ks[4], (g, f, h), jnp.float32) / np.sqrt(f)).astype(bf)
  dy = jax.random.normal(ks[5], (m, h), jnp.float32).astype(bf)
  if check_on:
    check("ffn_fwd", ffn, lambda x_, a_, c_, s_: ffn_ref(x_, a_, c_), x, wgu, wd, gs)
  record("ours_ffn_fwd", ffn, x, wgu, wd, gs, flop=3 * flops)
  record("ours_ffn_fwd_bwd", ffn_train, x, wgu, wd, gs, dy, flop=9 * flops)

  t = res["tflops"]
  if "dense_jnp_dot" in t:
    for k in ("ours_fwd", "ours_dgrad", "ours_wgrad", "ours_ffn_fwd", "ours_ffn_fwd_bwd"):
      if k in t:
        res[f"ratio_{k}_vs_dense"] = t[k] / t["dense_jnp_dot"]
  if "ragged_dot_mgpu_fwd" in t and "ours_fwd" in t:
    res["ratio_ours_fwd_vs_mgpu"] = t["ours_fwd"] / t["ragged_dot_mgpu_fwd"]
  if "lax_ragged_dot_fwd" in t and "ours_fwd" in t:
    res["ratio_ours_fwd_vs_lax_ragged"] = t["ours_fwd"] / t["lax_ragged_dot_fwd"]
  return res


@functools.lru_cache(maxsize=None)
def _jitted_fp8(config, bf16_config):
  from pallas_kernels import fp8_gemm as fg
  kw = dict(config=config, interpret=False)
  kernel = jax.jit(lambda a, sa, b, sb, s: fg.fp8_gmm(a, sa, b, sb, s, **kw))
  fwd = jax.jit(lambda x, w, s: fg.gmm_fp8(x, fg.quantise_weight(w, dgrad=False), s, **kw))
  dgrad = jax.jit(lambda d, w, s: fg.gmm_fp8(d, fg.quantise_weight(w, forward=False), s,
                                             transpose=True, **kw))
  ffn_kw = dict(kw, wgrad_config=bf16_config)
  ffn = jax.jit(lambda *a: fg.fp8_grouped_swiglu_ffn(*a, **ffn_kw))

  def ffn_train(x, wgu, wd, s, dy):
    y, vjp = jax.vjp(lambda *a: fg.fp8_grouped_swiglu_ffn(*a, s, **ffn_kw), x, wgu, wd)
    return y, vjp(dy)

  return kernel, fwd, dgrad, ffn, jax.jit(ffn_train)


def _kernel_table(fn, args, trace_dir: str, reps: int = 3, top: int = 16) -> dict:
  """Per-kernel time of reps calls of a warmed-up jitted fn under jax.profiler.trace
  (bench/profile_layer.py's reduction): {span and busy ms per call, top kernels}."""
  import glob
  from bench import profile_layer as pl_
  jax.block_until_ready(fn(*args))
  with jax.profiler.trace(trace_dir):
    for _ in range(reps):
      jax.block_until_ready(fn(*args))
  path = max(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True),
             key=os.path.getmtime)
  for raw in glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True):
    os.remove(raw)
  table = pl_.summarize(*pl_._events(path), calls=reps, top=top)
  dev = next(iter(table.values()))
  return {"span_ms_per_call": dev["span_per_call_us"] / 1e3,
          "busy_ms_per_call": dev["busy_per_call_us"] / 1e3,
          "kernels": [{"name": k["name"], "count_per_call": k["count"] / reps,
                       "ms_per_call": k["per_call_us"] / 1e3} for k in dev["kernels"]]}


def bench_shape_fp8(shape: MoeShape, load: str, configs, bf16_config: KernelConfig, reps: int,
                    trials: int, check_on: bool, log, profile_dir: str | None = None) -> dict:
  """configs: {name: Fp8Config}; the first is the one the FFN and checks use.
  profile_dir: also a per-kernel table of both FFNs' forward+backward (res["profile"])."""
  from pallas_kernels import fp8
  from pallas_kernels import fp8_gemm as fg
  m, h, f, g, gs_np, gs, ks, x, w, dout, flops, res = _shape_inputs(shape, load)
  record = _recorder(res, shape, load, reps, trials, log)
  bf = jnp.bfloat16

  fwd, dgrad, wgrad, ffn, ffn_train, _, dense = _jitted(bf16_config)
  dense8 = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))
  prep = jax.jit(lambda x, w, d: (fp8.quantise_rows(x), fg.quantise_weight(w),
                                  fp8.quantise_rows(d)))
  (xq, xs), qw, (dq, ds) = prep(x, w, dout)
  names = list(configs)
  _, fwd8, dgrad8, ffn8, ffn8_train = _jitted_fp8(configs[names[0]], bf16_config)

  if check_on:
    ends = np.cumsum(gs_np)
    sel = np.unique(np.array([0, int(np.argmax(gs_np)), g - 1]))
    spans = [(int(ends[i] - gs_np[i]), int(ends[i])) for i in sel]
    wd_ = fp8.dequantise_blocks(*fp8.quantise_blocks(w))
    xd, dd = fp8.dequantise_rows(xq, xs), fp8.dequantise_rows(dq, ds)
    hi = jax.lax.Precision.HIGHEST

    def chk(name, out, lhs, rhs_of):
      ref = jnp.concatenate([jnp.dot(lhs[a:b], rhs_of(i), precision=hi)
                             for i, (a, b) in zip(sel, spans)])
      # the kernel's output keeps the quantised weight's width (padded to 128 columns)
      got = jnp.concatenate([out[a:b, :ref.shape[1]] for a, b in spans])
      res["rel_err"][name] = rel_err(got, ref)
      log(f"  {shape.name:14s} {load:8s} check {name:16s} rel_err {res['rel_err'][name]:.2e}")
    try:
      # float32 outputs: the kernel's own error (bf16 outputs add their rounding)
      k32 = jax.jit(lambda a, sa, b, sb, s: fg.fp8_gmm(a, sa, b, sb, s, out_dtype=jnp.float32,
                                                       config=configs[names[0]], interpret=False))
      chk("fp8_fwd", k32(xq, xs, *qw.fwd, gs), xd, lambda i: wd_[i, :h, :f])
      # dd keeps dout's 128-padded width; wd_'s padded columns are zero like dd's
      chk("fp8_dgrad", k32(dq, ds, *qw.dgrad, gs), dd, lambda i: wd_[i, :h].T)
      chk("fp8_fwd_vs_unquantised", fwd8(x, w, gs).astype(jnp.float32), x.astype(jnp.float32),
          lambda i: w[i].astype(jnp.float32))
    except Exception as e:
      res["errors"]["check"] = f"{type(e).__name__}: {str(e)[:600]}"
      log(f"  check FAILED {type(e).__name__}: {str(e)[:300]}")

  record("dense_bf16", dense, x, w[0])
  record("dense_e4m3", dense8, x.astype(fp8.FP8_DTYPE), w[0].astype(fp8.FP8_DTYPE))
  record("bf16_fwd", fwd, x, w, gs)
  record("bf16_dgrad", dgrad, dout, w, gs)
  record("bf16_wgrad", wgrad, x, dout, gs)
  for name in names:
    kern = _jitted_fp8(configs[name], bf16_config)[0]
    record(f"fp8_kernel_fwd_{name}", kern, xq, xs, *qw.fwd, gs)
    record(f"fp8_kernel_dgrad_{name}", kern, dq, ds, *qw.dgrad, gs)
  record("fp8_fwd_with_quant", fwd8, x, w, gs)
  record("fp8_dgrad_with_quant", dgrad8, dout, w, gs)
  # where the difference goes: the quantisation passes alone (no FLOPs; ms only)
  record("quantise_weight_both_layouts", jax.jit(fg.quantise_weight), w, flop=0.0)
  record("quantise_rows_x", jax.jit(lambda x: fg.quantise_rows_for_gemm(x, 64)), x, flop=0.0)

  wu = (jax.random.normal(ks[3], (g, h, f), jnp.float32) / np.sqrt(h)).astype(bf)
  wgu = jnp.concatenate([w, wu], axis=2)
  wd = (jax.random.normal(ks[4], (g, f, h), jnp.float32) / np.sqrt(f)).astype(bf)
  dy = jax.random.normal(ks[5], (m, h), jnp.float32).astype(bf)
  record("bf16_ffn_fwd", ffn, x, wgu, wd, gs, flop=3 * flops)
  record("fp8_ffn_fwd", ffn8, x, wgu, wd, gs, flop=3 * flops)
  record("bf16_ffn_fwd_bwd", ffn_train, x, wgu, wd, gs, dy, flop=9 * flops)
  record("fp8_ffn_fwd_bwd", ffn8_train, x, wgu, wd, gs, dy, flop=9 * flops)
  if profile_dir:
    res["profile"] = {}
    for name, fn in (("bf16_ffn_fwd_bwd", ffn_train), ("fp8_ffn_fwd_bwd", ffn8_train)):
      try:
        tab = _kernel_table(fn, (x, wgu, wd, gs, dy),
                            os.path.join(profile_dir, f"trace_{shape.name}_{load}_{name}"))
        res["profile"][name] = tab
        log(f"  {shape.name:14s} {load:8s} profile {name}: busy {tab['busy_ms_per_call']:.3f} ms")
        for k in tab["kernels"]:
          log(f"      {k['ms_per_call']:8.3f} ms  x{k['count_per_call']:<5g} {k['name'][:70]}")
      except Exception as e:
        res["errors"][f"profile_{name}"] = f"{type(e).__name__}: {str(e)[:600]}"
        log(f"  profile {name} FAILED {type(e).__name__}: {str(e)[:300]}")
  if check_on:
    try:
      res["rel_err"]["fp8_ffn_fwd_vs_bf16"] = rel_err(ffn8(x, wgu, wd, gs), ffn(x, wgu, wd, gs))
    except Exception as e:
      res["errors"]["check_ffn"] = f"{type(e).__name__}: {str(e)[:600]}"

  t = res["tflops"]
  for d in ("fwd", "dgrad"):
    best = max((t[k], k) for k in t if k.startswith(f"fp8_kernel_{d}_")) if any(
        k.startswith(f"fp8_kernel_{d}_") for k in t) else None
    if best and f"bf16_{d}" in t:
      res[f"best_fp8_kernel_{d}"] = best[1]
      res[f"speedup_fp8_kernel_{d}_vs_bf16"] = best[0] / t[f"bf16_{d}"]
      if "dense_e4m3" in t:
        res[f"ratio_fp8_kernel_{d}_vs_dense_e4m3"] = best[0] / t["dense_e4m3"]
  for d in ("ffn_fwd", "ffn_fwd_bwd"):
    if f"fp8_{d}" in t and f"bf16_{d}" in t:
      res[f"speedup_fp8_{d}_vs_bf16"] = t[f"fp8_{d}"] / t[f"bf16_{d}"]
  return res


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
  p.add_argument("--configs", default=",".join(CONFIGS))
  p.add_argument("--loads", default="balanced,skewed")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--trials", type=int, default=5)
  p.add_argument("--no-check", action="store_true")
  p.add_argument("--lax-ragged-max-groups", type=int, default=16,
                 help="skip lax.ragged_dot above this many groups (it runs out of memory)")
  p.add_argument("--block-m", type=int, default=KernelConfig.block_m)
  p.add_argument("--block-n", type=int, default=KernelConfig.block_n)
  p.add_argument("--block-k", type=int, default=KernelConfig.block_k)
  p.add_argument("--stages", type=int, default=KernelConfig.max_concurrent_steps)
  p.add_argument("--precision", choices=("bf16", "fp8"), default="bf16")
  p.add_argument("--fp8-tiles", default="64x128,64x128r1,128x64",
                 help="FP8 kernel tilings timed side by side: block_m x block_n, 'rR' for "
                      "raster bands of R row tiles (Fp8Config.raster_rows, default 4); "
                      "the first one runs the FFN and the checks")
  p.add_argument("--fp8-stages", type=int, default=4)
  p.add_argument("--profile", action="store_true",
                 help="fp8: also a per-kernel profile of both FFNs' forward+backward "
                      "(traces kept under --out)")
  args = p.parse_args(argv)
  unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
  if unknown:
    p.error(f"--configs {unknown}: one of {sorted(CONFIGS)}")
  config = KernelConfig(block_m=args.block_m, block_n=args.block_n, block_k=args.block_k,
                        max_concurrent_steps=args.stages)
  dev = jax.devices()[0]
  os.makedirs(args.out, exist_ok=True)
  fp8_config = None
  if args.precision == "fp8":
    from pallas_kernels.fp8_gemm import Fp8Config
    fp8_config = {}
    for spec in args.fp8_tiles.split(","):
      tiles, _, raster = spec.partition("r")
      bm, bn = tiles.split("x")
      fp8_config[spec] = Fp8Config(block_m=int(bm), block_n=int(bn),
                                   max_concurrent_steps=args.fp8_stages,
                                   **({"raster_rows": int(raster)} if raster else {}))
  tag = "_fp8" if fp8_config else ""
  path = os.path.join(args.out, f"grouped_gemm{tag}_{device_lib.device_name(dev)}.json")
  report = {"device": dev.device_kind, "num_sms": device_lib.num_sms(None, dev),
            "jax_version": jax.__version__, "git_commit": git_commit(),
            "config": dataclasses.asdict(config), "precision": args.precision,
            "fp8_configs": ({k: dataclasses.asdict(v) for k, v in fp8_config.items()}
                            if fp8_config else None),
            "reps": args.reps, "trials": args.trials,
            "timing": "median over trials of (wall time of reps back-to-back jitted calls, "
                      "block_until_ready at the end) / reps",
            "results": []}

  def log(msg):
    print(msg, flush=True)

  for name in args.configs.split(","):
    for load in args.loads.split(","):
      try:
        if fp8_config:
          r = bench_shape_fp8(CONFIGS[name], load, fp8_config, config, args.reps, args.trials,
                              not args.no_check, log,
                              profile_dir=args.out if args.profile else None)
        else:
          r = bench_shape(CONFIGS[name], load, config, args.reps, args.trials,
                          not args.no_check, log, args.lax_ragged_max_groups)
      except Exception as e:
        traceback.print_exc()
        r = {"config": name, "load": load, "fatal": f"{type(e).__name__}: {str(e)[:1000]}"}
      report["results"].append(r)
      with open(path, "w") as fh:
        json.dump(report, fh, indent=1)

  print(f"\n{report['device']}  jax {report['jax_version']}  commit {report['git_commit'][:12]}")
  cols = ("dense_jnp_dot", "ours_fwd", "ours_dgrad", "ours_wgrad", "lax_ragged_dot_fwd",
          "ragged_dot_mgpu_fwd", "ours_ffn_fwd", "ours_ffn_fwd_bwd")
  if fp8_config:
    first = next(iter(fp8_config))
    cols = ("dense_bf16", "dense_e4m3", "bf16_fwd", f"fp8_kernel_fwd_{first}", "bf16_dgrad",
            f"fp8_kernel_dgrad_{first}", "bf16_ffn_fwd", "fp8_ffn_fwd", "bf16_ffn_fwd_bwd",
            "fp8_ffn_fwd_bwd")
  print("TFLOP/s " + " ".join(f"{c[:14]:>14s}" for c in cols))
  for r in report["results"]:
    t = r.get("tflops", {})
    print(f"{r['config'][:9]}/{r['load'][:4]} " +
          " ".join(f"{t[c]:14.1f}" if c in t else f"{'-':>14s}" for c in cols))
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
