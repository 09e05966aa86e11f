"""`moe_ffn` forward and backward on a mesh, dumped to .npz: the same script in one process
or in several (`python -m train.launch --processes 2 --module train.multiprocess_check -- ...`).

Inputs are a pure function of --seed (numpy), so every process and every mode builds the
same global x and params; each process places only its devices' shards of them. Outputs:
y [N, H], the aux values, and the gradients of sum(y * c) (c fixed) with respect to x and
every parameter, all gathered to process 0, which writes `--out/<backend>.npz`.

  python -m train.multiprocess_check --out single                 # 1 process, 8 virtual devices
  python -m train.launch --processes 2 --module train.multiprocess_check -- --out multi   # 2 x 4
On GPUs (`--platform gpu`), one process per GPU: the mesh is the global device list.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Optional, Sequence

import numpy as np

from train import distributed
from train.mesh import ConfigError, mesh_size, parse_mesh, request_host_devices


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m train.multiprocess_check", description=__doc__.split("\n")[0])
  a = p.add_argument
  a("--backends", default="xla_dropless,xla_capacity", help="moe_ffn backends, comma-separated")
  a("--mesh", default="data=2,expert=4")
  a("--tokens", type=int, default=256, help="global tokens N")
  a("--hidden", type=int, default=32)
  a("--ffn", type=int, default=64)
  a("--experts", type=int, default=8)
  a("--top-k", type=int, default=2)
  a("--capacity-factor", type=float, default=1.25)
  a("--dtype", default="float32", choices=("float32", "bfloat16"))
  a("--seed", type=int, default=0)
  a("--platform", default="cpu", choices=("cpu", "gpu"), help="JAX_PLATFORMS for this run")
  a("--out", required=True, help="folder; process 0 writes <backend>.npz there")
  a("--coordinator", default=None)
  a("--num-processes", type=int, default=None)
  a("--process-id", type=int, default=None)
  a("--local-devices", type=int, default=None)
  return p


def make_inputs(seed: int, *, tokens: int, hidden: int, ffn: int, experts: int) -> dict[str, np.ndarray]:
  """Global float32 inputs as numpy, a pure function of seed."""
  rng = np.random.default_rng(seed)
  f32 = lambda *shape, scale=1.0: (rng.standard_normal(shape) * scale).astype(np.float32)
  return dict(x=f32(tokens, hidden), router=f32(hidden, experts),
              w_gate=f32(experts, hidden, ffn, scale=hidden ** -0.5),
              w_up=f32(experts, hidden, ffn, scale=hidden ** -0.5),
              w_down=f32(experts, ffn, hidden, scale=ffn ** -0.5),
              c=f32(tokens, hidden))  # cotangent weights of the scalar loss sum(y * c)


def run(ns: argparse.Namespace, backend: str) -> dict:
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  import uniep_jax
  from train.mesh import make_mesh

  shape = parse_mesh(ns.mesh)
  if len(jax.devices()) != mesh_size(shape):
    raise ConfigError(f"mesh {ns.mesh} needs {mesh_size(shape)} devices, {len(jax.devices())} are available")
  mesh = make_mesh(shape)
  dtype = jnp.dtype(ns.dtype)
  host = make_inputs(ns.seed, tokens=ns.tokens, hidden=ns.hidden, ffn=ns.ffn, experts=ns.experts)
  tok_sh = NamedSharding(mesh, P(tuple(mesh.axis_names), None))
  exp_sh = NamedSharding(mesh, P("expert"))
  rep_sh = NamedSharding(mesh, P())

  def place(a, sharding, dt):  # each process fills only its own devices' shards
    return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx].astype(dt))

  x = place(host["x"], tok_sh, dtype)
  c = place(host["c"], tok_sh, dtype)
  params = uniep_jax.MoEParams(router=place(host["router"], rep_sh, np.float32),
                               w_gate_up=place(np.concatenate([host["w_gate"], host["w_up"]],
                                                              axis=-1), exp_sh, dtype),
                               w_down=place(host["w_down"], exp_sh, dtype))
  config = uniep_jax.UniEPConfig(backend=backend, capacity_factor=ns.capacity_factor)

  def loss(x, params, c):  # c is an argument: a global array cannot be closed over
    y, aux = uniep_jax.moe_ffn(x, params, mesh=mesh, top_k=ns.top_k, config=config)
    return jnp.sum(y.astype(jnp.float32) * c.astype(jnp.float32)), (y, aux)

  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
  t0 = time.perf_counter()
  (l, (y, aux)), (gx, gp) = fn(x, params, c)
  jax.block_until_ready(gx)
  dt = time.perf_counter() - t0
  out = dict(y=y, loss=l, grad_x=gx, grad_router=gp.router, grad_w_gate_up=gp.w_gate_up,
             grad_w_down=gp.w_down)
  out.update({f"aux_{k}": v for k, v in aux.items()})
  arrays = {k: distributed.host_value(v) for k, v in out.items()}  # collectives: every process
  arrays = {k: (v.astype(np.float32) if v.dtype == jnp.bfloat16 else v) for k, v in arrays.items()}
  if distributed.is_main_process():
    os.makedirs(ns.out, exist_ok=True)
    path = os.path.join(ns.out, f"{backend}.npz")
    np.savez(path, **arrays)
    print(json.dumps(dict(backend=backend, mesh=dict(mesh.shape), processes=jax.process_count(),
                          devices=len(jax.devices()), platform=jax.devices()[0].platform,
                          first_call_s=round(dt, 3), loss=float(arrays["loss"]), out=path)), flush=True)
  return arrays


def compare(dir_a: str, dir_b: str) -> dict:
  """Per backend and array: bitwise equal, or the largest absolute / relative difference."""
  result = {}
  for f in sorted(os.listdir(dir_a)):
    if not f.endswith(".npz") or not os.path.exists(os.path.join(dir_b, f)):
      continue
    a, b = np.load(os.path.join(dir_a, f)), np.load(os.path.join(dir_b, f))
    rows = {}
    for k in a.files:
      x, y = a[k].astype(np.float64), b[k].astype(np.float64)
      diff = float(np.max(np.abs(x - y))) if x.size else 0.0
      rows[k] = dict(bitwise=bool(np.array_equal(a[k], b[k])), max_abs_diff=diff,
                     max_rel_diff=diff / max(float(np.max(np.abs(x))) if x.size else 0.0, 1e-30))
    result[f[:-4]] = rows
  return result


def main(argv: Optional[Sequence[str]] = None) -> None:
  ns = build_parser().parse_args(argv)
  # "gpu" is jax's alias for cuda *and* rocm: naming it makes jax fail on rocm's absence
  os.environ.setdefault("JAX_PLATFORMS", {"gpu": "cuda"}.get(ns.platform, ns.platform))
  n = mesh_size(parse_mesh(ns.mesh))
  try:
    spec = distributed.resolve(coordinator=ns.coordinator, num_processes=ns.num_processes,
                               process_id=ns.process_id, local_devices=ns.local_devices, mesh_devices=n)
    if ns.platform == "cpu":
      request_host_devices(n if spec is None else (spec.local_devices or n))
    if spec is not None:
      distributed.initialize(spec)
    for backend in ns.backends.split(","):
      run(ns, backend)
  except (ConfigError, ValueError) as e:
    print(f"multiprocess_check: error: {e}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
  main()
