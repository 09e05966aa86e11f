"""The Pallas backends on small and odd hidden / FFN sizes, one case per process.

  python -m bench.check_odd_shapes [--out DIR] [--cases H,F,E,K,N;...] [--parallel 4]

A kernel that faults on a GPU (e.g. CUDA_ERROR_MISALIGNED_ADDRESS) leaves its process's
CUDA context unusable, so every case runs in a process of its own, under a timeout:
  layer:<backend>   `moe_ffn` forward + gradients (bfloat16, one mesh over the local GPUs)
                    against the float32 `dense_reference` (rel. error within bf16 rounding)
  gather            the live-rows copy (`row_gather.gather_live_rows`, plain and weighted)
                    of [N, H] rows against XLA's gather, bit for bit
  ffn               the grouped SwiGLU FFN (`grouped_gemm.grouped_swiglu_ffn`) forward +
                    gradients against `reference_swiglu_ffn`
Writes check_odd_shapes_<device>.json: per case its status (ok / mismatch / error /
crash / timeout), the errors and the tail of a crashed process's stderr.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys

DEFAULT_CASES = ("24,40,8,3,148;16,24,8,2,64;40,64,8,2,64;48,64,8,2,64;56,64,8,2,64;"
                 "72,64,8,2,64;64,64,8,2,64;128,24,8,2,64;128,40,8,2,64;128,72,8,2,64;"
                 "128,128,8,2,64;136,96,8,2,64")
KINDS = ("layer:pallas", "layer:uniep", "gather", "ffn")


def _rel(a, b) -> float:
  import numpy as np
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30))


def run_one(kind: str, h: int, f: int, e: int, k: int, n: int) -> dict:
  """One case in this process; raises on failure."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import uniep_jax
  from pallas_kernels import grouped_gemm as gg
  from pallas_kernels import row_gather

  key = jax.random.split(jax.random.key(h * 1000 + f), 6)
  bf = jnp.bfloat16
  out = {}
  if kind == "gather":
    src = jax.random.normal(key[0], (n, h), jnp.float32).astype(bf)
    index = jax.random.randint(key[1], (n,), 0, n)
    scale = jax.random.uniform(key[2], (n,), jnp.float32)
    got = row_gather.gather_live_rows(src, index, jnp.int32(n), out_rows=n)
    want = jnp.take(src, index, axis=0)
    got_w = row_gather.gather_live_rows(src, index, jnp.int32(n), out_rows=n, scale=scale)
    want_w = (want.astype(jnp.float32) * scale[:, None]).astype(bf)
    out["bitwise"] = bool(np.array_equal(np.asarray(got), np.asarray(want))
                          and np.array_equal(np.asarray(got_w), np.asarray(want_w)))
    out["ok"] = out["bitwise"]
    return out
  if kind == "ffn":
    gs = jnp.array([n // 3, 0, n - n // 3 - 5], jnp.int32)
    x = jax.random.normal(key[0], (n, h), jnp.float32).astype(bf)
    wgu = (jax.random.normal(key[1], (3, h, 2 * f), jnp.float32) * h ** -0.5).astype(bf)
    wd = (jax.random.normal(key[2], (3, f, h), jnp.float32) * f ** -0.5).astype(bf)
    dy = jax.random.normal(key[3], (n, h), jnp.float32).astype(bf)
    y, vjp = jax.vjp(lambda *a: gg.grouped_swiglu_ffn(*a, gs), x, wgu, wd)
    y_r, vjp_r = jax.vjp(lambda *a: gg.reference_swiglu_ffn(*a, gs), x, wgu, wd)
    errs = [_rel(y, y_r)] + [_rel(a, b) for a, b in zip(vjp(dy), vjp_r(dy))]
    out["rel_errors"] = errs
    out["ok"] = all(err < 3e-2 for err in errs)
    return out
  backend = kind.split(":")[1]
  mesh = jax.make_mesh((1, len(jax.devices())), ("data", "expert"))
  p = uniep_jax.MoEParams(
      router=jax.random.normal(key[0], (h, e), jnp.float32),
      w_gate_up=(jax.random.normal(key[1], (e, h, 2 * f), jnp.float32) * h ** -0.5).astype(bf),
      w_down=(jax.random.normal(key[2], (e, f, h), jnp.float32) * f ** -0.5).astype(bf))
  x = jax.random.normal(key[3], (n * len(jax.devices()), h), jnp.float32).astype(bf)

  def loss(cfg, x, p):
    y, _ = uniep_jax.moe_ffn(x, p, mesh=mesh, top_k=k, config=cfg)
    return jnp.sum(jnp.sin(y.astype(jnp.float32))), y

  cfg = uniep_jax.UniEPConfig(backend=backend)
  ref = uniep_jax.UniEPConfig(backend="dense_reference")
  (_, y), g = jax.jit(jax.value_and_grad(lambda x, p: loss(cfg, x, p), (0, 1), has_aux=True))(x, p)
  (_, y_r), g_r = jax.jit(jax.value_and_grad(lambda x, p: loss(ref, x, p), (0, 1),
                                             has_aux=True))(x.astype(jnp.float32),
                                                            jax.tree.map(lambda a: a.astype(jnp.float32), p))
  errs = [_rel(y, y_r)] + [_rel(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_r))]
  out["rel_errors"] = errs
  out["ok"] = all(err < 5e-2 for err in errs)
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default=None)
  ap.add_argument("--cases", default=DEFAULT_CASES, help="H,F,E,K,N;... (N tokens per GPU)")
  ap.add_argument("--kinds", default=",".join(KINDS))
  ap.add_argument("--parallel", type=int, default=4, help="cases in flight at once")
  ap.add_argument("--timeout-s", type=int, default=240)
  ap.add_argument("--one", default=None, help=argparse.SUPPRESS)   # KIND,H,F,E,K,N: the child
  args = ap.parse_args(argv)
  if args.one:
    kind, *shape = args.one.split(",")
    try:
      res = run_one(kind, *(int(v) for v in shape))
    except Exception as e:  # noqa: BLE001 - reported, the parent records it
      res = dict(ok=False, error=repr(e)[:600])
    print("RESULT " + json.dumps(res), flush=True)
    return 0

  from bench import common
  cases = [tuple(int(v) for v in c.split(",")) for c in args.cases.split(";") if c]
  jobs = [(kind, c) for c in cases for kind in args.kinds.split(",")]
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")

  def child(job):
    kind, (h, f, e, k, n) = job
    row = dict(kind=kind, hidden=h, ffn=f, experts=e, top_k=k, tokens=n)
    try:
      proc = subprocess.run([sys.executable, "-m", "bench.check_odd_shapes", "--one",
                             ",".join(map(str, (kind, h, f, e, k, n)))],
                            capture_output=True, text=True, timeout=args.timeout_s, env=env)
    except subprocess.TimeoutExpired:
      return dict(row, status="timeout")
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if not lines:
      return dict(row, status="crash", returncode=proc.returncode, stderr=proc.stderr[-1500:])
    res = json.loads(lines[-1][len("RESULT "):])
    status = "ok" if res.get("ok") else ("error" if "error" in res else "mismatch")
    return dict(row, status=status, **res)

  meta = common.run_metadata()
  path = os.path.join(common.out_dir(args.out), f"check_odd_shapes_{common.device_tag(meta)}.json")
  rows = []
  with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
    for done in concurrent.futures.as_completed([pool.submit(child, j) for j in jobs]):
      r = done.result()
      rows.append(r)
      print(f"{r['kind']:13s} H={r['hidden']:4d} F={r['ffn']:4d}: {r['status']}"
            + ("" if r["status"] == "ok" else
               f"  {(r.get('error') or r.get('stderr') or '')[-300:]}"), flush=True)
      # rewritten after every case: a run cut by its time limit keeps what ran
      common.write_json(path, dict(meta, benchmark="check_odd_shapes", results=rows,
                                   complete=len(rows) == len(jobs)))
  return 0 if all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
