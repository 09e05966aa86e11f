"""Correctness and determinism of `moe_ffn` on all local devices, small shapes.

  python -m bench.check_moe_gpu [--out DIR] [--backends NAMES] [--quick] [--meshes 1x4]
                                [--dtypes float32,bfloat16]

--backends is a comma list of configuration names (bench/common.py, `layer_config`:
e.g. "xla_dropless:padded", "uniep:overlap=4"). For every mesh data x expert with
expert in (1, 2, 4, 8) dividing the device count, and every dtype:
  * each configuration against the float32 `dense_reference` (forward, and the
    gradients of x and of every parameter) within a tolerance per dtype, with the same
    expert counts;
  * each configuration three times under jit: bitwise identical outputs and gradients;
  * the bitwise guarantees (`bitwise_partner`): a configuration with a transport option
    equals the same configuration without it (every transport lands every row at the
    same place), "uniep" equals "pallas" (the NVLink transport changes no bit), and
    "uniep:overlap[=...]" equals "uniep" (the transfers inside GEMM launches change no
    bit), forward output and every gradient;
and, on the (1, n) mesh in bfloat16 at a mid size, "pallas" against "xla_dropless".
The Pallas backends ("pallas", "uniep") take bfloat16 operands: they are skipped in
float32. "xla_capacity" drops assignments past its capacity (cf 1.25 by default), which
the dense reference does not: the default list names it with cf=100 (nothing dropped).
On the CPU the XLA configurations run as they do on a GPU (the transport picked by
None is "padded" there).

Writes check_moe_gpu_<device>_x<n>.json (rewritten after every check, so a run cut by
its time limit keeps what ran); exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import uniep_jax
from bench import common

DEFAULT_CONFIGS = ("xla_capacity:cf=100,xla_dropless,xla_dropless:padded,pallas,uniep,"
                   "uniep:overlap")
TRANSPORT_OPTIONS = ("ragged", "padded", "local")


def bitwise_partner(name: str) -> str | None:
  """The configuration `name` must equal bit for bit, or None: the name without its
  transport option ("xla_dropless:padded" -> "xla_dropless"), without its overlap
  option ("uniep:overlap=4" -> "uniep"), and "uniep" -> "pallas"."""
  backend, *options = name.split(":")
  kept = [o for o in options if o not in TRANSPORT_OPTIONS and o.partition("=")[0] != "overlap"]
  if kept != options:
    return ":".join([backend] + kept)
  if name == "uniep":
    return "pallas"
  return None


def _params(key, e, h, f, dtype, bias=None):
  k = jax.random.split(key, 4)
  return uniep_jax.MoEParams(
      router=jax.random.normal(k[0], (h, e), jnp.float32),
      w_gate_up=uniep_jax.join_gate_up(
          (jax.random.normal(k[1], (e, h, f)) * h ** -0.5).astype(dtype),
          (jax.random.normal(k[2], (e, h, f)) * h ** -0.5).astype(dtype)),
      w_down=(jax.random.normal(k[3], (e, f, h)) * f ** -0.5).astype(dtype),
      expert_bias=bias)


def _rel(a, b):
  a = np.asarray(jnp.asarray(a, jnp.float32)); b = np.asarray(jnp.asarray(b, jnp.float32))
  return float(np.linalg.norm(a - b) / (np.linalg.norm(b) + 1e-30))


def _fns(mesh, top_k, cfg):
  def fwd(x, p):
    return uniep_jax.moe_ffn(x, p, mesh=mesh, top_k=top_k, config=cfg)

  def loss(x, p):
    y, aux = fwd(x, p)
    w = jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))
    return jnp.sum(y.astype(jnp.float32) * w) + aux["load_balance_loss"]

  return jax.jit(fwd), jax.jit(jax.grad(loss, argnums=(0, 1)))


def meshes_for(n: int, quick: bool, meshes_arg: str | None) -> list[tuple[int, int]]:
  """The (data, expert) meshes of n devices to check."""
  meshes = [(n // ep, ep) for ep in (1, 2, 4, 8) if ep <= n and n % ep == 0]
  if quick:
    meshes = [m for m in meshes if m[1] in (n, n // 2) and m[1] > 1] or meshes
  if meshes_arg:
    meshes = [tuple(int(v) for v in m.split("x")) for m in meshes_arg.split(",")]
    for data, ep in meshes:
      if data * ep != n:
        raise ValueError(f"--meshes: {data}x{ep} does not cover the {n} devices")
  return meshes


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default=None)
  ap.add_argument("--backends", default=DEFAULT_CONFIGS,
                  help="comma list of configuration names (bench/common.py, layer_config)")
  ap.add_argument("--quick", action="store_true",
                  help="float32 on the (1, n) mesh only; bfloat16 on (1, n) and (2, n/2)")
  ap.add_argument("--meshes", default=None,
                  help="only these meshes, a comma list of DATAxEP (e.g. 1x4); with --quick "
                       "float32 still runs on the (1, n) mesh only; the final pallas vs "
                       "xla_dropless check always runs on (1, n) in bfloat16")
  ap.add_argument("--dtypes", default="float32,bfloat16",
                  help="the dtypes of the per-mesh checks, a comma list")
  args = ap.parse_args(argv)
  names = [b for b in args.backends.split(",") if b]
  configs = {name: common.layer_config(name) for name in names}   # a bad name fails now
  common.dump_stacks_on_usr1()
  meta = common.run_metadata()
  print(meta, flush=True)
  n = len(jax.devices())
  meshes = meshes_for(n, args.quick, args.meshes)
  e, h, f, tokens, top_k = 16, 256, 192, 512, 4
  checks = []

  kind = common.device_tag(meta)
  out_path = os.path.join(common.out_dir(args.out), f"check_moe_gpu_{kind}_x{n}.json")

  def write(complete: bool):
    failed = [c for c in checks if not c["ok"]]
    common.write_json(out_path, dict(meta, benchmark="check_moe_gpu", checks=checks,
                                     configurations=names,
                                     passed=len(checks) - len(failed), failed=len(failed),
                                     complete=complete, command=" ".join(sys.argv)))
    return failed

  def record(name, ok, **info):
    checks.append(dict(name=name, ok=bool(ok), **info))
    print(("PASS " if ok else "FAIL ") + name + " " + str(info), flush=True)
    write(complete=False)   # a run cut short by its time limit still leaves its checks

  key = jax.random.key(0)
  for dtype in (jnp.dtype(d).type for d in args.dtypes.split(",")):
    dname = jnp.dtype(dtype).name
    p = _params(key, e, h, f, dtype)
    x = jax.random.normal(jax.random.key(1), (tokens, h)).astype(dtype)
    ref_f, ref_g = _fns(None, top_k, uniep_jax.UniEPConfig(backend="dense_reference"))
    y_ref, aux_ref = ref_f(x, p)
    g_ref = ref_g(x, p)
    tol_y = 1e-5 if dtype == jnp.float32 else 2e-2
    tol_g = 1e-4 if dtype == jnp.float32 else 3e-2
    for data, ep in meshes:
      if args.quick and dtype == jnp.float32 and ep != n:
        continue
      mesh = jax.make_mesh((data, ep), ("data", "expert"))
      where = f"{dname}/data={data},ep={ep}"
      outs = {}   # name -> (forward, gradients) of its first run
      for name, cfg in configs.items():
        if cfg.backend in ("pallas", "uniep") and dtype == jnp.float32:
          continue  # the Pallas kernels take bf16 operands
        tag = f"{name} {where}"
        try:
          f_fwd, f_grad = _fns(mesh, top_k, cfg)
          runs = [(f_fwd(x, p), f_grad(x, p)) for _ in range(3)]
          (y, aux), g = runs[0]
          record(f"vs_reference_fwd {tag}", _rel(y, y_ref) < tol_y, rel=_rel(y, y_ref))
          gerr = {k: _rel(a, b) for k, a, b in [
              ("x", g[0], g_ref[0]), ("router", g[1].router, g_ref[1].router),
              ("w_gate_up", g[1].w_gate_up, g_ref[1].w_gate_up),
              ("w_down", g[1].w_down, g_ref[1].w_down)]}
          record(f"vs_reference_grad {tag}", max(gerr.values()) < tol_g, **gerr)
          record(f"counts {tag}", np.array_equal(np.asarray(aux["expert_counts"]),
                                                 np.asarray(aux_ref["expert_counts"])))
          record(f"deterministic_3_runs {tag}",
                 common.same_bits(runs[0], runs[1]) and common.same_bits(runs[0], runs[2]))
          outs[name] = runs[0]
        except Exception as ex:  # noqa: BLE001
          traceback.print_exc(limit=3)
          record(f"runs {tag}", False, error=repr(ex)[:400])
      for name in outs:
        partner = bitwise_partner(name)
        if partner in outs:
          record(f"bitwise {name} == {partner} {where}", common.same_bits(outs[name], outs[partner]))

  # pallas vs xla_dropless at a mid size, bf16, all devices on the expert axis
  if "pallas" in configs:
    try:
      mesh = jax.make_mesh((1, n), ("data", "expert"))
      e2, h2, f2, t2, k2 = 32, 1024, 480, 4096 * n, 8
      p = _params(jax.random.key(5), e2, h2, f2, jnp.bfloat16)
      x = jax.random.normal(jax.random.key(6), (t2, h2)).astype(jnp.bfloat16)
      ya = _fns(mesh, k2, configs["pallas"])[0](x, p)[0]
      yb = _fns(mesh, k2, common.layer_config("xla_dropless"))[0](x, p)[0]
      record(f"pallas_vs_xla_dropless E={e2},H={h2},F={f2},T={t2},K={k2}", _rel(ya, yb) < 1e-2,
             rel=_rel(ya, yb))
    except Exception as ex:  # noqa: BLE001
      traceback.print_exc(limit=3)
      record("pallas_vs_xla_dropless", False, error=repr(ex)[:400])

  failed = write(complete=True)
  print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
