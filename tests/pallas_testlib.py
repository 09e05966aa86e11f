"""Shared by the Pallas kernel tests: interpret-mode settings and the race check."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
from jax.experimental.pallas import mosaic_gpu as plgpu

ON_GPU = any(d.platform == "gpu" for d in jax.devices())
# On the CPU every kernel runs in the Mosaic GPU interpret mode; INTERPRET_RACES with the
# race detector, for the launches a test checks with `assert_no_races` (the detector's
# state is the last launch's: it reports on that one only). The detector costs ~25% of
# an interpreted launch (on a 2-core CI machine the layer-mode FFN takes 35 s with it,
# 26 s without), so the launches no test asks about run without it.
INTERPRET = False if ON_GPU else plgpu.InterpretGPUParams()
INTERPRET_RACES = False if ON_GPU else plgpu.InterpretGPUParams(detect_races=True)


@pytest.fixture(autouse=True)
def fresh_interpret_state():
  """Interpret mode keeps global state; a failed kernel leaves it dirty."""
  interpret_pallas_call.reset_gpu_interpret_mode_state()
  yield
  interpret_pallas_call.reset_gpu_interpret_mode_state()


def assert_no_races():
  """The race detector of the last interpreted kernel (run with INTERPRET_RACES) found
  nothing."""
  if ON_GPU:
    return
  assert gpu_callbacks._races is not None, "no interpreted kernel ran"
  assert not gpu_callbacks.get_races().races_found, "race detector reported a race"


def skewed_plans(rng, r, el, t, k, skew, recv_rows=None):
  """Dispatch plans of all R ranks from random routing over E = R*El experts,
  expert 0 `skew` times likelier than the others (t tokens, k slots per rank)."""
  from uniep_jax import layout
  e = r * el
  p = np.full(e, 1.0)
  p[0] += skew
  p /= p.sum()
  topk = [jnp.asarray(rng.choice(e, size=(t, k), p=p), jnp.int32) for _ in range(r)]
  cm = jnp.stack([layout.local_group_sizes(x, e) for x in topk])
  # jitted with the rank traced, as inside the layer's shard_map: one program per shape
  # instead of an op-by-op dispatch compiling each primitive (integer outputs: exact)
  make_plan = jax.jit(layout.make_plan, static_argnames=("recv_rows",))
  return [make_plan(topk[q], cm, jnp.int32(q), recv_rows=recv_rows) for q in range(r)]
