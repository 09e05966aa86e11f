"""Mesh strings ("data=2,expert=4"): parsing, validation, virtual CPU devices.

Parsing and validation import nothing heavy, so the CLI can size the virtual CPU
device pool (XLA_FLAGS) before jax is imported.
"""

from __future__ import annotations

import math
import os
import re

MESH_AXES = ("data", "expert")
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


class ConfigError(ValueError):
  """A run configuration that cannot work (reported by the CLI without a traceback)."""


def parse_mesh(spec: str) -> dict[str, int]:
  """"data=2,expert=4" -> {"data": 2, "expert": 4} (axes in MESH_AXES order; missing ones = 1)."""
  if not isinstance(spec, str) or not spec.strip():
    raise ValueError(f"mesh {spec!r} is empty; expected e.g. 'data=2,expert=4'")
  shape: dict[str, int] = {}
  for part in spec.split(","):
    m = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*=\s*(\d+)\s*", part)
    if not m:
      raise ValueError(f"mesh {spec!r}: cannot parse {part!r}; expected NAME=SIZE, e.g. 'data=2,expert=4'")
    name, size = m.group(1), int(m.group(2))
    if name not in MESH_AXES:
      raise ValueError(f"mesh {spec!r}: unknown axis {name!r}; the axes are {MESH_AXES}")
    if name in shape:
      raise ValueError(f"mesh {spec!r}: axis {name!r} given twice")
    if size < 1:
      raise ValueError(f"mesh {spec!r}: axis {name}={size} must be >= 1")
    shape[name] = size
  return {a: shape.get(a, 1) for a in MESH_AXES}


def mesh_size(shape: dict[str, int]) -> int:
  return math.prod(shape.values())


def validate_mesh(shape: dict[str, int], *, num_devices: int, num_experts: int, batch: int) -> None:
  """Raise ValueError unless the mesh fits the devices, the experts and the batch."""
  n = mesh_size(shape)
  desc = ",".join(f"{k}={v}" for k, v in shape.items())
  if n != num_devices:
    raise ConfigError(f"mesh {desc} has {n} devices but {num_devices} are available; "
                     f"the product of the axis sizes must equal the device count")
  if num_experts % shape["expert"]:
    raise ConfigError(f"mesh {desc}: expert={shape['expert']} must divide the number of experts {num_experts}")
  if batch % n:
    raise ConfigError(f"batch={batch} must be divisible by the mesh size {n} (the batch is split over all axes)")


def request_host_devices(n: int) -> None:
  """Ask XLA for n virtual CPU devices. Only effective before jax is imported.

  Leaves an explicit device count already in XLA_FLAGS alone (validation reports a
  mismatch later); harmless on GPU hosts (the flag concerns the host platform).
  """
  default_xla_flag(_DEVICE_COUNT_FLAG, n)


def default_xla_flag(flag: str, value) -> None:
  """Appends `flag=value` to XLA_FLAGS unless XLA_FLAGS already sets `flag` (an
  explicit setting wins). Only effective before jax starts its backends."""
  flags = os.environ.get("XLA_FLAGS", "")
  if flag in flags:
    return
  os.environ["XLA_FLAGS"] = f"{flags} {flag}={value}".strip()


def request_xla_determinism() -> None:
  """Ask XLA:GPU for deterministic programs. Only effective before jax's backends start.

  The MoE layer and the model hold no float scatter-add (the one op XLA runs with
  atomics), so a compiled training step gives the same bits run after run without
  this. What the flag adds: no GEMM autotuning, whose choice of kernel depends on
  timing measurements at compile time, so that the dense layers get the same kernels
  (and bits) in every compilation, e.g. with backends "pallas" and "uniep"; and any
  scatter a user adds becomes deterministic. Costs some dense-GEMM speed. No effect
  on the CPU. Leaves an explicit setting in XLA_FLAGS alone.
  """
  from uniep_jax.determinism import DETERMINISTIC_FLAG
  default_xla_flag(DETERMINISTIC_FLAG, "true")


def request_nccl_group_launch() -> None:
  """NCCL_LAUNCH_MODE=GROUP unless the environment sets NCCL_LAUNCH_MODE. Only
  effective before the first collective creates NCCL's communicators.

  One process driving several GPUs issues each GPU's NCCL kernels from its own thread.
  A process-wide synchronising CUDA call on one GPU's thread (module loads, frees) while
  another GPU's thread is inside a collective can then deadlock them; NVIDIA's JAX
  guide (JAX-Toolbox GPU_performance.md, "Debugging Hangs in 1-process-multiple-device
  set-up") gives GROUP launches as the remedy. On 4x H200 a training step with many
  independent all_to_all/all_gather pairs never finishes its first step, with GROUP or
  without; chaining the collectives (uniep_jax/ordered_reduce.ordered_psum_many) is what
  fixes that. The GPU runs are tested with GROUP set, so it stays the default set-up.
  No effect on the CPU or with one process per GPU.
  """
  os.environ.setdefault("NCCL_LAUNCH_MODE", "GROUP")


def make_mesh(shape: dict[str, int]):
  """A jax Mesh over the first prod(shape) devices with Auto axes named MESH_AXES."""
  import jax
  from jax.sharding import AxisType

  n = mesh_size(shape)
  devices = jax.devices()
  if len(devices) < n:
    raise ConfigError(f"mesh needs {n} devices, only {len(devices)} ({devices[0].platform}) are available")
  return jax.make_mesh(tuple(shape[a] for a in MESH_AXES), MESH_AXES,
                       axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices[:n])
