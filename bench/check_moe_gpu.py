"""GPU correctness and determinism check of `moe_ffn` on all local GPUs.

  python -m bench.check_moe_gpu [--out DIR] [--backends ...]

For EP = every divisor-of-GPU-count mesh (data x expert), small shapes:
  * each backend against `dense_reference` (forward, gradients of x and every
    parameter; float32 for the XLA backends, bfloat16 for all);
  * the "ragged" (ragged_all_to_all) and "padded" (all_to_all) transports give
    bitwise the same outputs and gradients;
  * three runs under jit are bitwise identical (outputs and gradients);
  * "pallas" against "xla_dropless" at a mid size (bf16).
Writes check_moe_gpu_<device>.json; exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import uniep_jax
from bench import common


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


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", default=None)
  # "uniep" is the v1 dispatch here, "uniep_dd" the de-duplicated one (uniep's default)
  ap.add_argument("--backends", default="xla_dropless,xla_capacity,pallas,uniep,uniep_dd")
  ap.add_argument("--quick", action="store_true",
                  help="float32 on the (1, n) mesh only; bfloat16 on (1, n) and (2, n/2)")
  ap.add_argument("--meshes", default=None,
                  help="only these meshes, a comma list of DATAxEP (e.g. 1x4); with --quick "
                       "float32 still runs on the (1, n) mesh only; the final pallas vs "
                       "xla_dropless check always runs on (1, n) in bfloat16")
  ap.add_argument("--dtypes", default="float32,bfloat16",
                  help="the dtypes of the per-mesh checks, a comma list")
  args = ap.parse_args(argv)
  meta = common.run_metadata()
  print(meta, flush=True)
  n = len(jax.devices())
  meshes = [(n // ep, ep) for ep in (1, 2, 4, 8) if ep <= n and n % ep == 0]
  if args.quick:
    meshes = [m for m in meshes if m[1] in (n, n // 2) and m[1] > 1] or meshes
  if args.meshes:
    meshes = [tuple(int(v) for v in m.split("x")) for m in args.meshes.split(",")]
    for data, ep in meshes:
      if data * ep != n:
        raise ValueError(f"--meshes: {data}x{ep} does not cover the {n} devices")
  e, h, f, tokens, top_k = 16, 256, 192, 512, 4
  checks = []

  kind = common.device_tag(meta)
  out_path = os.path.join(common.out_dir(args.out), f"check_moe_gpu_{kind}_x{n}.json")

  def write(complete: bool):
    failed = [c for c in checks if not c["ok"]]
    common.write_json(out_path, dict(meta, benchmark="check_moe_gpu", checks=checks,
                                     passed=len(checks) - len(failed), failed=len(failed),
                                     complete=complete, command=" ".join(sys.argv)))
    return failed

  def record(name, ok, **info):
    checks.append(dict(name=name, ok=bool(ok), **info))
    print(("PASS " if ok else "FAIL ") + name + " " + str(info), flush=True)
    write(complete=False)   # a run cut short by its time limit still leaves its checks

  key = jax.random.key(0)
  for dtype in (jnp.dtype(d).type for d in args.dtypes.split(",")):
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
      by_backend = {}
      for backend in args.backends.split(","):
        # "<backend>_dd": the same backend with token de-duplication (dedup_tokens);
        # "<backend>_dd_sb": and the send rows gathered into a send buffer first
        # (TransferConfig.gather_rows=False; the default reads them by index in the
        # transfer's loads); "<backend>_dd_te": the owner's expansion inside the
        # transfer's launch (expand_in_transfer), "_tel" with its last source's on the
        # transfer CTAs too; "<name>_op": slot_reduction="owner_partials"
        # "<backend>_ov": EXPERIMENTAL Kernel D both ways (the de-duplicated dispatch, its
        # expansion and the gate/up / da GEMM in one launch each; with the fused point's
        # Kernel C and the dX return beside the wgrad; 2 send groups); "_ovj": with 3 copy
        # stages and the transfer CTAs copying the chunks from 50% on, and few copiers (4
        # transfer, 2 copy CTAs) so that each walks several items of a chunk at this size
        base, join = (backend[:-1], True) if backend.endswith("_ovj") else (backend, False)
        base, overlap = (base[:-3], True) if base.endswith("_ov") else (base, False)
        base, owner = (base[:-3], True) if base.endswith("_op") else (base, False)
        base, gather = (base[:-3], False) if base.endswith("_sb") else (base, True)
        base, expand_all = (base[:-4], True) if base.endswith("_tel") else (base, False)
        base, expand = (base[:-3], True) if base.endswith("_te") else (base, expand_all)
        base, dedup = (base[:-3], True) if base.endswith("_dd") else (base, False)
        if base in ("pallas", "uniep") and dtype == jnp.float32:
          continue  # the Pallas kernels take bf16 operands
        transports = {"xla_dropless": ["ragged", "padded"], "pallas": ["padded"]}.get(base, [None])
        outs = {}
        for tr in transports:
          cfg = uniep_jax.UniEPConfig(backend=base, transport=tr, capacity_factor=100.0,
                                      dedup_tokens=dedup,
                                      transfer=uniep_jax.TransferConfig(
                                          gather_rows=gather, expand_in_transfer=expand,
                                          expand_last_on_all=expand_all),
                                      slot_reduction="owner_partials" if owner else "slot_order")
          if overlap:
            copiers = 2 if join else 16
            cfg = dataclasses.replace(cfg, dedup_send_groups=2, fused=uniep_jax.FusedConfig(
                n_comm=4 if join else 16, recv_chunk_rows=256, return_in_kernel=False,
                down_return_ctas=16, wgrad_return_ctas=16, dispatch_in_kernel=False,
                overlap_copy_ctas=copiers, overlap_copy_ctas_bwd=copiers if join else 32,
                overlap_copy_stages=3 if join else 2, overlap_join_percent=50 if join else 0))
          tag = f"{backend}/{tr}/{jnp.dtype(dtype).name}/data={data},ep={ep}"
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
            outs[tr] = runs[0]
          except Exception as ex:  # noqa: BLE001
            traceback.print_exc(limit=3)
            record(f"runs {tag}", False, error=repr(ex)[:400])
        if len(outs) == 2:
          record(f"ragged_equals_padded_bitwise {backend}/{jnp.dtype(dtype).name}/data={data},ep={ep}",
                 common.same_bits(outs["ragged"], outs["padded"]))
        if outs:
          by_backend[backend] = next(iter(outs.values()))
      for backend in list(by_backend):
        for suffix in ("_te", "_tel", "_ov", "_ovj"):
          plain = backend[:-len(suffix)]
          if backend.endswith(suffix) and plain in by_backend:
            # the transfer and the expansion in one launch move and weight the same rows
            record(f"{backend}_equals_{plain}_bitwise {jnp.dtype(dtype).name}/data={data},ep={ep}",
                   common.same_bits(by_backend[backend], by_backend[plain]))
        if backend.endswith("_sb") and backend[:-3] in by_backend:
          # the send buffer and the transfer's gathered loads move the same rows
          record(f"{backend}_equals_{backend[:-3]}_bitwise {jnp.dtype(dtype).name}/data={data},ep={ep}",
                 common.same_bits(by_backend[backend], by_backend[backend[:-3]]))
        if backend.endswith("_dd") and backend[:-3] in by_backend:
          # de-duplication sends fewer rows and changes no bit
          record(f"{backend}_equals_{backend[:-3]}_bitwise {jnp.dtype(dtype).name}/data={data},ep={ep}",
                 common.same_bits(by_backend[backend], by_backend[backend[:-3]]))
      for backend in [b for b in by_backend if b.endswith("_op")]:
        # the mode's guarantees: the owner-side pre-sum (the de-duplicated backward) and
        # the NVLink transport change no bit
        others = [backend.replace("_dd_", "_")] + (["pallas_op"] if backend.startswith("uniep") else [])
        for other in [o for o in others if o != backend and o in by_backend]:
          record(f"{backend}_equals_{other}_bitwise {jnp.dtype(dtype).name}/data={data},ep={ep}",
                 common.same_bits(by_backend[backend], by_backend[other]))
      if "uniep" in by_backend and "pallas" in by_backend:
        # The UniEP guarantee: the NVLink transport changes no bit.
        record(f"uniep_equals_pallas_bitwise {jnp.dtype(dtype).name}/data={data},ep={ep}",
               common.same_bits(by_backend["uniep"], by_backend["pallas"]))

  # pallas vs xla_dropless at a mid size, bf16, all GPUs on the expert axis
  if "pallas" in args.backends:
    try:
      mesh = jax.make_mesh((1, n), ("data", "expert"))
      e2, h2, f2, t2, k2 = 32, 1024, 480, 4096 * n, 8
      p = _params(jax.random.key(5), e2, h2, f2, jnp.bfloat16)
      x = jax.random.normal(jax.random.key(6), (t2, h2)).astype(jnp.bfloat16)
      ya = _fns(mesh, k2, uniep_jax.UniEPConfig(backend="pallas"))[0](x, p)[0]
      yb = _fns(mesh, k2, uniep_jax.UniEPConfig(backend="xla_dropless"))[0](x, p)[0]
      record(f"pallas_vs_xla_dropless E={e2},H={h2},F={f2},T={t2},K={k2}", _rel(ya, yb) < 1e-2,
             rel=_rel(ya, yb))
    except Exception as ex:  # noqa: BLE001
      traceback.print_exc(limit=3)
      record("pallas_vs_xla_dropless", False, error=repr(ex)[:400])

  failed = write(complete=True)
  uniep_checks = [c for c in checks if "uniep" in c["name"]]
  if uniep_checks and all(c["ok"] for c in uniep_checks):
    open(os.path.join(common.out_dir(args.out), "uniep_ok"), "w").write("ok\n")
  print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
