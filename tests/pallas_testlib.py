"""Shared by the Pallas kernel tests: interpret-mode settings and the race check."""

import jax
import pytest
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental.pallas import mosaic_gpu as plgpu

ON_GPU = any(d.platform == "gpu" for d in jax.devices())
# On the CPU every kernel runs in the Mosaic GPU interpret mode with the race detector.
INTERPRET = False if ON_GPU else plgpu.InterpretGPUParams(detect_races=True)


@pytest.fixture(autouse=True)
def fresh_interpret_state():
  """Interpret mode keeps global state; a failed kernel leaves it dirty."""
  interpret_pallas_call.reset_gpu_interpret_mode_state()
  yield
  interpret_pallas_call.reset_gpu_interpret_mode_state()


def assert_no_races():
  """The race detector of the last interpreted kernel found nothing."""
  if ON_GPU:
    return
  assert gpu_callbacks._races is not None, "no interpreted kernel ran"
  assert not gpu_callbacks.get_races().races_found, "race detector reported a race"
