"""Device facts for the Pallas kernels: one source of truth.

Everything a kernel or a benchmark needs to know about the chip lives here, keyed
by `jax.Device.device_kind`: SM count (read off the device when it has one),
shared-memory capacity per block, and peak rates. CPU devices (interpret mode)
have no `core_count`; callers then pass the SM count explicitly or get
`DEFAULT_NUM_SMS`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import threading
from typing import Optional

import jax
import numpy as np

# H100 SXM / H200 have 132 SMs; used when the device cannot tell us (CPU interpret).
DEFAULT_NUM_SMS = 132
# Hopper: 228 KiB of shared memory per SM, at most 227 KiB (232448 B) per block.
HOPPER_SMEM_BYTES = 227 * 1024


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
  """Datasheet facts of one device kind.

  smem_bytes: the most dynamic shared memory one block may take.
  peak_bf16_tflops: dense bf16 tensor-core peak (datasheet, no sparsity).
  hbm_gbps: datasheet HBM bandwidth, GB/s.
  """

  smem_bytes: int
  peak_bf16_tflops: float
  hbm_gbps: float


# Keyed by lower-cased substrings of `device_kind` (e.g. "NVIDIA H100 80GB HBM3").
_SPECS = {
    "h200": DeviceSpec(HOPPER_SMEM_BYTES, 989.0, 4800.0),
    "h100": DeviceSpec(HOPPER_SMEM_BYTES, 989.0, 3350.0),
}
_DEFAULT_SPEC = DeviceSpec(HOPPER_SMEM_BYTES, 989.0, 3350.0)


def device_spec(device: Optional[jax.Device] = None) -> DeviceSpec:
  """The `DeviceSpec` of `device` (default: the first device); Hopper if unknown."""
  device = device or jax.devices()[0]
  kind = device.device_kind.lower()
  for key, spec in _SPECS.items():
    if key in kind:
      return spec
  return _DEFAULT_SPEC


def num_sms(requested: Optional[int] = None, device: Optional[jax.Device] = None) -> int:
  """The persistent-grid size: `requested` if given, else the device's SM count.

  CPU devices have no `core_count`; they get `DEFAULT_NUM_SMS`.
  """
  if requested is not None:
    return int(requested)
  device = device or jax.devices()[0]
  if device.platform == "gpu":
    count = getattr(device, "core_count", None)
    if count:
      return int(count)
  return DEFAULT_NUM_SMS


def smem_capacity(device: Optional[jax.Device] = None) -> int:
  """Bytes of shared memory one block may use."""
  return device_spec(device).smem_bytes


def device_name(device: Optional[jax.Device] = None) -> str:
  """`device_kind` as a file-name-safe string, e.g. "NVIDIA_H100_80GB_HBM3"."""
  device = device or jax.devices()[0]
  return "".join(c if c.isalnum() else "_" for c in device.device_kind).strip("_")


_LOWER_FOR_GPU = contextvars.ContextVar("uniep_lower_for_gpu", default=False)


@contextlib.contextmanager
def lowering_for_gpu():
  """Inside this context, kernels called with interpret=None compile for the GPU
  even where JAX's default backend is the CPU: for lowering GPU programs on a
  CPU-only machine (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`),
  which checks everything up to the Mosaic GPU custom call without a GPU."""
  token = _LOWER_FOR_GPU.set(True)
  try:
    yield
  finally:
    _LOWER_FOR_GPU.reset(token)


def lowering_only() -> bool:
  """Inside `lowering_for_gpu()`: GPU programs are lowered here without a GPU to run on."""
  return _LOWER_FOR_GPU.get()


def default_interpret():
  """What interpret=None means: the CPU interpret mode on a CPU backend (unless
  inside `lowering_for_gpu()`), else False (compile for the GPU)."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  if jax.default_backend() == "cpu" and not _LOWER_FOR_GPU.get():
    return plgpu.InterpretGPUParams()
  return False


# One interpreted kernel at a time in this process (`kernel`).
_INTERPRET_LOCK = threading.Lock()


def _spmd_devices() -> int:
  """The devices the Mosaic GPU interpreter simulates for a kernel traced here: the
  product of the manual (shard_map) mesh axes' sizes, 1 outside a shard_map (the
  interpreter's `DeviceInfo.num_devices`, which reads the same axes)."""
  mesh = jax.sharding.get_abstract_mesh()
  return math.prod(mesh.shape[a] for a in mesh.manual_axes)


def kernel(body, *, out_type, interpret, **kwargs):
  """`plgpu.kernel(body, out_type=..., interpret=..., **kwargs)` for kernels that touch
  only their own device's memory (no remote refs, no cross-device semaphores).

  Compiled (interpret=False) and outside a multi-device shard_map: `plgpu.kernel` as is.
  In the CPU interpret mode inside a shard_map over 2 or more devices, the call becomes
  a host callback that runs the kernel as a one-device program (`jax.jit` of the same
  kernel, traced outside the shard_map), under a process-wide lock: one interpreted
  kernel at a time. The interpreter keeps one global state for all the devices it
  simulates and resets or checks parts of it for all of them when any one finishes a
  grid point or a kernel (jax 0.11.2: `cluster_finished` -> `reset_per_cluster_state`,
  `assert_no_barriers_allocated`), so the devices' concurrent runs of a kernel break
  each other: "Barrier remains allocated" or a KeyError in `deallocate_buffer` (a REGS
  accumulator id handed out twice). Run alone, each device's kernel computes the bits
  it computes at one device. Cost: the devices' kernels run one after another.
  """
  from jax.experimental.pallas import mosaic_gpu as plgpu
  fn = plgpu.kernel(body, out_type=out_type, interpret=interpret, **kwargs)
  if not isinstance(interpret, plgpu.InterpretGPUParams):
    return fn

  @functools.wraps(fn)
  def call(*args):
    if _spmd_devices() <= 1:
      return fn(*args)
    one_device = jax.jit(fn)   # traced at its first run, in the callback: one device

    def run_alone(*host_args):
      with _INTERPRET_LOCK:
        # np.asarray waits for the result: the lock covers the whole run
        return jax.tree.map(np.asarray, one_device(*host_args))

    return jax.pure_callback(run_alone, out_type, *args)

  return call
