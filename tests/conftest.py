"""Test set-up: 8 virtual CPU devices (must be set before jax is imported)."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
# XLA:CPU's LLVM backend at -O0 without its expensive passes: the suite compiles hundreds of
# small programs and runs each a few times, so compile time dominates (on a 2-core
# machine: test_cli_end_to_end + test_expert_parallel_matches_expert_1 64.0 -> 57.3
# user-s; the fresh-clone CI run's pytest 905.8 -> 689.5 s, the same tests passing
# either way). Codegen only: the HLO, and so every
# reduction's order, is the same; every bitwise comparison in the suite is between
# programs compiled with the same flags (subprocesses inherit them: `subprocess_env`).
# Only on the CPU: on a GPU the same flags would steer XLA:GPU's LLVM pipeline too.
COMPILE_SPEED_FLAGS = ("--xla_backend_optimization_level=0",
                       "--xla_llvm_disable_expensive_passes=true")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] == "cpu":
  for _flag in COMPILE_SPEED_FLAGS:
    if _flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
      os.environ["XLA_FLAGS"] += " " + _flag
# numpy's OpenBLAS on one thread (read when numpy loads, so before it is imported). The
# Mosaic GPU interpreter runs every wgmma as a small np.matmul ([128, 64] @ [64, 128]);
# threaded OpenBLAS splits each over the cores and its worker spin-waits between calls
# (on a 2-core CI machine: 0.86 ms per such product with both cores busy vs 0.08 ms on
# one thread; the spinning worker takes 13% of a Pallas test's CPU time, CPU the other
# pytest worker needs). No bit depends on it: OpenBLAS splits a product over its
# threads by blocks of the output, never along K, and the interpreter's products are
# float64 and exact anyway (_NumpyWithRowInvariantMatmul below).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def subprocess_env(**extra) -> dict:
  """This process's environment for a subprocess that sizes its own virtual device pool
  (the training CLI, the bench scripts): XLA_FLAGS without the device count, the other
  flags (`COMPILE_SPEED_FLAGS`) kept."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if not f.startswith("--xla_force_host_platform_device_count"))
  return {**env, **extra}


class _NumpyWithRowInvariantMatmul:
  """numpy, but `matmul` in float64, rounded once to the dtype asked for.

  The Mosaic GPU interpreter (CPU interpret mode) computes each wgmma as
  `acc + np.matmul(a, b, dtype=float32)`, i.e. with the BLAS numpy was built with.
  OpenBLAS's float32 kernels round a row's dot products differently depending on
  where the row sits in the matrix on some CPUs (on a 2-core AMD EPYC with AVX2 every
  one of 127 row shifts of a [128, 64] @ [64, 128] product changes bits; other CPUs
  do not), which a GPU's wgmma does not do. The grouped GEMM's row-invariance test
  would then fail on such a CPU (1 bf16 element in 32768) for a reason outside the
  kernel. In float64 the products of bf16/f16 operands are exact, and so are their
  sums unless the terms span more than ~2^30, so a row's result does not depend on
  its position or on the CPU's BLAS. Only
  the interpreter's module sees this (`gpu_callbacks.np`); numpy itself is untouched.
  """

  def __getattr__(self, name):
    return getattr(np, name)

  @staticmethod
  def matmul(a, b, dtype=None):
    out = np.matmul(np.asarray(a, np.float64), np.asarray(b, np.float64))
    return out.astype(np.result_type(a, b) if dtype is None else dtype)


try:
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as _gpu_callbacks
except ImportError:   # no such interpreter module in this jax: numpy's own matmul
  _gpu_callbacks = None
if _gpu_callbacks is not None and hasattr(_gpu_callbacks, "np"):
  _gpu_callbacks.np = _NumpyWithRowInvariantMatmul()


def make_mesh(data: int, expert: int):
  """A (data, expert) mesh over the first data*expert devices."""
  return jax.make_mesh((data, expert), ("data", "expert"),
                       devices=jax.devices()[: data * expert])


@pytest.fixture(scope="session")
def mesh_factory():
  return make_mesh


def pytest_collection_modifyitems(config, items):
  if any(d.platform == "gpu" for d in jax.devices()):
    return
  skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip_gpu)
