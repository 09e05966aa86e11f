"""The Mosaic GPU kernels of a program lowered for CUDA, as a comparable inventory.

`mosaic_kernels(stablehlo_text)` lists every `mosaic_gpu` custom call of a lowered
program in program order: the kernel's name, its launch parameters (grid, cluster,
block, dynamic shared memory), its operand and result types, and a digest of its MLIR
module printed without locations (and without the per-process counter in its dump
name), so that two lowerings launch the same kernels exactly when their inventories are
equal (moving Python code around changes locations only).
Works on a CPU-only machine (`pallas_kernels.device.lowering_for_gpu()`).
"""

from __future__ import annotations

import hashlib
import re

_CALL = re.compile(r'stablehlo\.custom_call @(mosaic_gpu\w*)\((.*?)\) \{(.*?)\} : \((.*?)\) -> (.*)$')
_MODULE = re.compile(r'module = "((?:[^"\\]|\\.)*)"')
_ESCAPES = {"\\": 92, '"': 34, "n": 10, "t": 9}


def _unescape(s: str) -> bytes:
  """An MLIR string attribute's bytes (\\XX hex escapes)."""
  out, i = bytearray(), 0
  while i < len(s):
    if s[i] == "\\":
      nxt = s[i + 1]
      if nxt in _ESCAPES:
        out.append(_ESCAPES[nxt])
        i += 2
      else:
        out.append(int(s[i + 1:i + 3], 16))
        i += 3
    else:
      out += s[i].encode("latin1")
      i += 1
  return bytes(out)


def _module_asm(module_bytes: bytes) -> str:
  from jax._src.interpreters import mlir as jax_mlir
  from jax._src.lib import mosaic_gpu_dialect
  from jaxlib.mlir import ir
  ctx = jax_mlir.make_ir_context()
  mosaic_gpu_dialect.register_dialect(ctx)
  ctx.allow_unregistered_dialects = True
  with ctx:
    asm = ir.Module.parse(module_bytes).operation.get_asm(enable_debug_info=False)
  # a per-process counter of the kernels lowered so far, not part of the kernel
  return re.sub(r'mosaic_gpu\.dump_basename = "[^"]*"', "mosaic_gpu.dump_basename", asm)


def _constants(asm: str) -> dict:
  return {m.group(1): int(m.group(2)) for m in
          re.finditer(r'(%\w+) = "[\w.]*arith\.constant"\(\) \{value = (-?\d+) : \w+\}', asm)}


def _launch(asm: str) -> dict:
  """The module's kernel name and its gpu.launch operands that are constants (grid x3,
  block x3, cluster x3 where it has one, dynamic SMEM bytes; the async token is None)."""
  m = re.search(r'"stable_mosaic_gpu\.gpu\.launch"\(([^)]*)\)', asm) or re.search(
      r"gpu\.launch[^(]*\(([^)]*)\)", asm)
  if not m:
    return {}
  consts = _constants(asm)
  vals = [consts.get(v.strip()) for v in m.group(1).split(",")]
  name = re.search(r'sym_name = "(\w+_mosaic_gpu)"', asm)
  return dict(name=name.group(1) if name else None, launch_operands=vals)


def mosaic_kernels(stablehlo_text: str) -> list[dict]:
  """Every mosaic_gpu custom call of a lowered program, in program order (module doc)."""
  kernels = []
  for line in stablehlo_text.splitlines():
    line = line.strip()
    if "custom_call @mosaic_gpu" not in line:
      continue
    head = re.search(r"custom_call @(mosaic_gpu\w*)", line).group(1)
    module = _MODULE.search(line)
    asm = _module_asm(_unescape(module.group(1))) if module else ""
    sig = re.search(r"\} : \((.*)\) -> (.*)$", line)
    kernels.append(dict(call=head, **_launch(asm),
                        operands=sig.group(1) if sig else None,
                        results=sig.group(2) if sig else None,
                        digest=hashlib.sha256(asm.encode()).hexdigest()[:16]))
  return kernels


# ---------------------------------------------------------------------------
# The layer's kernels at EP 4 (a 1 x 4 mesh of CPU devices, lowered for CUDA).
# ---------------------------------------------------------------------------
GOLDEN = "tests/golden/layer_kernels_ep4.json"
SHAPE = dict(tokens=256, hidden=256, ffn=192, experts=8, top_k=2)


def layer_configs() -> dict:
  """The configurations whose kernels the golden inventory pins: the default "uniep", its
  overlapped point (the down GEMM and the dX wgrad returning over NVLink beside their
  tiles), and "pallas" over XLA's collectives."""
  import uniep_jax
  return {
      "uniep": uniep_jax.UniEPConfig(backend="uniep"),
      "uniep_overlap": uniep_jax.UniEPConfig(
          backend="uniep", overlap=uniep_jax.OverlapConfig(down_return_ctas=16,
                                                           wgrad_return_ctas=16,
                                                           chunk_rows=256)),
      "pallas": uniep_jax.UniEPConfig(backend="pallas", transport="padded"),
  }


def layer_kernels(config, grad: bool) -> list[dict]:
  """The inventory of `moe_ffn_shard` under `config` at EP 4, forward or forward+backward."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  import uniep_jax
  from moe_testlib import make_params
  from pallas_kernels import device as device_lib

  s = SHAPE
  mesh = jax.make_mesh((1, 4), ("data", "expert"), devices=jax.devices()[:4])
  axes = ("data", "expert")
  p = make_params(jax.random.key(0), experts=s["experts"], hidden=s["hidden"], ffn=s["ffn"],
                  dtype=jnp.bfloat16)
  specs = uniep_jax.param_specs(p)

  def body(xl, pl):
    return uniep_jax.moe_ffn_shard(xl, pl, top_k=s["top_k"], config=config, token_axes=axes)[0]

  fn = jax.shard_map(body, mesh=mesh, in_specs=(P(axes), specs), out_specs=P(axes),
                     check_vma=False)
  loss = lambda x, q: jnp.sum(fn(x, q).astype(jnp.float32) ** 2)  # noqa: E731
  sds = lambda a, sp: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, sp))  # noqa: E731
  x = jax.ShapeDtypeStruct((s["tokens"], s["hidden"]), jnp.bfloat16,
                           sharding=NamedSharding(mesh, P(axes)))
  with device_lib.lowering_for_gpu():
    text = jax.jit(jax.grad(loss, argnums=(0, 1)) if grad else fn).trace(
        x, jax.tree.map(sds, p, specs)).lower(lowering_platforms=("cuda",)).as_text()
  return mosaic_kernels(text)


def inventory() -> dict:
  return {f"{name}/{'fwdbwd' if grad else 'fwd'}": layer_kernels(cfg, grad)
          for name, cfg in layer_configs().items() for grad in (False, True)}


if __name__ == "__main__":   # python tests/kernel_inventory.py: rewrite the golden file
  import json
  import os
  import sys
  sys.path.insert(0, os.path.dirname(__file__))
  import conftest  # noqa: F401  (8 virtual CPU devices, set before jax is imported)
  os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
  with open(GOLDEN, "w") as f:
    json.dump(inventory(), f, indent=1, sort_keys=True)
    f.write("\n")
  print("wrote", GOLDEN)
