"""Test set-up: 8 virtual CPU devices (must be set before jax is imported)."""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


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
