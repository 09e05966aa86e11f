"""Multi-process runs on JAX's own distributed runtime (`jax.distributed`).

Where the process group comes from, first match wins:
  coordinator    --coordinator HOST:PORT, else JAX_COORDINATOR_ADDRESS (read by
                 `jax.distributed.initialize` itself), else cluster auto-detection
  num processes  --num-processes N, else JAX_NUM_PROCESSES, else auto-detection
  process id     --process-id I, else JAX_PROCESS_ID, else auto-detection
  local devices  --local-devices L, else JAX_LOCAL_DEVICES, else mesh size / N
jax 0.11.2's `initialize` reads only JAX_COORDINATOR_ADDRESS (and JAX_LOCAL_DEVICE_IDS,
JAX_COORDINATOR_PORT) from the environment; the process count and id come from its
arguments or from a detected cluster (SLURM, Open MPI, mpi4py, Kubernetes, Cloud TPU).
JAX_NUM_PROCESSES / JAX_PROCESS_ID are ours, named to match.

A run is multi-process when the process count is > 1 or a coordinator is named. Then,
before the first jax computation, `initialize` selects gloo for cross-process CPU
collectives (`jax_cpu_collectives_implementation`; NCCL on GPUs needs nothing) and
calls `jax.distributed.initialize`. `jax.devices()` then lists every process's devices,
and the mesh spans them all.

This module imports no jax at import time: the CLI resolves the spec, sizes the
virtual CPU device pool (XLA_FLAGS, per process), and only then imports jax.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import signal
from typing import Mapping, Optional

from train.mesh import ConfigError

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_LOCAL_DEVICES = "JAX_LOCAL_DEVICES"


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
  """One process's place in the group; None fields are left to jax's cluster detection."""
  coordinator: Optional[str]  # "host:port" of process 0's coordinator service
  num_processes: Optional[int]
  process_id: Optional[int]
  local_devices: Optional[int]  # devices this process contributes (virtual CPU devices on CPU)

  def __post_init__(self):
    if self.coordinator is not None and (":" not in self.coordinator
                                         or not self.coordinator.rsplit(":", 1)[1].isdigit()):
      raise ConfigError(f"coordinator={self.coordinator!r} must be HOST:PORT, e.g. 127.0.0.1:12345")
    if self.num_processes is not None and self.num_processes < 1:
      raise ConfigError(f"num_processes={self.num_processes} must be >= 1")
    if self.process_id is not None and not 0 <= self.process_id < (self.num_processes or 1 << 30):
      raise ConfigError(f"process_id={self.process_id} must be in [0, num_processes={self.num_processes})")
    if self.local_devices is not None and self.local_devices < 1:
      raise ConfigError(f"local_devices={self.local_devices} must be >= 1")


def _env_int(env: Mapping[str, str], name: str) -> Optional[int]:
  v = env.get(name)
  if v is None or v == "":
    return None
  try:
    return int(v)
  except ValueError:
    raise ConfigError(f"environment variable {name}={v!r} is not an integer") from None


def resolve(*, coordinator: Optional[str], num_processes: Optional[int], process_id: Optional[int],
            local_devices: Optional[int], mesh_devices: int,
            env: Optional[Mapping[str, str]] = None) -> Optional[DistributedSpec]:
  """Flags, else environment. None for a single-process run (no coordinator, <= 1 process)."""
  env = os.environ if env is None else env
  coordinator = coordinator or env.get(ENV_COORDINATOR) or None
  if num_processes is None:
    num_processes = _env_int(env, ENV_NUM_PROCESSES)
  if process_id is None:
    process_id = _env_int(env, ENV_PROCESS_ID)
  if local_devices is None:
    local_devices = _env_int(env, ENV_LOCAL_DEVICES)
  if coordinator is None and (num_processes or 1) == 1:
    if process_id not in (None, 0):
      raise ConfigError(f"process_id={process_id} given without --num-processes > 1 or a coordinator")
    return None
  if local_devices is None and num_processes is not None:
    if mesh_devices % num_processes:
      raise ConfigError(f"the mesh has {mesh_devices} devices, not divisible by "
                        f"num_processes={num_processes}; pass --local-devices")
    local_devices = mesh_devices // num_processes
  return DistributedSpec(coordinator=coordinator, num_processes=num_processes,
                         process_id=process_id, local_devices=local_devices)


def initialize(spec: DistributedSpec, *, timeout_s: int = 300) -> None:
  """Join the process group (imports jax; call before any jax computation)."""
  # `train.launch` sends SIGUSR1 before it kills a group that ran past its timeout: every
  # process then prints where each of its threads is (a hang and a slow step look alike
  # from outside).
  faulthandler.register(signal.SIGUSR1, all_threads=True)
  import jax

  # Cross-process collectives of the CPU client (0.11.2's default is gloo too; explicit
  # here because without it multi-process CPU programs fail at their first collective).
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=spec.coordinator, num_processes=spec.num_processes,
                             process_id=spec.process_id, initialization_timeout=timeout_s)


def is_main_process() -> bool:
  """True on process 0 (and in single-process runs): the one that prints and writes files."""
  import jax

  return jax.process_index() == 0


def host_value(a):
  """A numpy copy of the whole (global) array `a`, on every process.

  Fully addressable arrays (single process, or replicated) are read directly; others
  are all-gathered across processes, a collective every process must call.
  """
  import jax
  import numpy as np

  if not isinstance(a, jax.Array) or a.is_fully_addressable or a.sharding.is_fully_replicated:
    return np.asarray(jax.device_get(a))
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def local_rows(sharding, global_shape: tuple[int, ...]) -> slice:
  """The contiguous range of leading-axis rows this process's devices hold under `sharding`."""
  starts, stops = [], []
  for idx in sharding.addressable_devices_indices_map(global_shape).values():
    s = idx[0] if idx else slice(None)
    start, stop, _ = s.indices(global_shape[0])
    starts.append(start)
    stops.append(stop)
  lo, hi = min(starts), max(stops)
  covered = set()
  for a, b in zip(starts, stops):
    covered.update(range(a, b))
  if covered != set(range(lo, hi)):
    raise ConfigError(f"this process's devices hold rows that are not contiguous under {sharding}; "
                      f"cannot load its batch slice")
  return slice(lo, hi)


def from_local_rows(sharding, local, global_shape: tuple[int, ...]):
  """The global array on `sharding` whose rows `local_rows(sharding, global_shape)` are `local`.

  Every process passes only its own rows; in a single process (all rows) this equals
  `jax.device_put(local, sharding)`.
  """
  import jax

  return jax.make_array_from_process_local_data(sharding, local, global_shape)
